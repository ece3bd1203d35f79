"""kernels/based/gluon.py on the CPU: its state layout against the Taylor-order form, and its kernel compiled for
sm_90a (the kernel itself runs only on a Hopper GPU: tests/kernels/test_based_gpu.py)."""

import os

import pytest
import torch
import triton

from kernels.based.naive import orders_to_state, state_to_orders, taylor_feature_map

gluon = pytest.importorskip("kernels.based.gluon", reason="this Triton has no Gluon")
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _kernel_features(k: torch.Tensor) -> torch.Tensor:
    """The kernel's 192 key features, written out one by one: block 0 = k_a, k_a², 1, zeros; then the pairs
    k_a·k_b, b = (a + d) mod 16, d = 1..8."""
    cols = [k[..., c] for c in range(16)] + [k[..., a] ** 2 for a in range(16)] + [torch.ones_like(k[..., 0])]
    cols += [torch.zeros_like(k[..., 0])] * 31
    cols += [k[..., j % 16] * k[..., (j % 16 + 1 + j // 16) % 16] for j in range(128)]
    return torch.stack(cols, -1)


def test_kernel_rows_hold_the_state_and_convert_back():
    g = torch.Generator().manual_seed(0)
    B, T, H, K, V = 2, 50, 3, 16, 8
    k = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    phi = taylor_feature_map(k)
    kv, ks = torch.einsum("bthe,bthv->bhev", phi, v), phi.sum(1)
    h, z = gluon.to_kernel_rows(*state_to_orders(kv, ks))
    feats = _kernel_features(k.transpose(1, 2).reshape(B * H, T, K))
    vv = v.transpose(1, 2).reshape(B * H, T, V)
    torch.testing.assert_close(h, torch.einsum("ntf,ntv->nfv", feats, vv))
    torch.testing.assert_close(z, feats.sum(1))
    kv2, ks2 = orders_to_state(*gluon.from_kernel_rows(h, z, B, H))
    torch.testing.assert_close(kv2, kv)
    torch.testing.assert_close(ks2, ks)


def test_applies_only_to_its_case():
    q = torch.zeros(8, 64, 16, 16, dtype=torch.bfloat16)
    v = torch.zeros(8, 64, 16, 64, dtype=torch.bfloat16)
    assert not gluon.applies(q, v, True)  # on the CPU


@pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "ptxas")), reason="Triton ships no ptxas here")
@pytest.mark.parametrize("states", [False, True])
def test_gluon_forward_compiles_for_sm90(states):
    """The kernel compiles for sm_90a: warp-specialised (setmaxnreg per partition), its dots warpgroup MMAs, within
    the 168 registers per thread that 12 warps leave, and without more than a few spills (Triton 3.6, the H200's:
    32 bytes, 164 with the states stored; Triton 3.9: 208 / 272; 64 producer registers: 1676)."""
    import re

    from kernels.based.sm90_report import compile_gluon_forward, ptxas_report

    kernel = compile_gluon_forward(states)
    ptx = kernel.asm["ptx"]
    assert "setmaxnreg" in ptx and ptx.count("wgmma.mma_async") >= 26
    report = ptxas_report(ptx)
    used = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    assert 0 < used <= 168 and spills <= 512, report
