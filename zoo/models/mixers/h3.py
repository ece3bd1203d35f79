"""H3 (Fu et al., 2023, "Hungry Hungry Hippos: Towards Language Modeling with State Space Models").

    q, k, v = split(Linear(d → 3d)(x))
    k' = shift(k)                         a learned causal FIR of length `shift_size` per channel (shift SSM)
    y = Linear(d → d)(q ⊙ SSM_diag(k' ⊙ v))

SSM_diag runs `d_state` real diagonal modes per channel (S4D-real style):

    s_t = a ⊙ s_{t-1} + b · u_t,   out_t = Σ_n c_n s_{t,n} + D · u_t,   a = exp(-Δ·A) ∈ (0, 1)

with A_n = n + 1 and Δ per head. `ssm="zoology"` runs Zoology's SSKernel instead (S4D-Lin, bilinear): d_state/2
complex modes A_m = -1/2 + iπm (the real part kept negative as -exp(·)), B_m = 1, C_m complex normal,
s_t = dA ⊙ s_{t-1} + dB·u_t with dA = (1 + ΔA/2)/(1 - ΔA/2), dB = B·Δ/(1 - ΔA/2),
out_t = 2·Re(Σ_m C_m s_{t,m}) + D·u_t, its state the modes' real and imaginary parts side by side (d_state reals,
as many as the real modes); and the shift is Zoology's shift SSM: its filter the correlation of a trainable B
(started at e₁) with the taps C, h[l] = Σ_n B_n C_{n+l} (h = C at init; the product changes how it trains), plus
its separate skip weight, k' = shift(k) + ssm_k_D ⊙ k.

With `head_dim` p > 1 (Zoology Fig. 2 uses p = 2) the d channels form H = d/p heads: every head's p×p outer products
k'_h v_hᵀ each run through that head's SSM, and the head's output is q_hᵀ · SSM(k'_h v_hᵀ). With p = 1 (the default)
q ⊙ and k' ⊙ v are elementwise, one SSM per channel.

What is unusual here:
- The parallel form builds the SSM's kernel once per head, K[l, h] = Σ_n c_n b_n a_n^l (a head's p·p inputs
  share a, b, c), with D added at lag 0, and convolves through `causal_conv` (a Toeplitz matmul up to its
  DIRECT_MAX_T positions, an FFT beyond) with the inputs laid out [p, p, B, T, H]: one Toeplitz matrix per head,
  the head's p·p inputs and the batch its columns. The read-out q_hᵀ · Y_h is p elementwise products and a sum
  (an einsum would run it as B·T·H matmuls of [1, p] x [p, p]). Under autocast the convolution takes the
  autocast dtype (causal_conv's rule) and the outer products are built in it; the kernel and the read-out stay
  fp32. A carried state enters as Σ_n c_n a_n^{t+1} s_0, and the final state is a^T s_0 + Σ_s a^{T-1-s} b u_s,
  both per head.
- ssm=zoology's kernel is computed in real arithmetic (dA's modulus and angle, `_zoology_kernel`), so that
  torch.compile fuses it into a few kernels; complex tensors would run as one unfused op each. The recurrence
  (step, a carried state) keeps complex numbers.
- State: {"shift": [B, shift_size-1, d], "ssm": [B, d·p, d_state]} (the H·p·p SSM inputs), the SSM part in
  fp32 (fp64 for fp64 models). state_size = p·d·d_state (REFERENCE's "H3: d·d_state" at p = 1) +
  d·(shift_size-1) for the shift register.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from zoo.models.mixers._common import (
    check_input,
    check_int,
    check_step_input,
    compute_dtype,
    make_config,
    module_device_dtype,
)
from zoo.models.mixers._long_conv import causal_conv, explicit_causal_conv


@dataclass
class H3Config:
    """Options of `h3` (d_model comes from the model)."""

    d_state: int = 64  # diagonal SSM modes per channel (Zoology Fig. 2 uses d_state = L)
    head_dim: int = 1  # p: width of the heads whose p×p outer products share one SSM (Zoology Fig. 2: 2)
    shift_size: int = 4  # length of the shift filter on k (Zoology's shift SSM has d_state taps)
    dt_min: float = 1e-3
    dt_max: float = 1e-1
    ssm: str = "real"  # real (S4D-real modes) | zoology (Zoology's SSKernel: complex S4D-Lin, bilinear; see H3)

    def validate(self, d_model: int) -> None:
        check_int("h3: d_state", self.d_state, minimum=1)
        if self.ssm not in ("real", "zoology"):
            raise ValueError(f"h3: ssm must be real or zoology, got {self.ssm!r}")
        if self.ssm == "zoology" and self.d_state % 2:
            raise ValueError(f"h3: ssm=zoology holds d_state/2 complex modes: d_state must be even, got {self.d_state}")
        check_int("h3: shift_size", self.shift_size, minimum=1)
        check_int("h3: head_dim", self.head_dim, minimum=1)
        if d_model % self.head_dim:
            raise ValueError(f"h3: d_model={d_model} must be divisible by head_dim={self.head_dim}")
        for name in ("dt_min", "dt_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"h3: {name} must be a number > 0, got {value!r}")
        if self.dt_min > self.dt_max:
            raise ValueError(f"h3: dt_min={self.dt_min} exceeds dt_max={self.dt_max}")


class H3(nn.Module):
    """H3: [B, T, d_model] -> [B, T, d_model].

    State: {"shift": [B, shift_size-1, d] past k, "ssm": [B, d·head_dim, d_state] diagonal SSM state (fp32)}.
    """

    Config = H3Config
    name = "h3"

    def __init__(self, d_model: int, **options) -> None:
        super().__init__()
        self.config = make_config(self.name, self.Config, d_model, options)
        self.d_model = d_model
        d, N, k = d_model, self.config.d_state, self.config.shift_size
        self.p = self.config.head_dim
        H = d // self.p
        self.channels = H * self.p * self.p  # SSM inputs: one per (head, i, j)
        self.qkv = nn.Linear(d, 3 * d)
        self.shift_weight = nn.Parameter(torch.randn(d, k) / math.sqrt(k))
        lo, hi = math.log(self.config.dt_min), math.log(self.config.dt_max)
        self.log_dt = nn.Parameter(torch.rand(H) * (hi - lo) + lo)  # [H]
        self.complex = self.config.ssm == "zoology"
        if self.complex:
            # Zoology's SSKernel (mode diag, measure diag-lin, bilinear, real_type exp): M = N/2 modes per head,
            # A_m = -exp(inv_A_real) + i·A_imag = -1/2 + iπm, B_m = 1 and C_m complex normal (real, imag pairs), and
            # a separate skip weight on the shift's input (its ssm_k_D).
            M = N // 2
            self.inv_A_real = nn.Parameter(torch.full((H, M), math.log(0.5)))
            self.A_imag = nn.Parameter(math.pi * torch.arange(M, dtype=torch.float32).repeat(H, 1))
            self.B = nn.Parameter(torch.stack([torch.ones(H, M), torch.zeros(H, M)], dim=-1))  # [H, M, 2]
            self.C = nn.Parameter(torch.randn(H, M, 2) / math.sqrt(2))  # [H, M, 2]: torch.randn(cfloat)
            self.shift_skip = nn.Parameter(torch.randn(d))
            self.shift_b = nn.Parameter(torch.zeros(d, k))  # [d, k]: the shift SSM's B, e₁ per channel
            with torch.no_grad():
                self.shift_b[:, 0] = 1.0
        else:
            self.log_A = nn.Parameter(torch.log(torch.arange(1, N + 1, dtype=torch.float32)).repeat(H, 1))  # [H, N]
            self.B = nn.Parameter(torch.ones(H, N))
            self.C = nn.Parameter(torch.randn(H, N) / math.sqrt(N))
            self.shift_skip = None
            self.shift_b = None
        self.D = nn.Parameter(torch.randn(H))
        self.out = nn.Linear(d, d)

    @torch.no_grad()
    def zoology_init(self, layer_idx: int) -> None:
        """Zoology's shift SSM starts its kernel C of d_state taps at torch.nn.Conv1d's init, U(±1/√taps), and
        its B at e₁."""
        bound = 1 / math.sqrt(self.config.shift_size)
        self.shift_weight.uniform_(-bound, bound)
        if self.shift_b is not None:
            self.shift_b.zero_()
            self.shift_b[:, 0] = 1.0

    def _complex_terms(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ssm=zoology, bilinear: dA = (1 + ΔA/2)/(1 - ΔA/2), dB = B·Δ/(1 - ΔA/2) and C, complex [H, M] each,
        with out_t = 2·Re(Σ_m C_m s_{t,m}) and s_t = dA ⊙ s_{t-1} + dB·u_t."""
        cdtype = torch.complex128 if dtype == torch.float64 else torch.complex64
        dt = torch.exp(self.log_dt.to(dtype))[:, None]  # [H, 1]
        A = torch.complex(-torch.exp(self.inv_A_real.to(dtype)), self.A_imag.to(dtype)).to(cdtype)  # [H, M]
        dtA = A * dt
        dA = (1 + dtA / 2) / (1 - dtA / 2)
        B = torch.complex(self.B[..., 0].to(dtype), self.B[..., 1].to(dtype)).to(cdtype)
        C = torch.complex(self.C[..., 0].to(dtype), self.C[..., 1].to(dtype)).to(cdtype)
        return dA, B * dt / (1 - dtA / 2), C

    def _zoology_kernel(self, lags: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """ssm=zoology's convolution kernel K[l, h] = 2·Re(Σ_m C_m dB_m dA_m^l) [T, H] for lags [T], in real
        arithmetic, so that torch.compile fuses it (complex tensors run as one unfused op each). With z = Δ·A =
        x + iy: dA = ((1 - |z|²/4) + iy) / |1 - z/2|², its modulus r = |1 + z/2| / |1 - z/2| and angle
        θ = atan2(y, 1 - |z|²/4); C·dB = C·B·Δ·conj(1 - z/2) / |1 - z/2|² = w; and Re(w·dA^l) = r^l (Re w·cos lθ -
        Im w·sin lθ)."""
        dt = torch.exp(self.log_dt.to(dtype))[:, None]  # [H, 1]
        x = -torch.exp(self.inv_A_real.to(dtype)) * dt  # [H, M]: Re z
        y = self.A_imag.to(dtype) * dt  # Im z
        den = (1 - x / 2) ** 2 + (y / 2) ** 2  # |1 - z/2|²
        log_r = 0.5 * (torch.log((1 + x / 2) ** 2 + (y / 2) ** 2) - torch.log(den))
        theta = torch.atan2(y, 1 - (x * x + y * y) / 4)
        b_re, b_im, c_re, c_im = (t.to(dtype) for t in (self.B[..., 0], self.B[..., 1], self.C[..., 0], self.C[..., 1]))
        cb_re, cb_im = c_re * b_re - c_im * b_im, c_re * b_im + c_im * b_re  # C·B
        scale = dt / den
        w_re = scale * (cb_re * (1 - x / 2) - cb_im * (y / 2))
        w_im = scale * (cb_re * (y / 2) + cb_im * (1 - x / 2))
        l = lags[:, None, None]  # [T, 1, 1]
        terms = torch.exp(l * log_r) * (w_re * torch.cos(l * theta) - w_im * torch.sin(l * theta))  # [T, H, M]
        return 2 * terms.sum(-1)  # [T, H]

    def _per_channel(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A per-head parameter [H, ...] -> [H·p·p, ...] (every SSM input of the head), in `dtype`."""
        return t.to(dtype).repeat_interleave(self.p * self.p, dim=0)

    def _log_a(self, dtype: torch.dtype) -> torch.Tensor:
        """log a = -Δ·A per head: [H, N], in `dtype`."""
        return -(torch.exp(self.log_dt.to(dtype))[:, None] * torch.exp(self.log_A.to(dtype)))  # [H, N]

    def _shift_filter(self) -> torch.Tensor:
        """The shift's taps [d, k] in explicit_causal_conv's order (the last multiplies the current input): the
        learned taps, or with ssm=zoology their correlation with B, h[l] = Σ_n B_n C_{n+l} for C = the taps in lag
        order (zero past the k-th), in fp32 or wider. Zoology computes it with FFTs of length 2k; here it is the
        direct sum over windows of C, which torch.compile fuses (FFTs and their complex spectra run as separate
        ops), at d·k² multiply-adds; eager code holds the [d, k, k] product (134 MB at d = 512, k = 256)."""
        if self.shift_b is None:
            return self.shift_weight
        k = self.config.shift_size
        dtype = torch.promote_types(self.shift_weight.dtype, torch.float32)
        with torch.autocast(device_type=self.shift_weight.device.type, enabled=False):
            c_lag = self.shift_weight.to(dtype).flip(1)  # [d, k]: c_lag[:, l] multiplies the input l steps back
            windows = F.pad(c_lag, (0, k - 1)).unfold(1, k, 1)  # [d, k (l), k (n)]: C_{l+n}
            h = (windows * self.shift_b.to(dtype)[:, None, :]).sum(-1)  # [d, k] by lag
        return h.flip(1).to(self.shift_weight.dtype)

    def _qkv(
        self, x: torch.Tensor, history: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x: [B, T, d], history: [B, k-1, d] past k or None (zeros, and no new history wanted) -> q, shift(k), v
        [B, T, d] each and the new shift history [B, k-1, d] (None without one)."""
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # [B, T, d] each
        k_shift = explicit_causal_conv(k, self._shift_filter(), history)  # [B, T, d]
        if self.shift_skip is not None:
            k_shift = k_shift + self.shift_skip.to(k.dtype) * k
        new_history = None if history is None else torch.cat([history.to(k.dtype), k], dim=1)[:, k.shape[1] :]
        return q, k_shift, v, new_history

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [B, T, d_model] -> [B, T, d_model]. With a state: continues the shift and the SSM from it.

        causal_conv sees the SSM inputs [p(i), p(j), B, T, H] as p·p·B sequences of H channels."""
        check_input(x, self.d_model, self.name)
        B, T, _ = x.shape
        p, H = self.p, self.d_model // self.p
        q, k_shift, v, new_history = self._qkv(x, None if state is None else state["shift"])
        dtype = compute_dtype(x.dtype) if state is None else torch.promote_types(x.dtype, state["ssm"].dtype)
        device = x.device.type
        with torch.autocast(device_type=device, enabled=False):
            lags = torch.arange(T, device=x.device, dtype=dtype)  # [T]
            if self.complex:
                kernel = self._zoology_kernel(lags, dtype)  # [T, H]
            else:
                log_a = self._log_a(dtype)  # [H, N]
                powers = torch.exp(lags[:, None, None] * log_a[None])  # [T, H, N]: a^l
                C, Bm = self.C.to(dtype), self.B.to(dtype)  # [H, N]
                kernel = torch.einsum("lhn,hn->lh", powers, C * Bm)  # [T, H]
            # D·u_t is the kernel's lag 0: out_t = Σ_{s≤t} K[t-s] u_s + D u_t.
            kernel = torch.cat([kernel[:1] + self.D.to(dtype), kernel[1:]])  # [T, H]
            # u[i, j, b, t, h] = k'[b, t, h, i] · v[b, t, h, j], in the factors' dtype: bf16 under autocast, the
            # dtype the convolution takes there (the product rounded once, as the convolution would round it).
            k_i = rearrange(k_shift, "b t (h i) -> i 1 b t h", i=p).contiguous()  # [p, 1, B, T, H]
            v_j = rearrange(v.to(k_shift.dtype), "b t (h j) -> 1 j b t h", j=p).contiguous()  # [1, p, B, T, H]
            u = k_i * v_j  # [p, p, B, T, H]
        # Outside the fp32 block: under autocast the direct convolution runs in the autocast dtype.
        y = causal_conv(u.reshape(p * p * B, T, H), kernel).reshape(p, p, B, T, H)  # [p, p, B, T, H]
        with torch.autocast(device_type=device, enabled=False):
            if state is not None:
                u_q = u.reshape(p * p, B, T, H).to(dtype)  # [p·p, B, T, H]
                s0 = rearrange(self._ssm_state(state["ssm"], dtype), "b (h q) n -> b h q n", q=p * p)  # [B, H, pp, N]
                if self.complex:  # the modes as complex numbers: the state is complex
                    dA, Bm, C = self._complex_terms(dtype)  # [H, M] complex
                    powers = torch.exp(lags[:, None, None] * torch.log(dA)[None])  # [T, H, M]: dA^l
                a = dA if self.complex else torch.exp(log_a)  # [H, N] (complex [H, M])
                carried = powers * a[None]  # [T, H, N]: a^{t+1}
                carried_out = torch.einsum("thn,bhqn,hn->qbth", carried, s0.to(carried.dtype), C)
                y = y + (2 * carried_out.real if self.complex else carried_out).reshape(p, p, B, T, H)
                # s_T = a^T s_0 + Σ_s a^{T-1-s} b u_s; powers.flip(0)[s] = a^{T-1-s}.
                s_T = carried[-1][None, :, None] * s0 + torch.einsum(
                    "thn,qbth,hn->bhqn", powers.flip(0), u_q.to(powers.dtype), Bm)
                self._store_ssm(state["ssm"], rearrange(s_T, "b h q n -> b (h q) n"))
                state["shift"].copy_(new_history)
            q_i = rearrange(q.to(dtype), "b t (h i) -> i 1 b t h", i=p)  # [p, 1, B, T, H]
            out = (q_i * y).sum(0)  # [p(j), B, T, H]: Σ_i q_i Y_ij, in fp32 (q_i is)
        return self.out(rearrange(out, "j b t h -> b t (h j)").to(q.dtype))  # [B, T, d_model]

    def step(self, x_t: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """x_t: [B, d_model] -> [B, d_model]: s = a ⊙ s + b·u, out = c·s + D·u, in place."""
        check_step_input(x_t, self.d_model, self.name)
        p = self.p
        q, k_shift, v, new_history = self._qkv(x_t[:, None], state["shift"])
        state["shift"].copy_(new_history)
        s = state["ssm"]
        dtype = torch.promote_types(x_t.dtype, s.dtype)
        with torch.autocast(device_type=x_t.device.type, enabled=False):
            k_i = rearrange(k_shift[:, 0].to(dtype), "b (h i) -> b h i 1", i=p)
            v_j = rearrange(v[:, 0].to(dtype), "b (h j) -> b h 1 j", j=p)
            u = rearrange(k_i * v_j, "b h i j -> b (h i j)")  # [B, H·p·p]
            if self.complex:
                dA, Bm, C = (t.repeat_interleave(p * p, dim=0) for t in self._complex_terms(dtype))  # [H·p·p, M]
                s_new = dA[None] * self._ssm_state(s, dtype) + Bm * u[..., None].to(Bm.dtype)
                y_ssm = 2 * torch.einsum("bdn,dn->bd", s_new, C).real
            else:
                Bm = self._per_channel(self.B, dtype)
                a = torch.exp(self._per_channel(self._log_a(dtype), dtype))  # [H·p·p, N]
                s_new = a[None] * s.to(dtype) + Bm * u[..., None]
                y_ssm = torch.einsum("bdn,dn->bd", s_new, self._per_channel(self.C, dtype))
            self._store_ssm(s, s_new)
            y = y_ssm + self._per_channel(self.D, dtype) * u  # [B, H·p·p]
            q_i = rearrange(q[:, 0].to(dtype), "b (h i) -> b h i 1", i=p)
            out = (q_i * rearrange(y, "b (h i j) -> b h i j", i=p, j=p)).sum(2)  # [B, H, p(j)]
        return self.out(rearrange(out, "b h j -> b (h j)").to(q.dtype))  # [B, d_model]

    def _ssm_state(self, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The stored SSM state [B, C, N] (real) as the recurrence reads it: [B, C, N] in `dtype`, or with
        ssm=zoology [B, C, N/2] complex (each mode's real and imaginary parts side by side)."""
        if not self.complex:
            return s.to(dtype)
        pairs = s.to(dtype).unflatten(-1, (-1, 2))  # [B, C, N/2, 2]
        return torch.complex(pairs[..., 0], pairs[..., 1])

    def _store_ssm(self, s: torch.Tensor, value: torch.Tensor) -> None:
        """Write a state of `_ssm_state`'s form back into the stored real tensor, in place."""
        s.copy_(torch.view_as_real(value).flatten(-2) if self.complex else value)

    def init_state(
        self, batch_size: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """Zeroed shift history [B, shift_size-1, d] (module dtype) and SSM state [B, d·head_dim, d_state] (fp32+)."""
        device, dtype = module_device_dtype(self, device, dtype)
        d = self.d_model
        return {
            "shift": torch.zeros(batch_size, self.config.shift_size - 1, d, device=device, dtype=dtype),
            "ssm": torch.zeros(
                batch_size, self.channels, self.config.d_state, device=device, dtype=compute_dtype(dtype)
            ),
        }

    def state_size(self, seq_len: int) -> int:
        """head_dim·d·d_state + d·(shift_size-1), constant in seq_len."""
        return self.channels * self.config.d_state + self.d_model * (self.config.shift_size - 1)
