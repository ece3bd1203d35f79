"""Sliding-window causal attention with rotary positions (the local attention of Based, Arora et al., 2024;
windowed attention as in Longformer, Beltagy et al., 2020); `rotary=False, bias=True` is Zoology's SlidingAttn
(no positions, biased projections).

Token i attends to keys i-window+1 .. i (itself included), so the state is a fixed 2·window·d_model.

What is unusual here:
- The decode state is a ring buffer of exactly `window` tokens (token p lives in slot p mod window), not a
  max-length cache that only reads its last rows (the released Based code's choice).
- Forward with a state over a chunk attends to [ring buffer ; chunk] with a mask built from the absolute
  position each slot holds, then writes the chunk's last min(T, window) tokens into the ring. Shapes depend
  only on T and window, and no device value is read, so step (a chunk of one) can be CUDA-graphed.
- A state may also hold `start` [B] int64 (init_state leaves it out), the first position each row may attend to.
  Left-padded generation (zoo.models.hf) prefills a row whose prompt is P tokens shorter from position P,
  so every row reaches the same `pos`; `start` = P keeps the ring slots before P (never written) out of
  its attention. Rotary is relative, so the shift changes nothing else.
- Training forward is SDPA with a banded boolean mask: O(T²) work, fine up to T ≈ 2048.
- `impl="triton"` runs the decoding step (a chunk of one token with a state) as one kernel
  (kernels/sliding_window: rotary, the ring write and the attention over the ring); training and chunked prefill
  stay the PyTorch forward. `impl="naive"` (the default) is PyTorch throughout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from zoo.models.mixers._common import (
    apply_rotary,
    check_choice,
    check_input,
    check_int,
    check_step_input,
    default_num_heads,
    log_impl,
    make_config,
    module_device_dtype,
    require_triton_device,
    rotary_inv_freq,
)


@dataclass
class SlidingWindowConfig:
    """Options of `sliding_window` (d_model comes from the model)."""

    window: int = 64  # keys per query, itself included
    num_heads: int | None = None  # None: default_num_heads(d_model), heads of width about 64
    impl: str = "naive"  # naive | triton (the decoding step as one kernel, kernels/sliding_window)
    rotary: bool = True  # rotary positions on q and k; False: no positions (Zoology's SlidingAttn)
    bias: bool = False  # biases on the qkv and output projections (Zoology's SlidingAttn has them)

    def validate(self, d_model: int) -> None:
        check_int("sliding_window: window", self.window, minimum=1)
        check_choice("sliding_window: impl", self.impl, ("naive", "triton"))
        for name in ("rotary", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"sliding_window: {name} must be true or false, got {getattr(self, name)!r}")
        if self.num_heads is not None:
            check_int("sliding_window: num_heads", self.num_heads, minimum=1)
            if d_model % self.num_heads:
                raise ValueError(f"sliding_window: d_model={d_model} must be divisible by num_heads={self.num_heads}")
        if self.rotary and (d_model // self.heads(d_model)) % 2:
            raise ValueError(
                f"sliding_window: rotary needs an even head dim, got d_model={d_model} / "
                f"num_heads={self.heads(d_model)}"
            )

    def heads(self, d_model: int) -> int:
        return self.num_heads if self.num_heads is not None else default_num_heads(d_model)


class SlidingWindowAttention(nn.Module):
    """Causal attention over the last `window` keys: [B, T, d_model] -> [B, T, d_model].

    State: {"k", "v": [B, window, H, D] ring buffer of post-rotary keys and values, "pos": [] int64}
    and, optionally, "start": [B] int64, the first position each row may attend to.
    """

    Config = SlidingWindowConfig
    name = "sliding_window"
    vmap_impls = ("naive", "triton")  # training is the PyTorch forward under either: zoo/steps.py packs both
    slot_state = ("k", "v")  # [B, slots, H, D]: a step reads the slots and writes one (step_state_nbytes)

    def __init__(self, d_model: int, **options) -> None:
        super().__init__()
        self.config = make_config(self.name, self.Config, d_model, options)
        self.d_model = d_model
        self.window = self.config.window
        self.num_heads = self.config.heads(d_model)
        self.head_dim = d_model // self.num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=self.config.bias)
        self.out = nn.Linear(d_model, d_model, bias=self.config.bias)
        self.rotary = self.config.rotary
        self.impl = self.config.impl
        self._inv_freq: dict[torch.device, torch.Tensor] = {}  # impl=triton: rotary frequencies per device
        if self.impl == "triton":
            from kernels.sliding_window.decode import window_decode

            self._window_decode = window_decode
            log_impl(self.name, self.impl)

    def _triton_step(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """x: [B, 1, d_model] -> [B, 1, d_model] through the fused decoding kernel; advances pos."""
        require_triton_device(x, self.name, self.impl)
        if x.dtype == torch.float64:
            raise ValueError("sliding_window impl='triton' takes fp32, fp16 or bf16 activations, got float64")
        inv_freq = self._inv_freq.get(x.device)
        if inv_freq is None:  # apply_rotary's frequencies in fp32, made once per device (before any graph capture)
            inv_freq = self._inv_freq[x.device] = rotary_inv_freq(self.head_dim, x.device, torch.float32)
        # [D/2], as apply_rotary computes them; without rotary a rotation by 0 leaves q and k as they are
        angles = state["pos"].to(torch.float32) * inv_freq if self.rotary else torch.zeros_like(inv_freq)
        y = self._window_decode(self.qkv(x[:, 0]), state["k"], state["v"], state["pos"], angles.cos(), angles.sin(),
                                state.get("start"))  # [B, d_model]
        state["pos"].add_(1)
        return self.out(y)[:, None]

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, d_model], positions: [T] -> q, k, v: [B, T, H, D], q and k rotated (with `rotary`)."""
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # [B, T, d] each
        q, k, v = (rearrange(t, "b t (h d) -> b t h d", h=self.num_heads) for t in (q, k, v))  # [B, T, H, D]
        if not self.rotary:
            return q, k, v
        return apply_rotary(q, positions), apply_rotary(k, positions), v

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q: [B, T, H, D], k, v: [B, S, H, D], mask: [T, S] or [B, 1, T, S] bool -> [B, T, d_model]."""
        q, k, v = (rearrange(t, "b t h d -> b h t d") for t in (q, k, v))  # [B, H, T, D]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, T, D]
        return self.out(rearrange(y, "b h t d -> b t (h d)"))  # [B, T, d_model]

    def _band(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """[T] and [S] absolute positions -> [T, S] bool: key within the window ending at the query."""
        delta = query_pos[:, None] - key_pos[None, :]  # [T, S]
        return (delta >= 0) & (delta < self.window)

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [B, T, d_model] -> [B, T, d_model]. With a state: attends to [ring ; chunk], then updates the ring."""
        check_input(x, self.d_model, self.name)
        T, w = x.shape[1], self.window
        if state is None:
            positions = torch.arange(T, device=x.device)  # [T]
            q, k, v = self._qkv(x, positions)
            return self._attend(q, k, v, self._band(positions, positions))
        if T == 1 and self.impl == "triton":
            return self._triton_step(x, state)
        ring_k, ring_v, pos = state["k"], state["v"], state["pos"]
        positions = pos + torch.arange(T, device=x.device)  # [T]
        q, k, v = self._qkv(x, positions)
        slots = torch.arange(w, device=x.device)  # [w]
        if T == 1:
            # Decoding: write the token into its slot first; the ring then holds exactly the window ending at the
            # token, so attention reads the ring in place. A [ring ; token] copy would move every layer's whole
            # window of keys and values on every step, a large share of a large-batch decode step.
            ring_k.index_copy_(1, torch.remainder(pos, w)[None], k.to(ring_k.dtype))
            ring_v.index_copy_(1, torch.remainder(pos, w)[None], v.to(ring_v.dtype))
            slot_pos = pos - torch.remainder(pos - slots, w)  # [w]: the latest position ≤ pos in each slot
            mask = (slot_pos >= 0)[None, :]  # [1, w]
            if "start" in state:
                mask = (mask & (slot_pos[None, None, :] >= state["start"][:, None, None]))[:, None]  # [B, 1, 1, w]
            y = self._attend(q, ring_k.to(q.dtype), ring_v.to(v.dtype), mask)
            pos.add_(1)
            return y
        # Slot s holds the latest position p < pos with p ≡ s (mod w); p < 0 means the slot is still empty.
        slot_pos = pos - 1 - torch.remainder(pos - 1 - slots, w)  # [w]
        ring_mask = self._band(positions, slot_pos) & (slot_pos >= 0)[None, :]  # [T, w]
        mask = torch.cat([ring_mask, self._band(positions, positions)], dim=1)  # [T, w + T]
        if "start" in state:
            key_pos = torch.cat([slot_pos, positions])  # [w + T]
            mask = mask & (key_pos[None, None, :] >= state["start"][:, None, None])  # [B, T, w + T]
            mask = mask[:, None]  # [B, 1, T, w + T]
        keys = torch.cat([ring_k.to(k.dtype), k], dim=1)  # [B, w + T, H, D]
        values = torch.cat([ring_v.to(v.dtype), v], dim=1)  # [B, w + T, H, D]
        y = self._attend(q, keys, values, mask)
        kept = min(T, w)
        ring_slots = torch.remainder(positions[T - kept :], w)  # [kept]
        ring_k.index_copy_(1, ring_slots, k[:, T - kept :].to(ring_k.dtype))
        ring_v.index_copy_(1, ring_slots, v[:, T - kept :].to(ring_v.dtype))
        pos.add_(T)
        return y

    def step(self, x_t: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """x_t: [B, d_model] -> [B, d_model]; writes the token into its ring slot in place."""
        check_step_input(x_t, self.d_model, self.name)
        return self.forward(x_t[:, None], state)[:, 0]

    def init_state(
        self, batch_size: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """Zeroed ring buffer [B, window, H, D] (module's device/dtype by default) and pos = 0."""
        device, dtype = module_device_dtype(self, device, dtype)
        shape = (batch_size, self.window, self.num_heads, self.head_dim)
        return {
            "k": torch.zeros(shape, device=device, dtype=dtype),
            "v": torch.zeros(shape, device=device, dtype=dtype),
            "pos": torch.zeros((), device=device, dtype=torch.int64),
        }

    def state_size(self, seq_len: int) -> int:
        """Ring-buffer elements per sequence: 2·window·d_model, whatever seq_len (the buffer is preallocated)."""
        return 2 * self.window * self.d_model
