"""The Based references agree with each other and with FLA's feature map (CPU, float64, no Triton)."""

import pytest
import torch

from kernels.based import (
    feature_dim,
    naive_chunk_based,
    naive_parallel_based,
    naive_recurrent_based,
    orders_to_state,
    state_to_orders,
    taylor_feature_map,
)
from kernels.testing import CPU_T, assert_close, rel_error

VARIANTS = [(None, True, True), (0.3, True, False), (None, False, True)]
VARIANT_IDS = ["default", "scale0.3-h0-unnormalized", "no-h0"]


@pytest.mark.parametrize("scale, with_state, normalize", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("T", CPU_T, ids=[f"T{t}" for t in CPU_T])
def test_three_forms_agree(T, scale, with_state, normalize):
    g = torch.Generator().manual_seed(T)
    B, H, f, V = 2, 3, 5, 7
    q, k, v = (torch.randn(B, T, H, d, generator=g, dtype=torch.float64) for d in (f, f, V))
    state = None
    if with_state:
        E = feature_dim(f)
        state = (torch.randn(B, H, E, V, generator=g, dtype=torch.float64),
                 torch.rand(B, H, E, generator=g, dtype=torch.float64) + 3)
    args = dict(scale=scale, initial_state=state, output_final_state=True, normalize=normalize)
    o_p, (kv_p, ks_p) = naive_parallel_based(q, k, v, **args)
    for o, (kv, ks) in (naive_recurrent_based(q, k, v, **args), naive_chunk_based(q, k, v, chunk_size=8, **args)):
        for a, r in ((o, o_p), (kv, kv_p), (ks, ks_p)):
            assert rel_error(a, r) < 1e-12


def test_feature_map_is_flas_and_gives_the_taylor_kernel():
    from fla.modules.feature_map import TaylorFeatureMap

    x, y = torch.randn(2, 4, 3, 16, dtype=torch.float64), torch.randn(2, 4, 3, 16, dtype=torch.float64)
    torch.testing.assert_close(taylor_feature_map(x), TaylorFeatureMap(16)(x))
    s = (x * y).sum(-1) / 4
    torch.testing.assert_close((taylor_feature_map(x) * taylor_feature_map(y)).sum(-1), 1 + s + s * s / 2)
    assert taylor_feature_map(x).shape[-1] == feature_dim(16) == 153


def test_order_state_round_trip():
    _, (kv, ks) = naive_parallel_based(*(torch.randn(1, 9, 2, d, dtype=torch.float64) for d in (6, 6, 4)),
                                       output_final_state=True)
    hv, hz = state_to_orders(kv, ks)
    assert hv.shape == (1, 2, 1 + 6 + 36, 4)
    kv2, ks2 = orders_to_state(hv, hz)
    torch.testing.assert_close(kv2, kv)
    torch.testing.assert_close(ks2, ks)


def test_tolerance_rule_rejects_a_wrong_result():
    ref = torch.randn(1000, dtype=torch.float64)
    base = ref.float()
    assert_close("same as naive", base, ref, base, torch.float32)
    with pytest.raises(AssertionError, match="relative error"):
        assert_close("garbage", torch.randn(1000), ref, base, torch.float32)
    with pytest.raises(AssertionError, match="relative error"):
        assert_close("nan", torch.full((1000,), float("nan")), ref, base, torch.float32)
