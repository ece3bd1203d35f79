"""The paper presets (zoo/configs/model/zoology_fig2/*, zoo/configs/model/based_fig2/*) build the models the Zoology and
Based Fig. 2 configs describe: layer kinds in order, L-long filters, parameter counts against counts by hand,
and state_size against the real decode state and REFERENCE §1's formulas."""

import math

import pytest
import torch

from kernels.based.naive import feature_dim
from zoo.models.lm import LanguageModel
from zoo.train import load_config

L, V = 32, 64  # the panel's sequence length (what the Zoology presets read from data.train[0]) and vocabulary


def preset(name: str, d: int, *overrides: str):
    seg = f"{{seq_len: {L}, num_kv_pairs: 2, num_examples: 8, batch_size: 8}}"
    cfg, _ = load_config(
        [f"model={name}", f"model.d_model={d}", f"data.vocab_size={V}", *(f"data.{s}=[{seg}]" for s in
         ("train", "valid", "test")), *overrides]
    )
    torch.manual_seed(0)
    return cfg.model, LanguageModel(cfg.model)


def norm(d: int) -> int:
    return 2 * d  # LayerNorm: weight and bias


def zoology_block(d: int) -> int:
    """A TransformerBlock with state_mixer=Identity: the mixer's norm and the identity MLP's norm."""
    return 2 * norm(d)


def attention_params(d: int) -> int:
    return 4 * d * d + 4 * d  # qkv and out, with biases


def short_conv_params(d: int, k: int = 3) -> int:
    return d * d + d + d * k + d  # projection (bias), depthwise conv (bias)


def long_conv_params(d: int, hidden: int = 16, bands: int = 1) -> int:
    return d * d + d + (1 + 2 * bands) * hidden + hidden + hidden * d + d  # projection, filter MLP


def based_params(d: int, f: int) -> int:
    return 2 * d * f + 2 * d * d  # q, k: d -> f; v, out: d -> d (1 head, no biases)


def hyena_params(d: int, zoology_positions_L: int = 0) -> int:
    # in-proj 3d (bias), short conv 3d x 3 (bias), filter MLP 1 -> 64 -> 64 -> 64 -> d (no last bias) with 64
    # shared sine frequencies, bias d, out-proj (bias); Zoology's positions: a learned [L, 3] table and 3 inputs
    positions = 3 * zoology_positions_L + 2 * 64 if zoology_positions_L else 0
    return 3 * d * d + 3 * d + 9 * d + 3 * d + (64 + 64) + 2 * (64 * 64 + 64) + 64 + 64 * d + d + d * d + d + positions


def h3_params(d: int, N: int, shift: int) -> int:
    H = d // 2  # heads of width 2
    return 3 * d * d + 3 * d + d * shift + H * (2 + 3 * N) + d * d + d  # qkv, shift, (log_dt, D, log_A, B, C), out


def rwkv4_params(d: int) -> int:
    return 4 * d * d + 5 * d  # key, value, receptance, output; decay, bonus, three token-shift mixes


def mamba_params(d: int, N: int) -> int:
    E, R, k = 2 * d, math.ceil(d / 16), 4
    return d * 2 * E + E * k + E + E * (R + 2 * N) + R * E + E + E * N + E + E * d


def zoology_lm(d: int, mixers: list[int], positions: int = 0) -> int:
    return V * d + positions * d + sum(mixers) + 2 * zoology_block(d) + norm(d)


def mamba_lm(d: int, N: int, final_layernorm: bool = False) -> int:
    """RMSNorm blocks (weight only); the final norm RMSNorm too, or a LayerNorm (weight and bias) as Zoology's."""
    return V * d + 2 * (mamba_params(d, N) + d) + (2 * d if final_layernorm else d)


ZOOLOGY = {
    # name: (layer kinds, parameters by hand, state elements per sequence by REFERENCE §1's formulas, at d)
    "attention": (["attention", "attention"], lambda d: zoology_lm(d, [attention_params(d)] * 2, positions=L),
                  lambda d: 2 * (2 * L * d)),
    "base_conv": (["short_conv", "long_conv"], lambda d: zoology_lm(d, [short_conv_params(d), long_conv_params(d)]),
                  lambda d: d * 2 + d * L),
    "hyena": (["hyena", "hyena"], lambda d: zoology_lm(d, [hyena_params(d)] * 2),
              lambda d: 2 * (d * L + 3 * d * 2)),
    "h3": (["h3", "h3"], lambda d: zoology_lm(d, [h3_params(d, L, L)] * 2),
           lambda d: 2 * (2 * d * L + d * (L - 1))),
    "rwkv": (["rwkv4", "rwkv4"], lambda d: zoology_lm(d, [rwkv4_params(d)] * 2), lambda d: 2 * 4 * d),
    "based": (["short_conv", "based"], lambda d: zoology_lm(d, [short_conv_params(d), based_params(d, 8)]),
              lambda d: d * 2 + (feature_dim(8) * d + feature_dim(8))),
    "mamba": (["mamba", "mamba"], lambda d: mamba_lm(d, 16), lambda d: 2 * (2 * d * 16 + 2 * d * 3)),
}


