"""Causal multi-head softmax attention (Vaswani et al., 2017, "Attention Is All You Need").

The baseline of the Zoology recall plots: exact recall, and a state that grows with the sequence (2·T·d
elements: keys and values of every past token).

What is unusual here:
- Positions are one option: `rotary` (Su et al., 2021, applied to q and k), `learned` (a table of
  `max_seq_len` rows added to the input of the q and k projections only, inside the mixer) or `none`.
  Zoology's absolute positions, added to the token embeddings, are the LanguageModel's
  `max_position_embeddings` (with `positional: none` here).
- `dropout` drops attention weights while training (Zoology's MHA: 0.1); `bias` gives the qkv and output
  projections biases (Zoology's MHA has them).
- The decode state is a KV buffer preallocated at `max_seq_len` rows plus an integer position, so `step`
  has fixed shapes (CUDA-graph friendly): each step attends over the whole buffer with a mask instead of
  slicing the live prefix. `state_size(T)` counts the live part, 2·T·d_model; the buffer holds
  2·max_seq_len·d_model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from kernels.launch import is_capturing
from zoo.models.mixers._common import (
    apply_rotary,
    check_choice,
    check_input,
    check_int,
    check_step_input,
    default_num_heads,
    make_config,
    module_device_dtype,
)


@dataclass
class AttentionConfig:
    """Options of `attention` (d_model comes from the model)."""

    num_heads: int | None = None  # None: default_num_heads(d_model), heads of width about 64
    positional: str = "rotary"  # rotary | learned | none
    max_seq_len: int = 2048  # rows of the decode KV buffer (and of the learned position table)
    dropout: float = 0.0  # attention-weight dropout while training
    bias: bool = False  # biases on the qkv and output projections

    def validate(self, d_model: int) -> None:
        if self.num_heads is not None:
            check_int("attention: num_heads", self.num_heads, minimum=1)
            if d_model % self.num_heads:
                raise ValueError(f"attention: d_model={d_model} must be divisible by num_heads={self.num_heads}")
        check_choice("attention: positional", self.positional, ("rotary", "learned", "none"))
        check_int("attention: max_seq_len", self.max_seq_len, minimum=1)
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"attention: dropout must be a number in [0, 1), got {self.dropout!r}")
        if not isinstance(self.bias, bool):
            raise ValueError(f"attention: bias must be true or false, got {self.bias!r}")
        if self.positional == "rotary" and (d_model // self.heads(d_model)) % 2:
            raise ValueError(
                f"attention: rotary needs an even head dim, got d_model={d_model} / num_heads={self.heads(d_model)}"
            )

    def heads(self, d_model: int) -> int:
        return self.num_heads if self.num_heads is not None else default_num_heads(d_model)


class Attention(nn.Module):
    """Causal MHA: [B, T, d_model] -> [B, T, d_model].

    State: {"k", "v": [B, max_seq_len, H, D] post-rotary keys and values, "pos": [] int64 tokens seen}
    and, optionally, "start": [B] int64, the first position each row may attend to.
    """

    Config = AttentionConfig
    name = "attention"
    slot_state = ("k", "v")  # [B, slots, H, D]: a step reads the filled slots and writes one (step_state_nbytes)

    def __init__(self, d_model: int, **options) -> None:
        super().__init__()
        self.config = make_config(self.name, self.Config, d_model, options)
        self.d_model = d_model
        self.num_heads = self.config.heads(d_model)
        self.head_dim = d_model // self.num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=self.config.bias)
        self.out = nn.Linear(d_model, d_model, bias=self.config.bias)
        if self.config.positional == "learned":
            self.pos_table = nn.Parameter(torch.empty(self.config.max_seq_len, d_model))
            nn.init.normal_(self.pos_table, std=0.02)

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, d_model], positions: [T] -> q, k, v: [B, T, H, D] (q and k carry the positions)."""
        d = self.d_model
        w_qk, w_v = self.qkv.weight[: 2 * d], self.qkv.weight[2 * d :]
        b_qk, b_v = (None, None) if self.qkv.bias is None else (self.qkv.bias[: 2 * d], self.qkv.bias[2 * d :])
        x_qk = x + self.pos_table[positions] if self.config.positional == "learned" else x
        q, k = F.linear(x_qk, w_qk, b_qk).chunk(2, dim=-1)  # [B, T, d] each
        v = F.linear(x, w_v, b_v)  # [B, T, d]
        q, k, v = (rearrange(t, "b t (h d) -> b t h d", h=self.num_heads) for t in (q, k, v))  # [B, T, H, D]
        if self.config.positional == "rotary":
            q, k = apply_rotary(q, positions), apply_rotary(k, positions)
        return q, k, v

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q: [B, T, H, D], k, v: [B, S, H, D], mask: [T, S] or [B, 1, T, S] bool (None: causal, S == T)
        -> [B, T, d_model]."""
        q, k, v = (rearrange(t, "b t h d -> b h t d") for t in (q, k, v))  # [B, H, T, D]
        dropout = self.config.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout)
        return self.out(rearrange(y, "b h t d -> b t (h d)"))  # [B, T, d_model]

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [B, T, d_model] -> [B, T, d_model]. With a state: attends to the cached prefix, then appends."""
        check_input(x, self.d_model, self.name)
        T = x.shape[1]
        if state is None:
            if self.config.positional == "learned" and T > self.config.max_seq_len:
                raise ValueError(f"attention: T={T} exceeds max_seq_len={self.config.max_seq_len} (learned positions)")
            q, k, v = self._qkv(x, torch.arange(T, device=x.device))
            return self._attend(q, k, v, mask=None)
        buf_k, buf_v, pos = state["k"], state["v"], state["pos"]
        if not is_capturing(x) and int(pos) + T > self.config.max_seq_len:
            raise ValueError(f"attention: state holds {int(pos)} tokens, +{T} exceeds max_seq_len={buf_k.shape[1]}")
        positions = pos + torch.arange(T, device=x.device)  # [T]
        q, k, v = self._qkv(x, positions)
        buf_k.index_copy_(1, positions, k.to(buf_k.dtype))
        buf_v.index_copy_(1, positions, v.to(buf_v.dtype))
        slots = torch.arange(buf_k.shape[1], device=x.device)  # [S]
        mask = slots[None, :] <= positions[:, None]  # [T, S]
        if "start" in state:
            mask = (mask & (slots[None, None, :] >= state["start"][:, None, None]))[:, None]  # [B, 1, T, S]
        y = self._attend(q, buf_k.to(q.dtype), buf_v.to(q.dtype), mask)
        pos.add_(T)
        return y

    def step(self, x_t: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """x_t: [B, d_model] -> [B, d_model]; appends one token to the state in place."""
        check_step_input(x_t, self.d_model, self.name)
        return self.forward(x_t[:, None], state)[:, 0]

    def init_state(
        self, batch_size: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """Zeroed KV buffer [B, max_seq_len, H, D] (module's device/dtype by default) and pos = 0."""
        device, dtype = module_device_dtype(self, device, dtype)
        shape = (batch_size, self.config.max_seq_len, self.num_heads, self.head_dim)
        return {
            "k": torch.zeros(shape, device=device, dtype=dtype),
            "v": torch.zeros(shape, device=device, dtype=dtype),
            "pos": torch.zeros((), device=device, dtype=torch.int64),
        }

    def state_size(self, seq_len: int) -> int:
        """Live KV elements per sequence after seq_len tokens: 2·seq_len·d_model."""
        return 2 * seq_len * self.d_model
