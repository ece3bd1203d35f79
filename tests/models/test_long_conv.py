"""causal_conv and its two paths (zoo/models/mixers/_long_conv.py): the direct Toeplitz matmul and the FFT each
equal a double loop over (t, s) on outputs and on the gradients of u and h; both stay fp32-accurate with lowered
matmul precision requested; the dispatch rule picks each path on its side of DIRECT_MAX_T; the direct op keeps
IEEE fp32 under autocast and vmap and passes torch.library's checks; explicit_causal_conv equals its shifted
sum with and without a history; the shifted sum equals the double loop and keeps its input's dtype."""

import pytest
import torch

from zoo.models.mixers import _long_conv
from zoo.models.mixers._long_conv import (
    DIRECT_MAX_T,
    SHIFTED_SUM_MAX_TAPS,
    TOEPLITZ_BLOCK_ELEMENTS,
    causal_conv,
    depthwise_causal_conv,
    direct_causal_conv,
    explicit_causal_conv,
    fft_causal_conv,
)

PATHS = {"direct": direct_causal_conv, "fft": fft_causal_conv, "dispatch": causal_conv}

# (B, T, C, T'): one position; odd T; a filter longer than the sequence; a filter shorter than it (the long
# branch of explicit_causal_conv passes k taps for T + k - 1 positions); several channels and batches.
SHAPES = [(2, 1, 3, 1), (2, 1, 3, 5), (1, 7, 2, 7), (3, 9, 4, 13), (2, 9, 3, 4), (2, 33, 5, 33)]


