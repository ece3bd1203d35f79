"""kernels/based/gluon.py on the CPU: its state layout against the Taylor-order form, and its kernel compiled for
sm_90a (the kernel itself runs only on a Hopper GPU: tests/kernels/test_based_gpu.py)."""

import os

import pytest
import torch
import triton

from kernels.based.naive import orders_to_state, state_to_orders, taylor_feature_map

gluon = pytest.importorskip("kernels.based.gluon", reason="this Triton has no Gluon")
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _kernel_features(k: torch.Tensor, narrow: bool) -> torch.Tensor:
    """The kernel's key features, written out one by one. Wide (192): block 0 = k_a, k_a², 1, zeros; then the pairs
    k_a·k_b, b = (a + d) mod 16, d = 1..8. Narrow (160): the pairs d = 0..7 (d = 0: k_a²), then k_a, the pairs (a,
    a + 8) for a < 8, 1, zeros."""
    one, zero = torch.ones_like(k[..., 0]), torch.zeros_like(k[..., 0])
    if narrow:
        cols = [k[..., c % 16] * k[..., (c % 16 + c // 16) % 16] for c in range(128)]
        cols += [k[..., c] for c in range(16)] + [k[..., a] * k[..., a + 8] for a in range(8)] + [one] + [zero] * 7
        return torch.stack(cols, -1)
    cols = [k[..., c] for c in range(16)] + [k[..., a] ** 2 for a in range(16)] + [one] + [zero] * 31
    cols += [k[..., j % 16] * k[..., (j % 16 + 1 + j // 16) % 16] for j in range(128)]
    return torch.stack(cols, -1)


@pytest.mark.parametrize("narrow", [False, True], ids=["wide", "narrow"])
def test_kernel_rows_hold_the_state_and_convert_back(narrow):
    """Both of the kernel's state layouts (`gluon.feature_rows`: the wide one of the forward storing states for a
    backward, the narrow one of the inference forward) hold Σ φ(k) vᵀ of its features, the wide one Σ φ(k) too and
    the narrow one the moments n, Σ k, Σ k kᵀ, and convert back to the Taylor-order form."""
    g = torch.Generator().manual_seed(0)
    B, T, H, K, V = 2, 50, 3, 16, 8
    k = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    phi = taylor_feature_map(k)
    kv, ks = torch.einsum("bthe,bthv->bhev", phi, v), phi.sum(1)
    h, z = gluon.to_kernel_rows(*state_to_orders(kv, ks), narrow=narrow)
    assert h.shape == (B * H, 160 if narrow else 192, V)
    feats = _kernel_features(k.transpose(1, 2).reshape(B * H, T, K), narrow)
    vv = v.transpose(1, 2).reshape(B * H, T, V)
    torch.testing.assert_close(h, torch.einsum("ntf,ntv->nfv", feats, vv))
    if narrow:  # the denominator state as the inference forward keeps it: n, Σ k, Σ k kᵀ
        kk = k.transpose(1, 2).reshape(B * H, T, K)
        moments = [torch.full((B * H, 1), float(T), dtype=k.dtype), kk.sum(1),
                   torch.einsum("nta,ntb->nab", kk, kk).reshape(B * H, K * K)]
        torch.testing.assert_close(z, torch.cat(moments, 1))
    else:
        torch.testing.assert_close(z, feats.sum(1))
    kv2, ks2 = orders_to_state(*gluon.from_kernel_rows(h, z, B, H))
    torch.testing.assert_close(kv2, kv)
    torch.testing.assert_close(ks2, ks)


@pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "ptxas")), reason="Triton ships no ptxas here")
@pytest.mark.parametrize("states", [False, True], ids=["inference", "storing-states"])
def test_gluon_forward_compiles_for_sm90(states):
    """The kernel compiles for sm_90a: warp-specialised (setmaxnreg per partition), its dots warpgroup MMAs, within
    the 168 registers per thread that 12 warps leave, and without more than a few spills. v comes in through TMA
    loads and the Gluon backward's states leave through TMA stores."""
    import re

    from kernels.sm90 import compile_gluon_forward, ptxas_report

    kernel = compile_gluon_forward(states)
    ptx = kernel.asm["ptx"]
    assert "setmaxnreg" in ptx and ptx.count("wgmma.mma_async") >= 26
    # v comes in through TMA loads (two before the loop, one in it), the states leave through TMA stores
    assert ptx.count("cp.async.bulk.tensor") == 3 + (3 if states else 0)
    report = ptxas_report(ptx)
    used = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    assert 0 < used <= 168 and spills <= 512, report


def _emulated_backward(q, k, v, h0, z0, do, dh, dz, scale):
    """float64 PyTorch of what kernels/based/gluon_backward.py's two kernels compute, step for step and with their
    constants (`factor_matrices`, the query's weights in its third matrix), for one sequence: q, k [T, 16], v, do
    [T, V], the initial state and the final state's gradient in the kernel's rows. Returns o, dq, dk, dv and the
    initial state's gradient."""
    from kernels.based import gluon_backward as gb

    T, C = q.shape[0], 64
    A, Bm, Bq = gb.factor_matrices().double()  # Bq = B ⊙ h, the query side's
    xq, xk = q * scale, k
    # block 0: the order-1 features are the first factor alone (its second factor is the constant u), column 32 is 1
    u = [(torch.arange(64) < 16).double() if b == 0 else torch.zeros(64, dtype=torch.float64) for b in range(3)]
    const = torch.zeros(64, dtype=torch.float64)
    const[32] = 1
    fa = lambda x, b: x @ A[b]  # noqa: E731
    fb = lambda x, b: x @ Bm[b] + u[b]  # noqa: E731
    fbq = lambda x, b: x @ Bq[b] + u[b]  # noqa: E731
    psi = torch.cat([fa(xq, b) * fbq(xq, b) + (const if b == 0 else 0) for b in range(3)], 1)
    phi = torch.cat([fa(xk, b) * fb(xk, b) + (const if b == 0 else 0) for b in range(3)], 1)
    # the states entering each chunk (the forward's stored hs, zs) and the output
    hs, zs, num, den = [], [], torch.zeros_like(v), v.new_zeros(T)
    h, z = h0.clone(), z0.clone()
    for c0 in range(0, T, C):
        sl = slice(c0, min(c0 + C, T))
        hs.append(h.clone())
        zs.append(z.clone())
        a1 = xq[sl] @ xk[sl].T + 1
        w = torch.tril((a1 * a1 + 1) / 2)
        num[sl] = w @ v[sl] + psi[sl] @ h
        den[sl] = w.sum(1) + psi[sl] @ z
        h, z = h + phi[sl].T @ v[sl], z + phi[sl].sum(0)
    o = num / den[:, None]
    g, e = do / den[:, None], -(do * o).sum(1) / den
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i, c0 in enumerate(range(0, T, gb.DQ_CHUNK)):  # _dq_kernel, two chunks a step: the forward stores every
        sl = slice(c0, min(c0 + gb.DQ_CHUNK, T))  # second chunk's entering state
        ds = torch.tril((g[sl] @ v[sl].T + e[sl, None]) * (xq[sl] @ xk[sl].T + 1))
        acc = ds @ xk[sl]
        for b in range(3):
            bs = slice(64 * b, 64 * b + 64)
            gp = g[sl] @ hs[2 * i][bs].T + e[sl, None] * zs[2 * i][bs]
            acc = acc + (gp * fbq(xq[sl], b)) @ A[b].T + (gp * fa(xq[sl], b)) @ Bq[b].T
        dq[sl] = scale * acc
    dS, dZ = dh.clone(), dz.clone()
    for c0 in reversed(range(0, T, C)):  # _dkv_kernel, from the last chunk
        sl = slice(c0, min(c0 + C, T))
        a1 = xq[sl] @ xk[sl].T + 1
        w = torch.tril((a1 * a1 + 1) / 2)
        ds = torch.tril((g[sl] @ v[sl].T + e[sl, None]) * a1)
        dv[sl] = w.T @ g[sl] + phi[sl] @ dS
        acc = ds.T @ xq[sl]
        for b in range(3):
            bs = slice(64 * b, 64 * b + 64)
            gf = v[sl] @ dS[bs].T + dZ[bs]
            acc = acc + (gf * fb(xk[sl], b)) @ A[b].T + (gf * fa(xk[sl], b)) @ Bm[b].T
        dk[sl] = acc
        dS, dZ = dS + psi[sl].T @ g[sl], dZ + psi[sl].T @ e[sl]
    return o, dq, dk, dv, dS, dZ


def test_gluon_backward_algebra_matches_autograd():
    """The Gluon backward's algorithm (its constants, the factor-matrix Jacobians with block 0's order-1 and constant
    features added, the reverse walk, the state-gradient row maps) in float64 against autograd of the naive form:
    3 chunks, the last partial, an initial state and a final-state gradient."""
    gb = pytest.importorskip("kernels.based.gluon_backward")
    from kernels.based import naive_parallel_based

    g = torch.Generator().manual_seed(0)
    B, T, H, K, V, scale = 1, 150, 2, 16, 8, 0.3
    q, k, v, do = (torch.randn(B, T, H, d, generator=g, dtype=torch.float64) for d in (K, K, V, V))
    prev = torch.randn(B, 8, H, K, generator=g, dtype=torch.float64)
    _, (kv0, ks0) = naive_parallel_based(prev, prev, torch.randn(B, 8, H, V, generator=g, dtype=torch.float64),
                                         output_final_state=True)
    dkvT, dksT = torch.randn_like(kv0), torch.randn_like(ks0)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, kv0, ks0)]
    o, (kvT, ksT) = naive_parallel_based(*leaves[:3], scale=scale, initial_state=tuple(leaves[3:]),
                                         output_final_state=True)
    ref = torch.autograd.grad((o * do).sum() + (kvT * dkvT).sum() + (ksT * dksT).sum(), leaves)
    # the final state's gradient in Taylor-order form, then in the kernel's rows (as gluon_backward takes it)
    hvT, hzT = (torch.zeros(B, H, 1 + K + K * K, *s, dtype=torch.float64, requires_grad=True) for s in ((V,), ()))
    dhvT, dhzT = torch.autograd.grad(orders_to_state(hvT, hzT), (hvT, hzT), (dkvT, dksT))
    dh, dz = gb.state_grad_to_rows(dhvT, dhzT)
    h0, z0 = gluon.to_kernel_rows(*state_to_orders(kv0, ks0))
    outs = [_emulated_backward(q[0, :, n], k[0, :, n], v[0, :, n], h0[n], z0[n], do[0, :, n], dh[n], dz[n], scale)
            for n in range(H)]
    torch.testing.assert_close(torch.stack([x[0] for x in outs], 1)[None], o.detach())
    for i, name in ((1, "dq"), (2, "dk"), (3, "dv")):
        torch.testing.assert_close(torch.stack([x[i] for x in outs], 1)[None], ref[i - 1], msg=name)
    dhv0, dhz0 = gb.rows_grad_to_state(torch.stack([x[4] for x in outs]), torch.stack([x[5] for x in outs]), B, H)
    s0 = [x.detach().clone().requires_grad_() for x in (kv0, ks0)]
    d0 = torch.autograd.grad(state_to_orders(*s0), s0, (dhv0, dhz0))
    torch.testing.assert_close(d0[0], ref[3], msg="dkv0")
    torch.testing.assert_close(d0[1], ref[4], msg="dk_sum0")


@pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "ptxas")), reason="Triton ships no ptxas here")
@pytest.mark.parametrize("kind, states", [("dq", False), ("dkv", False), ("dkv", True)])
def test_gluon_backward_compiles_for_sm90(kind, states):
    """The backward kernels compile for sm_90a with warpgroup MMAs and at most a few spills. The dk/dv walk is
    warp-specialised (setmaxnreg) within 168 registers per thread; dq runs 4 warps at 255 registers, its step of two
    chunks with its inputs copied one chunk ahead."""
    import re

    from kernels.sm90 import compile_gluon_backward, ptxas_report

    ptx = compile_gluon_backward(kind, states).asm["ptx"]
    report = ptxas_report(ptx)
    used = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    if kind == "dkv":
        assert "setmaxnreg" in ptx and ptx.count("wgmma.mma_async") >= 100
        assert 0 < used <= 168 and spills <= 64, report
        # ptxas warning C7512: short of registers for the MMAs in flight, it makes them synchronous
        assert "serialized" not in report, report
    else:
        assert ptx.count("wgmma.mma_async") >= 100 and ptx.count("cp.async.cg.shared.global") >= 48
        assert 0 < used <= 255 and spills <= 192, report
