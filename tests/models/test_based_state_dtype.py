"""The Based mixer's `state_dtype` option: kv stored in fp32 (default) or bf16, k_sum always fp32. Validation, the
state's dtypes and bytes, the naive step against a reference that rounds kv to bf16 after each update, the prefill
rounding its fp32 result once, and a ZooCache's bytes."""

import re

import pytest
import torch

from kernels.based.naive import taylor_feature_map
from zoo.models.hf import ZooConfig, ZooForCausalLM
from zoo.models.mixers import MIXERS

D_MODEL, H, F_DIM, DV = 32, 2, 4, 16
E = 1 + F_DIM + F_DIM * (F_DIM + 1) // 2


def based(**options) -> torch.nn.Module:
    torch.manual_seed(0)
    return MIXERS["based"](D_MODEL, feature_dim=F_DIM, num_heads=H, head_dim_v=DV, **options)


@pytest.mark.parametrize("value", ["fp16", "float32", None, 32], ids=["fp16", "float32", "None", "int"])
def test_bad_state_dtype_is_a_one_line_error(value):
    with pytest.raises(ValueError, match=re.escape("based: state_dtype must be one of fp32|bf16, got")) as err:
        based(state_dtype=value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("state_dtype, model_dtype, kv_dtype, ks_dtype", [
    ("fp32", torch.float32, torch.float32, torch.float32),
    ("fp32", torch.bfloat16, torch.float32, torch.float32),
    ("fp32", torch.float64, torch.float64, torch.float64),
    ("bf16", torch.float32, torch.bfloat16, torch.float32),
    ("bf16", torch.bfloat16, torch.bfloat16, torch.float32),
], ids=["fp32-model_fp32", "fp32-model_bf16", "fp32-model_fp64", "bf16-model_fp32", "bf16-model_bf16"])
def test_state_dtypes_and_bytes(state_dtype, model_dtype, kv_dtype, ks_dtype):
    """init_state's dtypes; state_size counts elements whatever the storage, state_nbytes the bytes allocated."""
    mixer = based(state_dtype=state_dtype).to(model_dtype)
    state = mixer.init_state(3)
    assert state["kv"].dtype == kv_dtype and state["k_sum"].dtype == ks_dtype
    assert mixer.state_size(100) == H * (E * DV + E)
    assert 3 * mixer.state_nbytes(100, model_dtype) == sum(t.numel() * t.element_size() for t in state.values())


def test_bf16_state_bytes_are_about_half():
    fp32, bf16 = based().state_nbytes(0), based(state_dtype="bf16").state_nbytes(0)
    assert fp32 == 4 * H * (E * DV + E)
    assert bf16 == 2 * H * E * DV + 4 * H * E


def _rounded_steps(mixer, x, kv, ks):
    """The recurrent form in fp32 with kv rounded to bf16 (to nearest) after each update; kv, ks: the start."""
    outs = []
    with torch.no_grad():
        for t in range(x.shape[1]):
            q = (x[:, t] @ mixer.q_proj.weight.T).reshape(-1, H, F_DIM)
            k = (x[:, t] @ mixer.k_proj.weight.T).reshape(-1, H, F_DIM)
            v = (x[:, t] @ mixer.v_proj.weight.T).reshape(-1, H, DV)
            phi_q, phi_k = taylor_feature_map(q), taylor_feature_map(k)
            kv = (kv.float() + phi_k[..., None] * v[..., None, :]).to(torch.bfloat16)
            ks = ks + phi_k
            num = torch.einsum("bhe,bhed->bhd", phi_q, kv.float())
            y = num / (torch.einsum("bhe,bhe->bh", phi_q, ks)[..., None] + mixer.config.eps)
            outs.append(y.reshape(-1, H * DV) @ mixer.out.weight.T)
    return torch.stack(outs, 1), kv, ks


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefill_rounds_its_fp32_result_once(model_dtype):
    """Based(impl="naive", state_dtype="bf16") prefilled twice (from zeros, then from the state) computes in fp32:
    outputs equal the fp32 state's, and kv equals the fp32 state's kv rounded to bf16 (after the first piece: once)."""
    mixer, fp32 = based(state_dtype="bf16").to(model_dtype), based().to(model_dtype)
    x = torch.randn(2, 12, D_MODEL, dtype=model_dtype)
    state, s32 = mixer.init_state(2), fp32.init_state(2)
    with torch.no_grad():
        assert torch.equal(mixer(x[:, :8], state), fp32(x[:, :8], s32))
        assert torch.equal(state["kv"], s32["kv"].to(torch.bfloat16)) and torch.equal(state["k_sum"], s32["k_sum"])
        s32["kv"].copy_(state["kv"])  # the second piece starts from the same (rounded) state
        assert torch.equal(mixer(x[:, 8:], state), fp32(x[:, 8:], s32))
    assert torch.equal(state["kv"], s32["kv"].to(torch.bfloat16)) and torch.equal(state["k_sum"], s32["k_sum"])


def test_naive_bf16_state_step_matches_rounded_reference():
    """Steps of Based(impl="naive", state_dtype="bf16") after a prefill equal the reference that computes each update
    in fp32 and rounds kv to bf16 after it, and differ from the fp32 state's steps."""
    mixer, fp32 = based(state_dtype="bf16"), based()
    x = torch.randn(2, 12, D_MODEL)
    state, s32 = mixer.init_state(2), fp32.init_state(2)
    with torch.no_grad():
        mixer(x[:, :8], state)
        fp32(x[:, :8], s32)
        ref_y, ref_kv, ref_ks = _rounded_steps(mixer, x[:, 8:], state["kv"].clone(), state["k_sum"].clone())
        ys = torch.stack([mixer.step(x[:, t], state) for t in range(8, 12)], 1)
    assert state["kv"].dtype == torch.bfloat16
    torch.testing.assert_close(ys, ref_y, rtol=1e-5, atol=1e-6)
    same = (state["kv"] == ref_kv).double().mean().item()
    assert same >= 0.99, f"kv: {same:.2%} of the elements equal the reference's"
    torch.testing.assert_close(state["k_sum"], ref_ks, rtol=1e-6, atol=1e-6)
    # the steps differ from the fp32 state's, by about bf16's rounding
    ys32 = torch.stack([fp32.step(x[:, t], s32) for t in range(8, 12)], 1)
    assert not torch.allclose(ys, ys32, rtol=1e-5, atol=1e-6)


def test_zoo_cache_bytes_follow_the_state_dtype():
    """A ZooCache's nbytes drops by 2 bytes per kv element of each Based layer with state_dtype=bf16."""
    def model(state_dtype):
        mixers = {"based": {"feature_dim": F_DIM, "num_heads": H, "head_dim_v": DV, "state_dtype": state_dtype},
                  "sliding_window": {"window": 4, "num_heads": 2}}
        return ZooForCausalLM(ZooConfig(vocab_size=64, d_model=D_MODEL, mixers=mixers)).eval()

    fp32, bf16 = model("fp32"), model("bf16")
    n_based = sum(b.mixer.name == "based" for b in fp32.model.blocks)
    assert n_based >= 1
    c32, c16 = fp32.make_cache(3), bf16.make_cache(3)
    assert c32.nbytes() - c16.nbytes() == n_based * 3 * H * E * DV * 2


def _tiny_lm(state_dtype):
    torch.manual_seed(0)
    mixers = {"based": {"feature_dim": F_DIM, "num_heads": H, "state_dtype": state_dtype},
              "sliding_window": {"window": 4, "num_heads": 2}}
    model = ZooForCausalLM(ZooConfig(vocab_size=64, d_model=D_MODEL, mixers=mixers)).eval()
    with torch.no_grad():  # larger weights than the init, so the greedy tokens depend on the context
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_generation_bench_state_dtype_cost(state_dtype):
    """experiments/bench/generation.py's `state_dtype_cost` against the fp32-state model: zero cost when the model
    under test has the fp32 state itself, a logit difference of bf16's order with the bf16 state."""
    from types import SimpleNamespace

    from experiments.bench.generation import generate_kwargs, state_dtype_cost

    model, reference = _tiny_lm(state_dtype), _tiny_lm("fp32")
    reference.load_state_dict(model.state_dict())
    args = SimpleNamespace(gen=12)
    ids = torch.randint(1, 64, (3, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        seq = model.generate(ids, **generate_kwargs("based", args.gen, ids.shape[1]))
        cost = state_dtype_cost(model, reference, ids, seq, args)
    assert 0.0 <= cost["token_agreement"] <= 1.0 and 0 <= cost["first_divergence_median"] <= args.gen
    if state_dtype == "fp32":
        assert cost["token_agreement"] == 1.0 and cost["first_divergence_median"] == args.gen
        assert cost["logit_rel_diff_max"] == 0.0
    else:
        assert 1e-5 < cost["logit_rel_diff_median"] <= cost["logit_rel_diff_max"] < 0.1