def naive_conv(u: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """y[:, t, c] = Σ_{s≤t, t-s<T'} h[t-s, c] · u[:, s, c], summed term by term."""
    B, T, C = u.shape
    rows = []
    for t in range(T):
        acc = torch.zeros(B, C, dtype=u.dtype)
        for s in range(t + 1):
            if t - s < h.shape[0]:
                acc = acc + h[t - s] * u[:, s]
        rows.append(acc)
    return torch.stack(rows, dim=1)  # [B, T, C]


def random(*shape, seed: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def outputs_and_grads(conv, u, h, grad_y):
    u, h = u.clone().requires_grad_(), h.clone().requires_grad_()
    y = conv(u, h)
    return (y, *torch.autograd.grad(y, (u, h), grad_y))


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-T{}-C{}-Tf{}".format(*s))
def test_conv_equals_the_double_loop(shape, path):
    """fp64: output, grad u and grad h of each path against the loop's (autograd through the loop)."""
    B, T, C, Tf = shape
    u, h, grad_y = random(B, T, C, seed=1), random(Tf, C, seed=2), random(B, T, C, seed=3)
    got = outputs_and_grads(PATHS[path], u, h, grad_y)
    want = outputs_and_grads(naive_conv, u, h, grad_y)
    for name, g, w in zip(("y", "grad_u", "grad_h"), got, want):
        assert g.shape == w.shape and g.dtype == torch.float64, name
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_fp32_paths_stay_fp32_accurate_over_several_channel_blocks(device):
    """fp32 at T = DIRECT_MAX_T with the channels in three Toeplitz blocks (the last one short), with the process's
    fp32 matmuls lowered (TF32 on CUDA, bf16 on CPU): outputs and gradients of both paths within 4e-6 of fp64
    relative to the largest value (≈ 64 fp32 ulps; the direct sums run over up to T terms, so its error grows like
    √T where the FFT's grows like log T; TF32 operands give ≈ 1e-3)."""
    T = DIRECT_MAX_T
    block = TOEPLITZ_BLOCK_ELEMENTS // (T * T)
    C = 2 * block + 3
    u, h, grad_y = random(1, T, C, seed=4), random(T, C, seed=5) / T**0.5, random(1, T, C, seed=6)
    exact = [t.to(device) for t in outputs_and_grads(fft_causal_conv, u, h, grad_y)]
    backend = torch.backends.cuda.matmul if device == "cuda" else torch.backends.mkldnn.matmul
    previous = backend.fp32_precision
    backend.fp32_precision = "tf32" if device == "cuda" else "bf16"
    try:
        fp32 = [t.float().to(device) for t in (u, h, grad_y)]
        got = {path: outputs_and_grads(PATHS[path], *fp32) for path in ("direct", "fft")}
    finally:
        backend.fp32_precision = previous
    for path in ("direct", "fft"):
        for name, e, g in zip(("y", "grad_u", "grad_h"), exact, got[path]):
            assert g.dtype == torch.float32, name
            error = ((g.double() - e).abs().max() / e.abs().max()).item()
            assert error <= 4e-6, f"{path} {name}: relative error {error:.2e}"


@pytest.mark.parametrize("path", ["direct", "fft"])
def test_low_precision_input_is_computed_in_fp32(path):
    """bf16 in, bf16 out, and the value is the fp32 convolution rounded once."""
    u, h = random(2, 12, 3, seed=7).bfloat16(), random(12, 3, seed=8).bfloat16()
    y = PATHS[path](u, h)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, naive_conv(u.double(), h.double()).bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize(("T", "path"), [(1, "direct"), (DIRECT_MAX_T, "direct"), (DIRECT_MAX_T + 1, "fft")],
                         ids=["T1-direct", "Tmax-direct", "Tmax+1-fft"])
def test_dispatch_picks_the_path_at_the_threshold(T, path):
    """causal_conv's output is bit for bit the chosen path's (fp32, where the two paths' roundings differ)."""
    u, h = random(1, T, 2, seed=9, dtype=torch.float32), random(T, 2, seed=10, dtype=torch.float32)
    y = causal_conv(u, h)
    chosen, other = PATHS[path], PATHS["fft" if path == "direct" else "direct"]
    assert torch.equal(y, chosen(u, h))
    if T > 1:
        assert not torch.equal(y, other(u, h))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_matmul_precision_is_pinned_and_restored(device):
    """Inside the op's block fp32 matmuls run at IEEE precision, whatever was set before; the setting comes back
    after, also when the block raises. (Setting the flags needs no GPU.)"""
    backend = torch.backends.cuda.matmul if device == "cuda" else torch.backends.mkldnn.matmul
    previous = backend.fp32_precision
    lowered = "tf32" if device == "cuda" else "bf16"
    backend.fp32_precision = lowered
    try:
        with _long_conv._ieee_fp32_matmuls(torch.device(device)):
            assert backend.fp32_precision == "ieee"
        assert backend.fp32_precision == lowered
        with pytest.raises(RuntimeError, match="inside"):
            with _long_conv._ieee_fp32_matmuls(torch.device(device)):
                raise RuntimeError("inside")
        assert backend.fp32_precision == lowered
    finally:
        backend.fp32_precision = previous


def test_backward_called_under_autocast_stays_fp32():
    """A backward called inside a bf16 autocast region (the CPU runs it on the calling thread) keeps the direct
    path's matmuls in fp32."""
    u, h = random(2, 64, 3, seed=20).float(), random(64, 3, seed=21).float()
    grad_y = random(2, 64, 3, seed=22).float()
    want = outputs_and_grads(naive_conv, u.double(), h.double(), grad_y.double())
    u, h = u.requires_grad_(), h.requires_grad_()
    y = direct_causal_conv(u, h)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.autograd.grad(y, (u, h), grad_y)
    for name, g, w in zip(("grad_u", "grad_h"), got, want[1:]):
        assert g.dtype == torch.float32, name
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("path", ["direct", "fft", "dispatch"])
def test_conv_under_autocast(path):
    """Under bf16 autocast the direct path runs its matmuls on bf16 operands (bit for bit the op on rounded u and h,
    cast back to u's fp32) and its gradients come back fp32 within bf16 rounding of fp64; the FFT stays fp32, bit
    for bit its result outside autocast. The dispatcher at T = 64 takes the direct path."""
    u, h, grad_y = random(2, 64, 3, seed=27).float(), random(64, 3, seed=28).float() / 8, random(2, 64, 3, seed=29)
    want = outputs_and_grads(naive_conv, u.double(), h.double(), grad_y.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = outputs_and_grads(PATHS[path], u, h, grad_y.float())
    assert all(t.dtype == torch.float32 for t in got)
    if path == "fft":
        torch.testing.assert_close(got[0], fft_causal_conv(u, h), rtol=0, atol=0)
        return
    rounded = torch.ops.zoo_conv.toeplitz_conv(u.bfloat16().permute(2, 1, 0), h.bfloat16()).permute(2, 1, 0).float()
    torch.testing.assert_close(got[0], rounded, rtol=0, atol=0)
    for name, g, w in zip(("y", "grad_u", "grad_h"), got, want):
        error = ((g.double() - w).abs().max() / w.abs().max()).item()
        assert 0 < error <= 2**-6, f"{name}: relative error {error:.2e}"


def _op_inputs(layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's u [C=3, T=6, B=2] (channels first) and h [6, 3], contiguous or as transposed views
    (explicit_causal_conv passes h = weight.flip(1).T)."""
    if layout == "contiguous":
        return random(3, 6, 2, seed=11), random(6, 3, seed=12)
    return random(2, 6, 3, seed=11).permute(2, 1, 0), random(3, 6, seed=12).T


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_toeplitz_op_passes_opcheck(layout):
    """Schema, fake tensor (its strides included), autograd registration and torch.compile tracing of the op."""
    u, h = _op_inputs(layout)
    torch.library.opcheck(torch.ops.zoo_conv.toeplitz_conv, (u.requires_grad_(), h.requires_grad_()))


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_toeplitz_backward_op_passes_opcheck(layout):
    u, h = _op_inputs(layout)
    grad_y = random(3, 6, 2, seed=13)
    torch.library.opcheck(torch.ops.zoo_conv.toeplitz_conv_backward, (grad_y, u, h))


def test_compiled_long_explicit_conv_backward_equals_eager():
    """A filter longer than SHIFTED_SUM_MAX_TAPS reaches the op as a transposed view; the compiled backward must
    agree with the fake op's strides (inductor asserts them) and with eager."""
    k = SHIFTED_SUM_MAX_TAPS + 8
    u, weight = random(2, k, 3, seed=14), random(3, k, seed=15)
    grads = []
    for fn in (explicit_causal_conv, torch.compile(explicit_causal_conv, fullgraph=True)):
        w = weight.clone().requires_grad_()
        fn(u, w, None).square().sum().backward()
        grads.append(w.grad)
    torch.testing.assert_close(grads[1], grads[0])


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("u_shape", "h_shape"), [((2, 5), (5, 3)), ((2, 5, 3), (5, 4)), ((2, 5, 3), (0, 3))],
                         ids=["u-2d", "channels-differ", "empty-filter"])
def test_bad_shapes_raise(path, u_shape, h_shape):
    with pytest.raises(ValueError, match="u must be"):
        PATHS[path](torch.zeros(u_shape), torch.zeros(h_shape))


@pytest.mark.parametrize("batched", ["u-and-h", "h-only", "u-only"])
def test_direct_conv_under_vmap_equals_a_loop_over_members(batched):
    """torch.func.vmap over the direct path and torch.autograd.grad through it, as packed runs train (zoo/steps.py
    PackedStep), against one double loop per member on outputs and gradients."""
    N, B, T, C = 3, 2, 7, 4
    u = random(N, B, T, C, seed=13) if batched != "h-only" else random(B, T, C, seed=13)
    h = random(N, T, C, seed=14) if batched != "u-only" else random(T, C, seed=14)
    in_dims = (0 if batched != "h-only" else None, 0 if batched != "u-only" else None)
    grad_y = random(N, B, T, C, seed=15)
    got = outputs_and_grads(torch.func.vmap(direct_causal_conv, in_dims=in_dims), u, h, grad_y)
    want = outputs_and_grads(lambda u, h: torch.stack([
        naive_conv(u[n] if in_dims[0] == 0 else u, h[n] if in_dims[1] == 0 else h) for n in range(N)]), u, h, grad_y)
    for name, g, w in zip(("y", "grad_u", "grad_h"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("history", ["none", "given"])
@pytest.mark.parametrize("k", [3, SHIFTED_SUM_MAX_TAPS + 8], ids=["k3-short", "long-k"])
def test_explicit_conv_equals_the_shifted_sum(k, history):
    """explicit_causal_conv against depthwise_causal_conv (shifted sum, any k) on outputs and gradients; no
    history means zeros, which the long branch skips by convolving the T positions alone. T > k: every tap
    reaches inside the sequence."""
    B, T, C = 2, SHIFTED_SUM_MAX_TAPS + 13, 3
    u, w = random(B, T, C, seed=16), random(C, k, seed=17)
    past = random(B, k - 1, C, seed=18) if history == "given" else torch.zeros(B, k - 1, C, dtype=torch.float64)
    grad_y = random(B, T, C, seed=19)
    got = outputs_and_grads(lambda u, w: explicit_causal_conv(u, w, None if history == "none" else past), u, w,
                            grad_y)
    want = outputs_and_grads(lambda u, w: depthwise_causal_conv(u, w, past), u, w, grad_y)
    for name, g, e in zip(("y", "grad_u", "grad_w"), got, want):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("history", ["zeros", "given"])
@pytest.mark.parametrize("k", [1, 2, 3, 5], ids=lambda k: f"k{k}")
def test_depthwise_conv_equals_the_double_loop(k, history):
    """depthwise_causal_conv against the double loop over [history; u] with h[lag] = weight[:, k-1-lag], keeping
    its last T positions: output and the gradients of u, weight and history (fp64). T = 6 > k - 1 and T = 6 < 5 + 2
    reach both a window inside the history and one inside u."""
    B, T, C = 2, 6, 3
    u, w = random(B, T, C, seed=20), random(C, k, seed=21)
    past = random(B, k - 1, C, seed=22) if history == "given" else torch.zeros(B, k - 1, C, dtype=torch.float64)
    grad_y = random(B, T, C, seed=23)
    leaves = [t.clone().requires_grad_() for t in (u, w, past)]
    got = depthwise_causal_conv(*leaves)
    got_grads = torch.autograd.grad(got, leaves, grad_y, allow_unused=True)  # k = 1: no history
    ref_leaves = [t.clone().requires_grad_() for t in (u, w, past)]
    u_r, w_r, past_r = ref_leaves
    want = naive_conv(torch.cat([past_r, u_r], dim=1), w_r.flip(1).T)[:, k - 1 :]
    want_grads = torch.autograd.grad(want, ref_leaves, grad_y, allow_unused=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for name, g, e, leaf in zip(("grad_u", "grad_w", "grad_history"), got_grads, want_grads, leaves):
        g, e = (torch.zeros_like(leaf) if t is None else t for t in (g, e))
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_depthwise_conv_keeps_the_input_dtype(dtype):
    """A bf16 input with fp32 weights gives bf16 out (the weights are cast, not the input promoted), as the
    mixers under autocast expect from a conv; within a bf16 rounding of the fp64 result."""
    u, w, past = random(2, 5, 4, seed=24), random(4, 3, seed=25), random(2, 2, 4, seed=26)
    y = depthwise_causal_conv(u.to(dtype), w.float(), past.to(dtype))
    assert y.dtype == dtype
    want = depthwise_causal_conv(u.to(dtype).double(), w.to(dtype).double(), past.to(dtype).double())
    torch.testing.assert_close(y.double(), want, rtol=2**-6, atol=2**-6 * want.abs().max().item())
