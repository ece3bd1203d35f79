"""Mamba keeps its own initialisation inside a LanguageModel, whose generic init (normal 0.02 linears, zero biases)
runs after the mixers are built: Δ = softplus(dt_bias) log-uniform over [dt_min, dt_max], the Δ projection's
weight U(±dt_rank^-0.5), A = -(1..N) per channel, D = 1. A zeroed dt bias gives Δ = softplus(0) = 0.69 in every
channel: the state then halves (or faster) every token and cannot hold a key for the dozens of tokens MQAR needs."""

import math

import pytest
import torch
import torch.nn.functional as F

from zoo.models.lm import LanguageModel
from zoo.models.mixers.mamba import Mamba
from zoo.train import load_config

PRESETS = ["zoology_fig2/mamba", "based_fig2/mamba", "mamba", "conv_mamba"]


def lm_from_preset(name: str, d: int = 64) -> LanguageModel:
    seg = "{seq_len: 64, num_kv_pairs: 4, num_examples: 8, batch_size: 8}"
    cfg, _ = load_config(
        [f"model={name}", f"model.d_model={d}", "data.vocab_size=256", *(f"data.{s}=[{seg}]" for s in
         ("train", "valid", "test"))]
    )
    torch.manual_seed(0)
    return LanguageModel(cfg.model)


def mamba_layers(lm: LanguageModel) -> list[Mamba]:
    layers = [block.mixer for block in lm.blocks if isinstance(block.mixer, Mamba)]
    assert layers, "the preset has no mamba layer"
    return layers


@pytest.mark.parametrize("name", PRESETS)
def test_dt_spans_dt_min_to_dt_max_log_uniformly(name):
    for mixer in mamba_layers(lm_from_preset(name)):
        c = mixer.config
        dt = F.softplus(mixer.dt_bias.detach().double())
        assert dt.min() >= c.dt_min * (1 - 1e-5) and dt.max() <= c.dt_max * (1 + 1e-5)
        # log-uniform: log Δ has the mean and spread of U(log dt_min, log dt_max) (d_inner = 128 draws)
        lo, hi = math.log(c.dt_min), math.log(c.dt_max)
        assert abs(dt.log().mean().item() - (lo + hi) / 2) < 0.15 * (hi - lo)
        assert abs(dt.log().std().item() - (hi - lo) / math.sqrt(12)) < 0.2 * (hi - lo) / math.sqrt(12)


@pytest.mark.parametrize("name", PRESETS)
def test_dt_weight_is_uniform_over_dt_rank_to_the_minus_half(name):
    for mixer in mamba_layers(lm_from_preset(name)):
        bound = mixer.dt_rank**-0.5
        w = mixer.dt_weight.detach()
        assert w.shape == (mixer.d_inner, mixer.dt_rank)
        assert w.abs().max() <= bound
        assert abs(w.std().item() - bound / math.sqrt(3)) < 0.15 * bound / math.sqrt(3)


@pytest.mark.parametrize("name", PRESETS)
def test_A_and_D_keep_the_s4d_real_init(name):
    for mixer in mamba_layers(lm_from_preset(name)):
        N = mixer.config.d_state
        expected = torch.arange(1, N + 1, dtype=torch.float32).expand(mixer.d_inner, N)
        torch.testing.assert_close(torch.exp(mixer.A_log.detach()), expected)
        torch.testing.assert_close(mixer.D.detach(), torch.ones(mixer.d_inner))


def test_state_remembers_a_token_for_dozens_of_steps_at_init():
    """With the dt bias alone (the input's part of Δ set aside), the slowest state entry (A = -1, the smallest Δ)
    keeps most of a token after 60 steps; with Δ = 0.69 everywhere it would keep 2^-60 of it."""
    mixer = mamba_layers(lm_from_preset("zoology_fig2/mamba"))[0]
    dt_min = F.softplus(mixer.dt_bias.detach()).min()
    assert torch.exp(-dt_min * 60) > 0.5


MAMBA2_PRESETS = ["based_fig2/mamba2"]


def mamba_family_layers(lm: LanguageModel) -> list:
    from zoo.models.mixers.mamba2 import Mamba2

    layers = [block.mixer for block in lm.blocks if isinstance(block.mixer, (Mamba, Mamba2))]
    assert layers, "the preset has no Mamba or Mamba-2 layer"
    return layers


def assert_uniform(w: torch.Tensor, bound: float, what: str) -> None:
    """U(±bound): inside the bound, with U's spread (normal(0, 0.02) fails this for every shape here)."""
    w = w.detach().double()
    assert w.abs().max() <= bound * (1 + 1e-6), what
    assert abs(w.std().item() - bound / math.sqrt(3)) < 0.1 * bound / math.sqrt(3), what


@pytest.mark.parametrize("name", PRESETS + MAMBA2_PRESETS)
def test_projections_and_conv_take_zoologys_mamba_block_init(name):
    """Zoology's Mamba blocks keep PyTorch's init for the linears (U(±1/√fan_in)) and the depthwise conv (U(±1/√k),
    bias too), out_proj further divided by √n_layers."""
    lm = lm_from_preset(name)
    n_layers = len(lm.blocks)
    for mixer in mamba_family_layers(lm):
        projections = [mixer.in_proj] + ([mixer.x_proj] if isinstance(mixer, Mamba) else [])
        for linear in projections:
            assert_uniform(linear.weight, linear.in_features**-0.5, "in/x projection")
        out = mixer.out_proj
        assert_uniform(out.weight, out.in_features**-0.5 / math.sqrt(n_layers), "out_proj")
        k = mixer.config.conv_size
        assert_uniform(mixer.conv_weight, k**-0.5, "conv weight")
        assert mixer.conv_bias.detach().abs().max() <= k**-0.5 and mixer.conv_bias.detach().std() > 0.1 * k**-0.5
