"""RWKV-4's WKV, the reference (and the specification of `wkv.wkv4`): the numerically stable recurrence over
tokens, one step per token, in the inputs' dtype (float64 for a reference).

    wkv_t = (Σ_{i<t} e^{(t−1−i)w + k_i} v_i + e^{u + k_t} v_t) / (Σ_{i<t} e^{(t−1−i)w + k_i} + e^{u + k_t})

per channel, w < 0 the decay and u the bonus of the current token. The state before token t is (a, b, p): the
two sums scaled by e^{−p}, and p, their log scale (the largest exponent so far), so that every exponential is of
a difference ≤ 0 and nothing overflows however large k grows. No token yet: a = b = 0 and p = NO_TOKEN.
"""

from __future__ import annotations

import torch

# The exponent that stands for "no token yet": e^{NO_TOKEN − anything finite} is 0, and it stays finite in fp32.
NO_TOKEN = -1e30

State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def wkv4_step(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, u: torch.Tensor, state: State) -> tuple[
        torch.Tensor, State]:
    """One token. k, v: [B, d]; w, u: [d]; state (a, b, p): [B, d] -> (wkv [B, d], the state after the token)."""
    a, b, p = state
    now = u + k
    m = torch.maximum(p, now)
    e_old, e_now = torch.exp(p - m), torch.exp(now - m)
    wkv = (e_old * a + e_now * v) / (e_old * b + e_now)
    decayed = p + w
    q = torch.maximum(decayed, k)
    e_old, e_new = torch.exp(decayed - q), torch.exp(k - q)
    return wkv, (e_old * a + e_new * v, e_old * b + e_new, q)


def initial_state(k: torch.Tensor) -> State:
    """a = b = 0, p = NO_TOKEN: [B, d] like one token of k [B, T, d]."""
    B, _, d = k.shape
    return k.new_zeros(B, d), k.new_zeros(B, d), k.new_full((B, d), NO_TOKEN)


def wkv4_naive(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, u: torch.Tensor,
               state: State | None = None) -> tuple[torch.Tensor, State]:
    """The loop over tokens. k, v: [B, T, d]; w, u: [d]; state: (a, b, p) [B, d] or None (no token yet).
    Returns (wkv [B, T, d], the final state); differentiable in every input."""
    state = initial_state(k) if state is None else state
    out = []
    for t in range(k.shape[1]):
        y, state = wkv4_step(k[:, t], v[:, t], w, u, state)
        out.append(y)
    return torch.stack(out, dim=1), state  # [B, T, d]
