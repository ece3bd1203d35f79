"""Config composition: presets load, and a typo or an impossible value fails before any work, in one line."""

import subprocess
import sys

import pytest

from zoo.config import Config
from zoo.train import ConfigError, load_config


def test_default_composes_to_typed_config():
    cfg, resolved = load_config([])
    assert isinstance(cfg, Config)
    assert cfg.model.vocab_size == cfg.data.vocab_size  # interpolated in train.yaml
    assert "pattern" in resolved


@pytest.mark.parametrize("model", ["based", "attention", "sliding_window", "base_conv"])
def test_every_model_preset_composes(model):
    cfg, _ = load_config([f"model={model}", "data=mqar_zoology"])
    assert cfg.model.layers()


def test_overrides_reach_the_config():
    cfg, _ = load_config(["model=based", "data=mqar_tiny", "optim.lr=3e-3", "model.mixers.based.feature_dim=4"])
    assert cfg.optim.lr == 3e-3
    assert cfg.model.mixers["based"]["feature_dim"] == 4


MIXER_OPTION_CASES = {  # overrides -> model.pattern, model.mixers after composition
    "preset-options-off-the-new-pattern-are-dropped": (
        ["model=attention", "model.pattern=[short_conv,sliding_window]"], ["short_conv", "sliding_window"], {}),
    "an-option-for-a-mixer-the-preset-lacks": (
        ["model=attention", "model.pattern=[short_conv,attention]", "model.mixers.short_conv.kernel_size=4"],
        ["short_conv", "attention"], {"attention": {"num_heads": 1}, "short_conv": {"kernel_size": 4}}),
    "a-whole-entry-for-a-mixer-the-preset-lacks": (
        ["model=attention", "model.pattern=[short_conv]", "model.mixers.short_conv={kernel_size:2}"], ["short_conv"],
        {"short_conv": {"kernel_size": 2}}),
    "an-option-the-preset-has": (
        ["model=based", "model.mixers.based.feature_dim=4"], ["base_conv", "based"],
        {"based": {"feature_dim": 4, "num_heads": 1}}),
    "a-plus-override-is-kept": (
        ["model=attention", "model.pattern=[short_conv]", "+model.mixers.short_conv.kernel_size=5"], ["short_conv"],
        {"short_conv": {"kernel_size": 5}}),
}


@pytest.mark.parametrize("case", list(MIXER_OPTION_CASES))
def test_mixer_options_follow_the_pattern(case):
    """A pattern changed on the command line drops the preset's options for mixers it no longer uses, and
    `model.mixers.<mixer>.<option>=v` works whether or not the preset lists that mixer."""
    overrides, pattern, mixers = MIXER_OPTION_CASES[case]
    cfg, _ = load_config(overrides)
    assert cfg.model.pattern == pattern and cfg.model.mixers == mixers


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["optim.lrr=3e-3"], "lrr"),
        (["model=basedd"], "basedd"),
        (["model.pattern=[based,attentoin]"], "attentoin"),
        (["model.mixers.based.feature_dm=8"], "feature_dm"),
        (["optim.lr=-1"], "optim.lr"),
        (["data.vocab_size=32"], "vocab"),
        (["train.precision=fp8"], "precision"),
        (["train.epochs=0"], "epochs"),
        (["optim.lr=abc"], "lr"),
        (["model.mixers.basde.feature_dim=4"], r"options for \['basde'\].*~model.mixers.basde"),
        (["model.pattern=[attention]", "model.mixers.based.feature_dim=4"], r"options for \['based'\]"),
    ],
    ids=["unknown-key", "unknown-preset", "unknown-mixer", "unknown-mixer-option", "negative-lr", "vocab-le-seq-len",
         "bad-precision", "zero-epochs", "lr-not-a-number", "options-for-a-misspelt-mixer",
         "options-given-for-a-mixer-off-the-pattern"],
)
def test_bad_config_fails_with_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as info:
        load_config(overrides)
    assert "\n" not in str(info.value)


def test_cli_prints_one_line_error_and_exits_2(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "zoo.cli", "zoo-train", "optim.lrr=3e-3", f"runs_root={tmp_path}"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("zoo-train: error:") and "lrr" in lines[0], out.stderr
    assert not list(tmp_path.iterdir())  # no work started, nothing written


def test_experiment_preset_and_experiment_name_do_not_collide():
    cfg, _ = load_config(["+experiment=demo", "experiment_name=mine"])
    assert cfg.experiment_name == "mine" and cfg.optim.lr == 3e-3


def test_zoo_and_cartridges_configs_compose_in_one_process(tmp_path):
    """A zoo config composed first must not turn a cartridges field (`model`) into a Hydra group."""
    from cartridges.config import load_config as load_cartridge_config

    load_config(["model=based"])
    doc = tmp_path / "doc.md"
    doc.write_text("text")
    cfg, _ = load_cartridge_config("synthesize", ["model=tiny-llama", f"corpus.path={doc}", f"output={tmp_path}"])
    assert cfg.model == "tiny-llama"
