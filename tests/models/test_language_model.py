"""LanguageModel: forward == step loop, chunked prefill, state size, config typos, tying, init."""

import pytest
import torch

from zoo.config import ModelConfig
from zoo.models import MIXERS, Block, LanguageModel

VOCAB, D = 23, 16
MIXER_OPTIONS = {
    "attention": {"num_heads": 2, "max_seq_len": 40},
    "sliding_window": {"window": 4, "num_heads": 2},
    "based": {"feature_dim": 4, "num_heads": 2, "chunk_size": 8},
    "base_conv": {"kernel_size": 3},
}

VARIANTS = {
    "swiglu-rmsnorm-tied": dict(mlp="swiglu", norm="rmsnorm", tie_embeddings=True),
    "gelu-layernorm-untied": dict(mlp="gelu", norm="layernorm", tie_embeddings=False),
    "nomlp": dict(mlp="none"),
    "tanh-layernorm-tied": dict(mlp="tanh", norm="layernorm", tie_embeddings=True),
}


def config(max_seq_len: int = 40, **overrides) -> ModelConfig:
    mixers = {name: dict(options) for name, options in MIXER_OPTIONS.items()}
    mixers["attention"]["max_seq_len"] = max_seq_len
    fields = dict(vocab_size=VOCAB, d_model=D, n_layers=5, pattern=list(MIXER_OPTIONS), mixers=mixers)
    return ModelConfig(**{**fields, **overrides})


def model(cfg: ModelConfig) -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(cfg).double()


def tokens(batch: int, T: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, T), generator=torch.Generator().manual_seed(1))


def test_pattern_repeats_to_n_layers():
    lm = model(config())
    names = [type(block.mixer) for block in lm.blocks]
    assert names == [MIXERS[n] for n in ["attention", "sliding_window", "based", "base_conv", "attention"]]
    assert all(isinstance(block, Block) for block in lm.blocks)


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_forward_equals_step_loop(variant):
    lm = model(config(**VARIANTS[variant]))
    ids = tokens(2, 17)
    with torch.no_grad():
        full = lm(ids)
        state = lm.init_state(2)
        steps = torch.stack([lm.step(ids[:, t], state) for t in range(17)], dim=1)
    assert full.shape == (2, 17, VOCAB)
    torch.testing.assert_close(steps, full, rtol=1e-9, atol=1e-10)


def test_chunked_prefill_then_decode_equals_full_forward():
    lm = model(config(**VARIANTS["swiglu-rmsnorm-tied"]))
    ids = tokens(2, 30)
    with torch.no_grad():
        full = lm(ids)
        state = lm.init_state(2)
        parts = [lm(ids[:, :7], state), lm(ids[:, 7:25], state)]
        parts += [lm.step(ids[:, t], state)[:, None] for t in range(25, 30)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-9, atol=1e-10)


def test_logits_of_hidden_states_is_forward():
    lm = model(config())
    ids = tokens(2, 9)
    with torch.no_grad():
        h = lm.hidden_states(ids)
        assert h.shape == (2, 9, D)
        torch.testing.assert_close(lm.logits(h), lm(ids), rtol=0, atol=0)
        # Training projects only query positions: a gathered subset gives the same rows.
        torch.testing.assert_close(lm.logits(h[:, [2, 5]]), lm(ids)[:, [2, 5]], rtol=0, atol=0)


@pytest.mark.parametrize("T", [1, 12], ids=lambda T: f"T{T}")
def test_state_size_is_sum_of_layers_and_of_real_state(T):
    lm = model(config(max_seq_len=T))
    batch = 3
    state = lm.init_state(batch)
    with torch.no_grad():
        lm(tokens(batch, T), state)
    real = sum(t.numel() for layer in state for t in layer.values() if t.is_floating_point()) // batch
    assert lm.state_size(T) == real
    assert lm.state_size(T) == sum(block.mixer.state_size(T) for block in lm.blocks)


def test_init_state_follows_model_device_and_dtype():
    lm = model(config())
    state = lm.init_state(2)
    assert state[0]["k"].dtype == torch.float64 and state[3]["conv"].dtype == torch.float64
    state32 = lm.init_state(2, dtype=torch.float32)
    assert state32[0]["k"].dtype == torch.float32


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(pattern=["atention"], mixers={}), r"unknown mixer 'atention' \(known: attention, "),
        (dict(pattern=["based"], mixers={"based": {"feture_dim": 8}}), "mixer 'based' has no option 'feture_dim'"),
        (dict(pattern=["based"], mixers={"based": {"num_heads": 3}}), "divisible by num_heads=3"),
        (dict(pattern=["sliding_window"], mixers={"sliding_window": {"window": 0}}), "window must be >= 1"),
    ],
    ids=["unknown-mixer", "unknown-option", "impossible-heads", "impossible-window"],
)
def test_config_typos_raise_value_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        config(**overrides)


def test_tied_and_untied_heads():
    tied = LanguageModel(config(tie_embeddings=True))
    untied = LanguageModel(config(tie_embeddings=False))
    assert tied.head.weight is tied.embedding.weight
    assert untied.head.weight is not untied.embedding.weight
    assert untied.num_parameters() - tied.num_parameters() == VOCAB * D
    assert tied.num_parameters() == sum(p.numel() for p in set(tied.parameters()))


def test_init_is_normal_002_with_zero_biases():
    torch.manual_seed(0)
    lm = LanguageModel(config(vocab_size=2000, d_model=64, pattern=["base_conv"], mixers={}, n_layers=1))
    assert abs(lm.embedding.weight.std().item() - 0.02) < 0.001
    assert abs(lm.blocks[0].mixer.in_proj.weight.std().item() - 0.02) < 0.002
    assert torch.count_nonzero(lm.blocks[0].mixer.conv.bias) == 0


def test_gradients_reach_every_parameter():
    lm = model(config(**VARIANTS["swiglu-rmsnorm-tied"]))
    ids = tokens(2, 10)
    torch.nn.functional.cross_entropy(lm(ids).flatten(0, 1), ids.flatten()).backward()
    for name, param in lm.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_bad_inputs_raise_value_error():
    lm = model(config())
    with pytest.raises(ValueError, match=r"integer \[B, T\]"):
        lm(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"integer \[B\]"):
        lm.step(tokens(2, 1), lm.init_state(2))
    with pytest.raises(ValueError, match="one entry per layer"):
        lm(tokens(2, 3), lm.init_state(2)[:2])


def test_layernorm_equals_torch_layernorm():
    """zoo's LayerNorm (affine part as a multiply-add) computes nn.LayerNorm's values and gradients, fp64."""
    from zoo.models.block import LayerNorm

    torch.manual_seed(0)
    ref, ours = torch.nn.LayerNorm(24).double(), LayerNorm(24).double()
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 7, 24, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 7, 24, dtype=torch.float64)
    y_ref, y = ref(x), ours(x)
    torch.testing.assert_close(y, y_ref)
    for a, b in zip(torch.autograd.grad(y, (x, ours.weight, ours.bias), g),
                    torch.autograd.grad(y_ref, (x, ref.weight, ref.bias), g)):
        torch.testing.assert_close(a, b)
