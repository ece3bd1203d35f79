"""RWKV-4 time mixing (Peng et al., 2023, "RWKV: Reinventing RNNs for the Transformer Era"), the "rwkv" model
of Zoology Fig. 2 (its `RWKVTimeMixer`). The `rwkv` mixer is RWKV-6 (data-dependent decay, matrix state): a
different model.

    x'_t = μ ⊙ x_t + (1 − μ) ⊙ x_{t−1}               token shift, one μ each for k, v, r
    k, v, r = W_k x'_k, W_v x'_v, W_r x'_r
    wkv_t = (Σ_{i<t} e^{(t−1−i)w + k_i} v_i + e^{u + k_t} v_t) / (Σ_{i<t} e^{(t−1−i)w + k_i} + e^{u + k_t})
    y_t = W_o (σ(r_t) ⊙ wkv_t)

per channel, with decay w = −exp(time_decay) < 0 and bonus u = time_first for the current token.

What is unusual here:
- Every exponential is taken after subtracting a running maximum, so nothing overflows whatever k grows to. The
  recurrent form (`step`, through `kernels.rwkv4.naive.wkv4_step`) keeps RWKV-4's state (a, b, p): the
  numerator and denominator sums scaled by e^{−p}, and p, the largest exponent seen. State: {"a", "b", "p",
  "shift": [B, d]}, a, b, p in at least fp32; state_size = 4·d (three WKV vectors and the previous input).
- The parallel form (`impl="naive"`, the default) is chunked: inside a chunk of `chunk_size` tokens the decayed
  weights form a [chunk, chunk] matrix per channel, normalised by each row's maximum; across chunks a scan over
  chunks (one small step per chunk, never per token) carries (a, b, p). Memory is B·T·chunk_size·d per layer.
- `impl="triton"` runs the WKV as one Triton kernel per direction (kernels/rwkv4: one program per sequence and
  block of channels walks the tokens with (a, b, p) in fp32 registers; the forward keeps the state before every
  token for the backward). It serves training and a forward from a state alike (prefill; gradients reach that
  state too); `step` stays the PyTorch recurrence. CUDA tensors, or CPU under TRITON_INTERPRET=1; fp32 inside
  from fp32/fp16/bf16 k, v (float64 modules raise: use impl="naive"). Its custom op has a vmap rule (the
  members side by side as channels), so such runs pack (zoo/steps.py).
- Initialisation follows Zoology's configs, which leave RWKV-4's layer count at its default of 12: the
  per-channel decay speeds −5 + 8·(c/(d−1))^0.7, the bonus log 0.3 with a ±0.5 zigzag, and μ_k = μ_v = c/d,
  μ_r = (c/d)^0.5, the values RWKV-4 gives layer 0. A mixer does not know its layer, so every layer starts
  there; with `model.init=zoology` the LanguageModel calls `zoology_init(i)`, which gives layer i Zoology's
  values (its layer 1 starts from slightly different decays and mixes).
- Under `model.init=zoology` the four projections (key, value, receptance, output) keep PyTorch's default
  Linear init, U(±1/√d), not the LanguageModel's N(0, 0.02): Zoology's RWKVTimeMixer is a torch.jit.ScriptModule,
  so its Linear children are scripted modules that its `_init_weights` (an `isinstance(m, nn.Linear)` test) and
  its `out_proj` rescaling both pass over, and RWKV-4's own `init_rwkv` is never called.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.rwkv4.naive import NO_TOKEN, wkv4_step
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
)


@dataclass
class RWKV4Config:
    """Options of `rwkv4` (d_model comes from the model)."""

    # tokens per chunk of the parallel form: the [chunk, chunk] weights cost B·T·chunk·d, the scan over chunks
    # T/chunk small steps
    chunk_size: int = 8
    impl: str = "naive"  # naive (PyTorch: the chunked form) | triton (kernels/rwkv4: the recurrence, one launch)
    # the layer count RWKV-4's per-layer init schedule assumes (`zoology_init`): Zoology's configs leave RWKV-4's
    # default of 12; the launch behind Zoology's published Fig. 2 passed the model's 2
    init_layers: int = 12

    def validate(self, d_model: int) -> None:
        check_int("rwkv4: chunk_size", self.chunk_size, minimum=1)
        check_int("rwkv4: init_layers", self.init_layers, minimum=2)
        check_choice("rwkv4: impl", self.impl, ("naive", "triton"))


class RWKV4(nn.Module):
    """RWKV-4 time mixing: [B, T, d_model] -> [B, T, d_model].

    State: {"a", "b": [B, d] scaled WKV sums, "p": [B, d] their log scale, "shift": [B, d] the last input}.
    """

    Config = RWKV4Config
    name = "rwkv4"
    vmap_impls = ("naive", "triton")  # zoo/steps.py packs these

    def __init__(self, d_model: int, **options) -> None:
        super().__init__()
        self.config = make_config(self.name, self.Config, d_model, options)
        self.d_model = d_model
        d = d_model
        c = torch.arange(d, dtype=torch.float32)
        zigzag = 0.5 * (((c + 1) % 3) - 1)
        self.time_first = nn.Parameter(torch.full((d,), math.log(0.3)) + zigzag)
        self.time_decay = nn.Parameter(torch.empty(d))
        self.time_mix_k = nn.Parameter(torch.empty(d))
        self.time_mix_v = nn.Parameter(torch.empty(d))
        self.time_mix_r = nn.Parameter(torch.empty(d))
        self._time_init(0)
        self.key = nn.Linear(d, d, bias=False)
        self.value = nn.Linear(d, d, bias=False)
        self.receptance = nn.Linear(d, d, bias=False)
        self.output = nn.Linear(d, d, bias=False)
        log_impl(self.name, self.config.impl)

    @torch.no_grad()
    def zoology_init(self, layer_idx: int) -> None:
        """Zoology's init of layer `layer_idx`: its decays and mixes (`_time_init` at `init_layers`), and PyTorch's
        default init for the four projections, which Zoology's weight init does not reach (module docstring)."""
        self._time_init(layer_idx, self.config.init_layers)
        for linear in (self.key, self.value, self.receptance, self.output):
            linear.reset_parameters()

    @torch.no_grad()
    def _time_init(self, layer_idx: int, n_layer: int = 12) -> None:
        """RWKV-4's per-layer init of the decays and mixes, as Zoology's RWKVTimeMixer draws it for layer
        `layer_idx` of `n_layer` (Zoology leaves RWKV-4's default of 12): with a = layer_idx / (n_layer - 1) and
        b = 1 - layer_idx / n_layer, decay speed -5 + 8·(c/(d-1))^(0.7 + 1.3a), μ_k = (c/d)^b,
        μ_v = (c/d)^b + 0.3a, μ_r = (c/d)^(b/2). The constructor sets layer 0's (a = 0, b = 1)."""
        d = self.d_model
        c = torch.arange(d, dtype=torch.float32, device=self.time_decay.device)
        a, b = layer_idx / (n_layer - 1), 1.0 - layer_idx / n_layer
        x = c / d
        self.time_decay.copy_(-5 + 8 * (c / max(d - 1, 1)) ** (0.7 + 1.3 * a))
        self.time_mix_k.copy_(x**b)
        self.time_mix_v.copy_(x**b + 0.3 * a)
        self.time_mix_r.copy_(x ** (0.5 * b))

    def _inputs(self, x: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, d], prev: [B, d] the input before x -> σ(r), k, v: [B, T, d]."""
        shifted = torch.cat([prev[:, None].to(x.dtype), x[:, :-1]], dim=1)  # [B, T, d]: x_{t-1}

        def mix(mu: torch.Tensor) -> torch.Tensor:
            return x * mu + shifted * (1 - mu)

        k = self.key(mix(self.time_mix_k))
        v = self.value(mix(self.time_mix_v))
        r = self.receptance(mix(self.time_mix_r))
        return torch.sigmoid(r), k, v

    def _wkv(self, k: torch.Tensor, v: torch.Tensor, state: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """The parallel WKV. k, v: [B, T, d] -> wkv [B, T, d] in at least fp32; updates a state in place."""
        if self.config.impl == "triton":
            return self._wkv_triton(k, v, state)
        B, T, d = k.shape
        dtype = compute_dtype(k.dtype)
        c = min(self.config.chunk_size, T)
        n = -(-T // c)
        pad = n * c - T
        k, v = k.to(dtype), v.to(dtype)
        w = -torch.exp(self.time_decay.to(dtype))  # [d], < 0
        u = self.time_first.to(dtype)  # [d]
        if pad:
            k, v = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
        k = k.view(B, n, c, d)
        v = v.view(B, n, c, d)
        t = torch.arange(c, device=k.device)
        lengths = (T - c * torch.arange(n, device=k.device)).clamp(max=c)  # [n]: real tokens per chunk
        real = t[None, :] < lengths[:, None]  # [n, c]: not padding

        # Each chunk alone, summarised at its end: exponents (len - 1 - i)·w + k_i over its real tokens.
        end_exp = ((lengths[:, None] - 1 - t[None, :]).to(dtype)[..., None] * w + k).masked_fill(
            ~real[None, :, :, None], float("-inf")
        )  # [B, n, c, d]
        p_loc = end_exp.amax(dim=2).detach()  # [B, n, d]
        e_loc = torch.exp(end_exp - p_loc[:, :, None])  # [B, n, c, d]
        a_loc, b_loc = (e_loc * v).sum(dim=2), e_loc.sum(dim=2)  # [B, n, d]

        # The state entering every chunk: a scan over chunks, each decaying the carried sums by len·w.
        if state is None:
            a = k.new_zeros(B, d)
            b = k.new_zeros(B, d)
            p = k.new_full((B, d), NO_TOKEN)
        else:
            # copies: the state is overwritten below, and autograd may still need the values entering the chunks
            a, b, p = (state[key].to(dtype, copy=True) for key in "abp")
        entering = []
        for j in range(n):
            entering.append((a, b, p))
            if j == n - 1 and state is None:
                break
            decayed = p + lengths[j].to(dtype) * w  # [B, d]
            p_new = torch.maximum(decayed, p_loc[:, j])
            s_old, s_loc = torch.exp(decayed - p_new), torch.exp(p_loc[:, j] - p_new)
            a, b, p = s_old * a + s_loc * a_loc[:, j], s_old * b + s_loc * b_loc[:, j], p_new
        a_in, b_in, p_in = (torch.stack(parts, dim=1) for parts in zip(*entering))  # [B, n, d] each

        # Outputs: the carried sums decayed by t·w, then the chunk's own tokens, all over one row maximum.
        before, now = t[None, :] < t[:, None], t[None, :] == t[:, None]  # [c(t), c(i)]
        lag = (t[:, None] - 1 - t[None, :]).to(dtype)[..., None] * w  # [c, c, d]: (t-1-i)·w
        bias = torch.where(before[..., None], lag, torch.where(now[..., None], u, float("-inf")))  # [c, c, d]
        intra = bias + k[:, :, None]  # [B, n, c, c, d]: + k_i (u + k_t on the diagonal)
        carried = p_in[:, :, None] + t.to(dtype)[:, None] * w  # [B, n, c, d]
        m = torch.maximum(carried, intra.amax(dim=3)).detach()  # [B, n, c, d]
        e_intra = torch.exp(intra - m[:, :, :, None])  # [B, n, c, c, d]
        e_carried = torch.exp(carried - m)  # [B, n, c, d]
        num = e_carried * a_in[:, :, None] + torch.einsum("bntid,bnid->bntd", e_intra, v)
        den = e_carried * b_in[:, :, None] + e_intra.sum(dim=3)
        wkv = (num / den).reshape(B, n * c, d)[:, :T]  # [B, T, d]
        if state is not None:
            state["a"].copy_(a)
            state["b"].copy_(b)
            state["p"].copy_(p)
        return wkv

    def _wkv_triton(self, k: torch.Tensor, v: torch.Tensor, state: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """`_wkv` through the Triton kernel (fp32 inside, wkv in fp32)."""
        from kernels.rwkv4.wkv import wkv4

        require_triton_device(k, self.name, "triton")
        w, u = -torch.exp(self.time_decay.float()), self.time_first.float()
        initial = None if state is None else (state["a"], state["b"], state["p"])
        wkv, final = wkv4(k, v, w, u, initial)
        if state is not None:
            for key, value in zip("abp", final):
                state[key].copy_(value)
        return wkv

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [B, T, d_model] -> [B, T, d_model]. With a state: continues from it and leaves it updated."""
        check_input(x, self.d_model, self.name)
        prev = x.new_zeros(x.shape[0], self.d_model) if state is None else state["shift"]
        sr, k, v = self._inputs(x, prev)
        wkv = self._wkv(k, v, state)
        if state is not None:
            state["shift"].copy_(x[:, -1])
        return self.output(sr * wkv.to(sr.dtype))  # [B, T, d_model]

    def step(self, x_t: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """x_t: [B, d_model] -> [B, d_model]: RWKV-4's recurrence, one token, the state updated in place."""
        check_step_input(x_t, self.d_model, self.name)
        sr, k, v = (t[:, 0] for t in self._inputs(x_t[:, None], state["shift"]))
        dtype = state["a"].dtype
        w, u = -torch.exp(self.time_decay.to(dtype)), self.time_first.to(dtype)
        wkv, new = wkv4_step(k.to(dtype), v.to(dtype), w, u, (state["a"], state["b"], state["p"]))  # [B, d]
        for key, value in zip("abp", new):
            state[key].copy_(value)
        state["shift"].copy_(x_t)
        return self.output(sr * wkv.to(sr.dtype))  # [B, d_model]

    def init_state(
        self, batch_size: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """a = b = 0 and p = NO_TOKEN in at least fp32, shift = 0 (module's device and dtype by default)."""
        device, dtype = module_device_dtype(self, device, dtype)
        wkv_dtype = compute_dtype(dtype)
        shape = (batch_size, self.d_model)
        return {
            "a": torch.zeros(shape, device=device, dtype=wkv_dtype),
            "b": torch.zeros(shape, device=device, dtype=wkv_dtype),
            "p": torch.full(shape, NO_TOKEN, device=device, dtype=wkv_dtype),
            "shift": torch.zeros(shape, device=device, dtype=dtype),
        }

    def state_size(self, seq_len: int) -> int:
        """4·d per sequence, constant in seq_len: a, b, p and the previous input."""
        return 4 * self.d_model
