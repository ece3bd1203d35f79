"""The reference for the Based decode step with kv stored in bf16 (`fused_recurrent_based`), shared by the
interpreted and GPU tests: the recurrent form, each update computed in fp32 and kv rounded to bf16 after it, the
output read from the rounded kv in float64.

How the kernel's fp32 → bf16 conversion rounds depends on where it runs: to nearest even on a GPU (PTX
`cvt.rn.bf16.f32`), toward zero under Triton's interpreter (which keeps the top 16 bits of the fp32 word), so the
reference takes the rounding as an argument.
"""

import math
from dataclasses import dataclass

import torch

from kernels.based import fused_recurrent_based, taylor_feature_map
from kernels.testing import rel_error

ROUNDINGS = ("nearest", "toward_zero")


@dataclass(frozen=True)
class DecodeCase:
    B: int
    H: int
    K: int
    V: int
    T: int = 4  # decode steps
    scale: float | None = None
    normalize: bool = True

    @property
    def id(self) -> str:
        s = f"B{self.B}-H{self.H}-K{self.K}-V{self.V}-T{self.T}"
        s += "" if self.scale is None else f"-scale{self.scale:g}"
        return s + ("" if self.normalize else "-unnormalized")


CASES = [
    DecodeCase(B=2, H=2, K=16, V=64),
    DecodeCase(B=1, H=2, K=16, V=112, scale=0.3),  # based-1b's head, a non-default scale
    DecodeCase(B=1, H=1, K=8, V=40, normalize=False),  # V not a power of two, the numerator only
    DecodeCase(B=1, H=1, K=32, V=128),  # the largest head: four V blocks
]


def to_bf16(x: torch.Tensor, rounding: str) -> torch.Tensor:
    """fp32 x rounded to bf16: "nearest" (even), as torch and the GPU do, or "toward_zero" (the low 16 bits
    dropped)."""
    if rounding == "nearest":
        return x.float().to(torch.bfloat16)
    if rounding == "toward_zero":
        return (x.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}")


def inputs(case: DecodeCase, device, seed: int = 0):
    """q, k [B, T, H, K], v [B, T, H, V] in fp32, and a state (kv, k_sum) in float64 that eight earlier tokens left,
    so each step's update is small next to kv (where bf16 storage loses bits)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, T, H, K, V = case.B, case.T, case.H, case.K, case.V
    q, k, v = (torch.randn(B, T, H, d, generator=g) for d in (K, K, V))
    prev_k = torch.randn(B, 8, H, K, generator=g, dtype=torch.float64)
    prev_v = torch.randn(B, 8, H, V, generator=g, dtype=torch.float64)
    phi = taylor_feature_map(prev_k)  # [B, 8, H, E]
    kv0, ks0 = torch.einsum("bthe,bthv->bhev", phi, prev_v), phi.sum(1)
    return [x.to(device) for x in (q, k, v, kv0, ks0)]


def rounded_recurrent(q, k, v, kv0, ks0, scale, normalize, kv_dtype: torch.dtype, rounding: str):
    """T decode steps of the recurrent form with kv stored in kv_dtype: kv ← round(kv + φ(k_t) v_tᵀ) (the update in
    fp32), k_sum += φ(k_t) in float64, o_t = φ(q'_t)·kv / φ(q'_t)·k_sum in float64. Returns o [B, T, H, V] float64,
    kv (kv_dtype), k_sum (float64)."""
    T, K = q.shape[1], q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    kv = kv0.to(kv_dtype) if kv_dtype != torch.bfloat16 else to_bf16(kv0, rounding)
    ks = ks0.double()
    outs = []
    for t in range(T):
        phi_q = taylor_feature_map(q[:, t].double() * (scale * math.sqrt(K)))  # [B, H, E]
        phi_k = taylor_feature_map(k[:, t].float())  # [B, H, E]
        new = kv.float() + phi_k[..., None] * v[:, t, :, None].float()  # [B, H, E, V]
        kv = to_bf16(new, rounding) if kv_dtype == torch.bfloat16 else new.to(kv_dtype)
        ks = ks + phi_k.double()
        num = torch.einsum("bhe,bhev->bhv", phi_q, kv.double())
        outs.append(num / torch.einsum("bhe,bhe->bh", phi_q, ks)[..., None] if normalize else num)
    return torch.stack(outs, 1), kv, ks


def within_one_bf16_step(a: torch.Tensor, b: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    """Where bf16 results a and b of one update differ by at most one bf16 step of the larger (2⁻⁷ of it, an upper
    bound on bf16's spacing there) plus 2⁻²⁰ of `terms`, the magnitude of what the update summed (|kv| + |φ(k) vᵀ|):
    two fp32 sums of those terms that differ in their last bits round to bf16 values one step apart, except where
    the terms cancel, and there the fp32 difference itself is all that separates them."""
    a, b = a.double(), b.double()
    return (a - b).abs() <= 2**-7 * torch.maximum(a.abs(), b.abs()) + 2**-20 * terms.double()


def check_decode(case: DecodeCase, device, kv_dtype: torch.dtype, rounding: str) -> None:
    """T steps of `fused_recurrent_based` from a state with kv in kv_dtype, each against one step of
    `rounded_recurrent` from the state the kernel itself holds before it.

    Each step is checked from the kernel's own state, so a rounding that went the other way at one step is not
    carried into the next steps' references, where it would grow by cancellation into any relative error.
    bf16 kv: after each step, at least 99% of kv's elements equal the reference's bit for bit and the rest differ by
    at most one bf16 step (the kernel's φ differs from the reference's in the last fp32 bits, which moves a rounding
    now and then; see within_one_bf16_step); o within 1e-5 relative. fp32 kv: kv and o within 1e-5 relative. k_sum
    within 1e-6 either way. A step that skipped the rounding, read o before it or rounded the other way would miss
    by ~1e-3 or more."""
    q, k, v, kv0, ks0 = inputs(case, device)
    kv = to_bf16(kv0, rounding) if kv_dtype == torch.bfloat16 else kv0.to(kv_dtype)
    state = (kv.contiguous(), ks0.float().contiguous())
    for t in range(case.T):
        step = slice(t, t + 1)
        ref_o, ref_kv, ref_ks = rounded_recurrent(
            q[:, step], k[:, step], v[:, step], state[0].double(), state[1].double(), case.scale, case.normalize,
            kv_dtype, rounding,
        )
        state_before = state[0].double()
        out = torch.full((case.B, case.H, case.V), float("nan"), device=device)
        fused_recurrent_based(q[:, t], k[:, t], v[:, t], state, scale=case.scale, normalize=case.normalize, out=out)
        where = f"step {t}"
        assert state[0].dtype == kv_dtype and state[1].dtype == torch.float32
        assert rel_error(out, ref_o[:, 0]) <= 1e-5, f"{where}: o relative error {rel_error(out, ref_o[:, 0]):.3g}"
        assert rel_error(state[1], ref_ks) <= 1e-6, f"{where}: k_sum relative error {rel_error(state[1], ref_ks):.3g}"
        if kv_dtype == torch.bfloat16:
            same = (state[0] == ref_kv).double().mean().item()
            assert same >= 0.99, f"{where}: {same:.2%} of kv's elements equal the reference's"
            terms = state_before.abs() + (taylor_feature_map(k[:, t].float())[..., None] * v[:, t, :, None]).abs()
            off = f"{where}: a kv element more than one bf16 step off"
            assert within_one_bf16_step(state[0], ref_kv, terms).all(), off
        else:
            assert rel_error(state[0], ref_kv) <= 1e-5, f"{where}: kv relative error {rel_error(state[0], ref_kv):.3g}"