@pytest.mark.parametrize("d", [16, 64], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("name", sorted(ZOOLOGY))
def test_zoology_fig2_preset(name, d):
    layers, params, state = ZOOLOGY[name]
    cfg, lm = preset(f"zoology_fig2/{name}", d)
    assert cfg.layers() == layers
    assert cfg.n_layers == 2 and cfg.mlp == ("none" if name == "mamba" else "identity")
    assert cfg.embed_dropout == (0.0 if name == "mamba" else 0.1)
    assert cfg.max_position_embeddings == (L if name == "attention" else 0)
    assert lm.num_parameters() == params(d)
    assert_state_is_real(lm)
    assert lm.state_size(L) == state(d)


def assert_state_is_real(lm: LanguageModel, T: int = L) -> None:
    """state_size(T) equals the floating elements per sequence of the decode state after a T-token prefill."""
    batch = 2
    state = lm.init_state(batch)
    with torch.no_grad():
        lm.eval()
        lm(torch.randint(0, V, (batch, T)), state)
    floating = [t for layer in state if layer is not None for t in layer.values() if t.is_floating_point()]
    assert sum(t.numel() for t in floating) // batch == lm.state_size(T)


def test_zoology_base_conv_long_filter_spans_L():
    """Layer 1's filter has L taps, and the last position hears the first token through it; two k=3 short convs
    would reach 4 tokens back."""
    _, lm = preset("zoology_fig2/base_conv", 16)
    long_conv = lm.blocks[1].mixer
    assert long_conv.filter.features.shape[0] == L and long_conv.filter(L).shape == (L, 16)
    with torch.no_grad():
        for p in long_conv.filter.parameters():
            p.normal_(generator=torch.Generator().manual_seed(0))
    x = torch.randn(1, L, 16, requires_grad=True)
    (grad,) = torch.autograd.grad(long_conv(x)[:, L - 1].sum(), x)
    assert grad[:, 0].abs().sum() > 0
    assert lm.blocks[0].mixer.kernel_size == 3


def test_zoology_attention_positions_and_dropout():
    """Absolute positions up to L in the embeddings, none inside attention; dropout acts only while training."""
    cfg, lm = preset("zoology_fig2/attention", 16)
    assert lm.position.weight.shape == (L, 16)
    mixer = lm.blocks[0].mixer
    assert mixer.config.positional == "none" and mixer.num_heads == 1 and mixer.config.dropout == 0.1
    ids = torch.randint(0, V, (2, L))
    lm.eval()
    with torch.no_grad():
        logits = lm(ids)
        assert torch.equal(lm(ids), logits)
        lm.position.weight.zero_()
        assert not torch.allclose(lm(ids), logits)  # the table enters the forward
    lm.train()
    with torch.no_grad():
        assert not torch.equal(lm(ids), lm(ids))
    with pytest.raises(ValueError, match=f"exceeds model.max_position_embeddings={L}"):
        lm(torch.randint(0, V, (1, L + 1)))


def test_positional_lm_decodes_like_its_forward():
    _, lm = preset("zoology_fig2/attention", 16)
    lm = lm.double().eval()
    ids = torch.randint(0, V, (2, L))
    with torch.no_grad():
        full = lm(ids)
        state = lm.init_state(2)
        prefill = lm(ids[:, :10], state)
        steps = torch.stack([lm.step(ids[:, t], state) for t in range(10, L)], dim=1)
    torch.testing.assert_close(torch.cat([prefill, steps], dim=1), full, rtol=1e-9, atol=1e-10)


BASED_FIG2 = {
    # name: (layer kinds, extra overrides, parameters by hand or None, state per sequence by formula at L)
    "attention": (["short_conv", "attention"], [],
                  lambda d: zoology_lm(d, [short_conv_params(d), attention_params(d)]), lambda d: 2 * d + 2 * L * d),
    "based": (["short_conv", "based"], ["model.mixers.based.feature_dim=24"],
              lambda d: zoology_lm(d, [short_conv_params(d), based_params(d, 24)]),
              lambda d: 2 * d + feature_dim(24) * (d + 1)),
    "sliding_window": (["short_conv", "sliding_window"], ["model.mixers.sliding_window.window=8"],
                       lambda d: zoology_lm(d, [short_conv_params(d), 4 * d * d + 4 * d]),  # qkv, out + biases
                       lambda d: 2 * d + 2 * 8 * d),
    "mamba": (["mamba", "mamba"], ["model.mixers.mamba.d_state=8"], lambda d: mamba_lm(d, 8, final_layernorm=True),
              lambda d: 2 * (2 * d * 8 + 2 * d * 3)),
    "mamba2": (["mamba2", "mamba2"], ["model.mixers.mamba2.d_state=8", "model.mixers.mamba2.head_dim=16"], None, None),
    "hyena": (["hyena", "hyena"], [], lambda d: zoology_lm(d, [hyena_params(d, zoology_positions_L=1024)] * 2),
              lambda d: 2 * (d * 1024 + 3 * d * 2)),
    "h3": (["h3", "h3"], ["model.mixers.h3.d_state=4", "model.mixers.h3.shift_size=4"],
           # ssm=zoology: the same count + the shift's skip (d) and its B (d·shift_size)
           lambda d: zoology_lm(d, [h3_params(d, 4, 4) + d + d * 4] * 2),
           lambda d: 2 * (2 * d * 4 + d * 3)),
    "gla": (["short_conv", "gla"], [], None, None),
    "gated_deltanet": (["short_conv", "gated_deltanet"], [], None, None),
}


@pytest.mark.parametrize("name", sorted(BASED_FIG2))
def test_based_fig2_preset(name):
    layers, overrides, params, state = BASED_FIG2[name]
    d = 16
    cfg, lm = preset(f"based_fig2/{name}", d, *overrides)
    assert cfg.layers() == layers and cfg.n_layers == 2 and cfg.max_position_embeddings == 0
    if layers[0] == "short_conv":
        assert lm.blocks[0].mixer.kernel_size == 3
    if params is not None:
        assert lm.num_parameters() == params(d)
    # attention's and Hyena's buffers hold the longest test length, 1024 tokens: fill them
    assert_state_is_real(lm, T=1024 if name in ("attention", "hyena") else L)
    if state is not None:
        assert lm.state_size(L) == state(d)


def test_identity_mlp_block_ends_with_x_plus_its_norm():
    """Zoology's TransformerBlock with state_mixer=Identity: r = x + mixer(norm1(x)), out = r + norm2(r)."""
    from zoo.models.block import Block
    from zoo.models.mixers import MIXERS

    torch.manual_seed(0)
    block = Block(8, MIXERS["short_conv"](8), mlp="identity").double()
    with torch.no_grad():
        block.mlp_norm.weight.normal_()
        block.mlp_norm.bias.normal_()
        x = torch.randn(2, 5, 8, dtype=torch.float64)
        r = x + block.mixer(block.mixer_norm(x))
        torch.testing.assert_close(block(x), r + block.mlp_norm(r), rtol=1e-12, atol=1e-12)
        state = block.init_state(2)
        steps = torch.stack([block.step(x[:, t], state) for t in range(5)], dim=1)
        torch.testing.assert_close(steps, block(x), rtol=1e-12, atol=1e-12)


def test_hf_config_refuses_position_tables_and_keeps_dropout():
    from zoo.models.hf import ZooConfig

    cfg, _ = preset("zoology_fig2/attention", 16)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ZooConfig.from_model_config(cfg)
    cfg, _ = preset("zoology_fig2/based", 16)
    assert ZooConfig.from_model_config(cfg).model_config() == cfg


@pytest.mark.parametrize(("name", "eps"), [("based_fig2/mamba", 1e-5), ("based_fig2/mamba2", 1e-5),
                                           ("zoology_fig2/mamba", None)])
def test_mamba_block_norms_take_the_presets_rms_eps(name, eps):
    """Zoology's Mamba and Mamba-2 blocks normalise with RMSNorm at eps 1e-5, which the frontier's presets set;
    Zoology Fig. 2's preset keeps torch's default, as its runs trained (its header says so). The eps survives the
    transformers config."""
    from zoo.models.hf import ZooConfig

    cfg, model = preset(name, 64)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert norms and all(m.eps == eps for m in norms)
    assert ZooConfig.from_model_config(cfg).model_config().rms_eps == eps


def test_rms_eps_must_be_positive():
    with pytest.raises(ValueError, match="model.rms_eps must be > 0 or null, got 0.0"):
        preset("based_fig2/mamba", 16, "model.rms_eps=0.0")
