"""Mamba (Gu & Dao, 2023, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces"), a pure
PyTorch reference of the selective scan.

    x, z = split(Linear(d → 2·d_inner)(input))                 d_inner = expand·d
    x = SiLU(causal depthwise conv_k(x))
    Δ, B, C = softplus(Linear(dt_rank → d_inner)(·) + bias), Linear(d_inner → N), Linear(d_inner → N)   from x
    h_t = exp(Δ_t A) ⊙ h_{t-1} + Δ_t B_t x_t                   h: [d_inner, N], A = -exp(A_log) < 0
    y_t = h_t C_t + D ⊙ x_t;   out = Linear(d_inner → d)(y ⊙ SiLU(z))

What is unusual here:
- The scan is the plain loop over time (the specification) unless `chunk_size` > 0: then, inside a chunk, an
  inclusive prefix scan of the pairs (decay, input) in log2(chunk) doubling steps (Hillis-Steele:
  (a, b)∘(a', b') = (a·a', a·b' + b)), exact, no division, every token at once; across chunks the state is
  carried one chunk at a time: T/chunk + log2(chunk) sequential steps instead of T, at log2(chunk)× the memory
  traffic. The tests hold it to the loop. Not the default: it is slower than the loop on the CPU and about as
  fast on a GPU (`experiments/bench/mamba_scan.py`; timings in kernels/selective_scan/README.md and
  experiments/LOG.md).
- `impl="triton"` runs the scan as one Triton kernel per direction (kernels/selective_scan: one program per
  sequence and block of channels, the [BD, N] state in registers; the forward keeps the state every
  `scan_chunk` tokens, and the backward recomputes the others chunk by chunk). CUDA tensors, or CPU under
  TRITON_INTERPRET=1; fp32 inside (the scan runs outside autocast). Its custom op has a vmap rule (the members'
  sequences one after another, each with its own A), so such runs pack. It is an order of magnitude faster
  than the loop on a GPU, forward+backward (kernels/selective_scan/README.md).
- Initialisation: Gu & Dao's for the SSM: Δ = softplus(dt_bias) log-uniform over [dt_min, dt_max], the Δ
  projection's weight U(±dt_rank^-0.5), A_log = log(1..N) in every channel (S4D-real), D = 1. The Δ projection is
  two plain parameters (`dt_weight`, `dt_bias`), not an nn.Linear, so that the LanguageModel's init of every
  nn.Linear (normal 0.02, zero bias) leaves it alone. `init_weights`, which the LanguageModel calls after that,
  gives the rest Zoology's init for its Mamba blocks: PyTorch's own U(±1/√fan_in) for the projections and the
  conv, out_proj divided by √n_layers.
- The state is the real tensors decoding needs: {"conv": [B, k-1, d_inner], "ssm": [B, d_inner, N]} with the
  SSM part in fp32. state_size = d_inner·N + d_inner·(k-1), i.e. 2·d·N (REFERENCE's "Mamba: 2·d·d_state",
  expand 2) plus the conv inputs. Zoology reported None here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zoo.models.mixers._common import (
    check_choice,
    check_input,
    check_int,
    check_step_input,
    compute_dtype,
    log_impl,
    make_config,
    module_device_dtype,
    require_triton_device,
    zoology_mamba_block_init,
)
from zoo.models.mixers._long_conv import depthwise_causal_conv


@dataclass
class MambaConfig:
    """Options of `mamba` (d_model comes from the model)."""

    d_state: int = 16  # N
    expand: int = 2
    conv_size: int = 4
    dt_rank: int | None = None  # None: ceil(d_model / 16)
    dt_min: float = 1e-3
    dt_max: float = 1e-1
    chunk_size: int = 0  # tokens scanned at once by the prefix scan (0: the plain loop over time)
    impl: str = "naive"  # naive (PyTorch: the loop, or the chunked scan) | triton (kernels/selective_scan)
    # impl=triton: tokens between the states the forward keeps for the backward, which recomputes the others
    # (None: the kernel's CHUNK). 1 keeps every state: B·T·d_inner·N fp32 a layer.
    scan_chunk: int | None = None

    def validate(self, d_model: int) -> None:
        check_int("mamba: d_state", self.d_state, minimum=1)
        check_int("mamba: chunk_size", self.chunk_size, minimum=0)
        if self.scan_chunk is not None:
            check_int("mamba: scan_chunk", self.scan_chunk, minimum=1)
        check_choice("mamba: impl", self.impl, ("naive", "triton"))
        check_int("mamba: expand", self.expand, minimum=1)
        check_int("mamba: conv_size", self.conv_size, minimum=1)
        if self.dt_rank is not None:
            check_int("mamba: dt_rank", self.dt_rank, minimum=1)
        if not (0 < self.dt_min <= self.dt_max):
            raise ValueError(f"mamba: need 0 < dt_min <= dt_max, got {self.dt_min}, {self.dt_max}")


class Mamba(nn.Module):
    """Selective SSM block: [B, T, d_model] -> [B, T, d_model].

    State: {"conv": [B, conv_size-1, d_inner] past conv inputs, "ssm": [B, d_inner, d_state] (fp32)}.
    """

    Config = MambaConfig
    name = "mamba"
    vmap_impls = ("naive", "triton")  # zoo/steps.py packs these

    def __init__(self, d_model: int, **options) -> None:
        super().__init__()
        self.config = make_config(self.name, self.Config, d_model, options)
        self.d_model = d_model
        c = self.config
        self.d_inner = c.expand * d_model
        self.dt_rank = c.dt_rank if c.dt_rank is not None else math.ceil(d_model / 16)
        di, N = self.d_inner, c.d_state
        self.in_proj = nn.Linear(d_model, 2 * di, bias=False)
        self.conv_weight = nn.Parameter(torch.randn(di, c.conv_size) / math.sqrt(c.conv_size))
        self.conv_bias = nn.Parameter(torch.zeros(di))
        self.x_proj = nn.Linear(di, self.dt_rank + 2 * N, bias=False)
        # Δ's projection dt_rank -> d_inner: plain parameters, which the LanguageModel's init of nn.Linear (zero
        # bias) leaves alone. A zero bias makes every Δ softplus(0) = 0.69: the state then shrinks at least 2x a
        # token (A <= -1) and loses the keys MQAR asks for within a few tokens.
        bound = self.dt_rank**-0.5
        self.dt_weight = nn.Parameter(torch.empty(di, self.dt_rank).uniform_(-bound, bound))
        dt = torch.exp(torch.rand(di) * (math.log(c.dt_max) - math.log(c.dt_min)) + math.log(c.dt_min))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        self.A_log = nn.Parameter(torch.log(torch.arange(1, N + 1, dtype=torch.float32)).repeat(di, 1))  # [di, N]
        self.D = nn.Parameter(torch.ones(di))
        self.out_proj = nn.Linear(di, d_model, bias=False)
        log_impl(self.name, c.impl)

    def init_weights(self, n_layers: int) -> None:
        """Zoology's init for its Mamba blocks (`zoology_mamba_block_init`), run by the LanguageModel after its
        generic one; Δ, A and D keep the SSM init above."""
        zoology_mamba_block_init((self.in_proj, self.x_proj, self.out_proj), self.conv_weight, self.conv_bias, n_layers)

    def _prepare(self, x: torch.Tensor, history: torch.Tensor):
        """x: [B, T, d] -> (u, z: [B, T, di]; dt: [B, T, di]; Bm, Cm: [B, T, N]; new conv history)."""
        u, z = self.in_proj(x).chunk(2, dim=-1)  # [B, T, di] each
        u_conv = F.silu(depthwise_causal_conv(u, self.conv_weight, history) + self.conv_bias)  # [B, T, di]
        new_history = torch.cat([history.to(u.dtype), u], dim=1)[:, u.shape[1] :]  # [B, k-1, di]
        N = self.config.d_state
        dt_low, Bm, Cm = self.x_proj(u_conv).split([self.dt_rank, N, N], dim=-1)
        dt = F.softplus(F.linear(dt_low, self.dt_weight, self.dt_bias))  # [B, T, di]
        return u_conv, z, dt, Bm, Cm, new_history

    def _scan(self, u, dt, Bm, Cm, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The selective scan. h: [B, di, N] -> y: [B, T, di] and the final h."""
        A = -torch.exp(self.A_log.to(h.dtype))  # [di, N]
        u, dt, Bm, Cm = (t.to(h.dtype) for t in (u, dt, Bm, Cm))
        if self.config.impl == "triton":
            from kernels.selective_scan import selective_scan

            require_triton_device(u, self.name, "triton")
            y, h = selective_scan(u, dt, A, Bm, Cm, h, chunk=self.config.scan_chunk)
            return y + self.D.to(h.dtype) * u, h.to(u.dtype)
        C = self.config.chunk_size
        if C == 0 or u.shape[1] == 1:
            ys = []
            for t in range(u.shape[1]):
                decay = torch.exp(dt[:, t, :, None] * A)  # [B, di, N]
                h = decay * h + dt[:, t, :, None] * Bm[:, t, None, :] * u[:, t, :, None]
                ys.append(torch.einsum("bdn,bn->bd", h, Cm[:, t]))
            return torch.stack(ys, dim=1) + self.D.to(h.dtype) * u, h  # [B, T, di], [B, di, N]
        ys = []
        for s in range(0, u.shape[1], C):
            c = slice(s, s + C)
            a = torch.exp(dt[:, c, :, None] * A)  # [B, C, di, N] decays
            b = dt[:, c, :, None] * Bm[:, c, None, :] * u[:, c, :, None]  # [B, C, di, N] inputs
            b = torch.cat([b[:, :1] + a[:, :1] * h[:, None], b[:, 1:]], dim=1)  # the carried state enters
            k, n = 1, a.shape[1]
            while k < n:  # after this step, position t holds the scan of tokens t-2k+1..t (and the state)
                b = torch.cat([b[:, :k], b[:, k:] + a[:, k:] * b[:, :-k]], dim=1)
                if 2 * k < n:
                    a = torch.cat([a[:, :k], a[:, k:] * a[:, :-k]], dim=1)
                k *= 2
            h = b[:, -1]
            ys.append(torch.einsum("btdn,btn->btd", b, Cm[:, c]))
        return torch.cat(ys, dim=1) + self.D.to(h.dtype) * u, h

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [B, T, d_model] -> [B, T, d_model]. With a state: continues the conv and the scan from it."""
        check_input(x, self.d_model, self.name)
        initial = self.init_state(x.shape[0], x.device, x.dtype) if state is None else state
        u, z, dt, Bm, Cm, new_history = self._prepare(x, initial["conv"])
        dtype = torch.promote_types(x.dtype, initial["ssm"].dtype)
        with torch.autocast(device_type=x.device.type, enabled=False):
            y, h = self._scan(u, dt, Bm, Cm, initial["ssm"].to(dtype))
        if state is not None:
            state["conv"].copy_(new_history)
            state["ssm"].copy_(h)
        return self.out_proj(y.to(x.dtype) * F.silu(z))  # [B, T, d_model]

    def step(self, x_t: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """x_t: [B, d_model] -> [B, d_model]; one scan step, state updated in place."""
        check_step_input(x_t, self.d_model, self.name)
        return self.forward(x_t[:, None], state)[:, 0]

    def init_state(
        self, batch_size: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """Zeroed conv inputs [B, conv_size-1, d_inner] (module dtype) and SSM state [B, d_inner, N] (fp32+)."""
        device, dtype = module_device_dtype(self, device, dtype)
        c = self.config
        return {
            "conv": torch.zeros(batch_size, c.conv_size - 1, self.d_inner, device=device, dtype=dtype),
            "ssm": torch.zeros(batch_size, self.d_inner, c.d_state, device=device, dtype=compute_dtype(dtype)),
        }

    def state_size(self, seq_len: int) -> int:
        """d_inner·d_state + d_inner·(conv_size-1), constant in seq_len."""
        return self.d_inner * (self.config.d_state + self.config.conv_size - 1)
