"""torch.func.vmap rules for the kernels' custom ops: a vmapped call becomes one plain call of the op on all the
members at once, with the members laid out where the kernel already iterates (side by side as channels, or as more
sequences). Packed training (zoo/steps.py) vmaps a model's forward over N members and takes torch.autograd.grad
outside the vmap, so the backward ops see the plain, folded tensors and need no rule of their own."""

from __future__ import annotations

import torch


def members_first(n: int, t: torch.Tensor | None, dim: int | None) -> torch.Tensor | None:
    """The member dim of a vmapped argument moved to the front; an argument not batched is expanded to n members."""
    if t is None:
        return None
    return t.expand(n, *t.shape) if dim is None else t.movedim(dim, 0)


def members_as_channels(t: torch.Tensor | None) -> torch.Tensor | None:
    """[N, ..., C] -> [..., N·C]: member m's channels at m·C … (m+1)·C - 1."""
    return None if t is None else t.movedim(0, -2).flatten(-2)


def channels_as_members(t: torch.Tensor, n: int) -> torch.Tensor:
    """[..., N·C] -> [N, ..., C], the inverse of `members_as_channels`."""
    return t.unflatten(-1, (n, -1)).movedim(-2, 0)
