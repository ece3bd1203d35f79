"""Shared helpers of the Based kernel tests: random problems, NaN-poisoned outputs, and the comparison of a
kernel run against the float64 reference and the in-dtype naive baseline (kernels/testing.py's rule)."""

import contextlib
from dataclasses import dataclass

import torch

from kernels.based import naive_chunk_based, naive_parallel_based
from kernels.testing import assert_close


@dataclass(frozen=True)
class Case:
    B: int
    T: int
    H: int
    K: int
    V: int
    scale: float | None = None
    initial_state: bool = True
    final_state: bool = True
    normalize: bool = True

    @property
    def id(self) -> str:
        s = f"B{self.B}-T{self.T}-H{self.H}-K{self.K}-V{self.V}"
        s += "" if self.scale is None else f"-scale{self.scale:g}"
        s += "-h0" if self.initial_state else ""
        s += "-hT" if self.final_state else ""
        return s + ("" if self.normalize else "-unnormalized")


def make_inputs(case: Case, device, seed: int = 0):
    """fp64 leaf tensors q, k, v, kv0, k_sum0 (the last two None without an initial state).

    k_sum0 is a plausible denominator state (φ(k) summed over earlier tokens), so the denominator stays positive."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, T, H, K, V = case.B, case.T, case.H, case.K, case.V
    q, k, v = (torch.randn(B, T, H, d, generator=g, dtype=torch.float64) for d in (K, K, V))
    kv0 = ks0 = None
    if case.initial_state:
        prev = torch.randn(B, 8, H, K, generator=g, dtype=torch.float64)
        pv = torch.randn(B, 8, H, V, generator=g, dtype=torch.float64)
        _, (kv0, ks0) = naive_parallel_based(prev, prev, pv, output_final_state=True)
    out = [x.to(device) if x is not None else None for x in (q, k, v, kv0, ks0)]
    return [x.requires_grad_() if x is not None else None for x in out]


def run(fn, inputs, case: Case, dtype: torch.dtype, cotangents=None):
    """Run fn (chunk_based or a naive form) on inputs cast to dtype (state kept fp32, or fp64 for the
    reference); return outputs and gradients of Σ o·go + Σ kvT·gkv + Σ k_sumT·gks w.r.t. every input."""
    q, k, v, kv0, ks0 = inputs
    sd = torch.float64 if dtype == torch.float64 else torch.float32
    state = (kv0.to(sd), ks0.to(sd)) if case.initial_state else None
    o, final = fn(q.to(dtype), k.to(dtype), v.to(dtype), scale=case.scale, initial_state=state,
                  output_final_state=case.final_state, normalize=case.normalize)
    outs = [o] + (list(final) if case.final_state else [])
    if cotangents is None:
        g = torch.Generator(device="cpu").manual_seed(1)
        cotangents = [torch.randn(x.shape, generator=g, dtype=torch.float64).to(x.device) for x in outs]
    loss = sum((x.double() * c).sum() for x, c in zip(outs, cotangents))
    leaves = [x for x in inputs if x is not None]
    grads = torch.autograd.grad(loss, leaves)
    return outs, grads, cotangents


OUT_NAMES = ("o", "kv_final", "k_sum_final")
GRAD_NAMES = ("dq", "dk", "dv", "dkv0", "dk_sum0")


def check_against_naive(kernel, case: Case, dtype: torch.dtype, device, reference=naive_parallel_based):
    """Assert the kernel's outputs and gradients pass the tolerance rule; reference is the fp64 naive form."""
    inputs = make_inputs(case, device)
    ref_out, ref_grad, cot = run(reference, inputs, case, torch.float64)
    base_out, base_grad, _ = run(naive_parallel_based, inputs, case, dtype, cot)
    out, grad, _ = run(kernel, inputs, case, dtype, cot)
    for name, a, r, b in zip(OUT_NAMES, out, ref_out, base_out):
        assert a.dtype == (dtype if name == "o" else torch.float32), f"{name}: dtype {a.dtype}"
        assert_close(f"{case.id} {dtype} {name}", a, r, b, dtype)
    for name, a, r, b in zip(GRAD_NAMES, grad, ref_grad, base_grad):
        assert_close(f"{case.id} {dtype} {name}", a, r, b, dtype)


def chunked_reference(chunk_size: int):
    """naive_chunk_based with a long chunk: the fp64 reference at lengths where T×T does not fit."""
    def fn(*args, **kwargs):
        return naive_chunk_based(*args, chunk_size=chunk_size, **kwargs)
    return fn


@contextlib.contextmanager
def nan_empty():
    """Make torch.empty / torch.empty_like return NaN-filled floating tensors, so unwritten outputs show."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(x):
        return x.fill_(float("nan")) if x.is_floating_point() else x

    torch.empty = lambda *a, **kw: poison(empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: poison(empty_like(*a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def check_mixer_triton_vs_naive(device, dtype=torch.float32, d_model=64, num_heads=2, T=37, atol=2e-5, rtol=2e-5):
    """Based(impl="triton") equals Based(impl="naive") with the same weights: a forward, a forward in two pieces
    with a state (prefill), then decode steps; outputs and states."""
    from zoo.models.mixers import Based

    torch.manual_seed(0)
    naive = Based(d_model, num_heads=num_heads, feature_dim=16, impl="naive").to(device, dtype)
    fast = Based(d_model, num_heads=num_heads, feature_dim=16, impl="triton").to(device, dtype)
    fast.load_state_dict(naive.state_dict())
    x = torch.randn(2, T, d_model, device=device, dtype=dtype)
    torch.testing.assert_close(fast(x), naive(x), atol=atol, rtol=rtol)
    s_naive, s_fast = naive.init_state(2, device, dtype), fast.init_state(2, device, dtype)
    split = T // 3
    for lo, hi in ((0, split), (split, T)):
        torch.testing.assert_close(fast(x[:, lo:hi], s_fast), naive(x[:, lo:hi], s_naive), atol=atol, rtol=rtol)
    for name in ("kv", "k_sum"):
        torch.testing.assert_close(s_fast[name], s_naive[name], atol=atol * 10, rtol=rtol)
    for _ in range(3):
        x_t = torch.randn(2, d_model, device=device, dtype=dtype)
        torch.testing.assert_close(fast.step(x_t, s_fast), naive.step(x_t, s_naive), atol=atol, rtol=rtol)
    for name in ("kv", "k_sum"):
        torch.testing.assert_close(s_fast[name], s_naive[name], atol=atol * 10, rtol=rtol)
