"""The commands as a user meets them: --help and --version without torch, one-line config errors that list
presets and suggest the closest name, the threads option."""

import importlib
import subprocess
import sys

import pytest

import zoo
from zoo.train import ConfigError, load_config

# (command, entry point "module:function"): pyproject's [project.scripts]
COMMANDS = {
    "zoo-train": "zoo.cli:train",
    "zoo-pretrain": "zoo.cli:pretrain",
    "zoo-sweep": "zoo.cli:sweep",
    "zoo-plot": "zoo.cli:plot",
    "cartridges-synthesize": "cartridges.cli:synthesize",
    "cartridges-distill": "cartridges.cli:distill",
    "cartridges-eval": "cartridges.cli:evaluate",
    "cartridges-serve": "cartridges.cli:serve",
}
# An option each command's help must show.
MAIN_OPTION = {
    "zoo-train": "train.resume=true",
    "zoo-pretrain": "train.steps=N",
    "zoo-sweep": "--workers",
    "zoo-plot": "--out",
    "cartridges-synthesize": "corpus.path=",
    "cartridges-distill": "num_tokens=",
    "cartridges-eval": "qa=",
    "cartridges-serve": "--cartridges",
}


def run_entry(command: str, *args: str) -> subprocess.CompletedProcess:
    """The entry point in a fresh interpreter; prints which heavy modules it imported on its last line."""
    module, func = COMMANDS[command].split(":")
    code = (
        f"import sys\nfrom {module} import {func}\ntry:\n    {func}({list(args)!r})\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"  # argparse exits 0 after its help
        "print('heavy:', sorted(m for m in ('torch', 'hydra', 'transformers') if m in sys.modules))"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_pyproject_scripts_match():
    from pathlib import Path

    import tomllib

    scripts = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"][
        "scripts"
    ]
    assert scripts == COMMANDS
    for target in scripts.values():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func))


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_names_the_command_without_torch(command):
    out = run_entry(command, "--help")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith(f"usage: {command}"), lines[0]
    assert MAIN_OPTION[command] in out.stdout
    assert lines[-1] == "heavy: []", lines[-1]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_version(command):
    out = run_entry(command, "--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == f"{command} (zoo {zoo.__version__})"


def test_serve_version():
    from cartridges.http import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0


def test_version_is_the_distribution_version():
    from pathlib import Path

    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "zoo.__version__"}
    assert zoo.__version__.count(".") == 2


def test_train_help_lists_presets(capsys):
    from zoo.cli import train

    train(["--help"])
    out = capsys.readouterr().out
    assert "model: " in out and "based_tiny" in out and "experiment: demo" in out


ERRORS = {
    "unknown-preset": (["model=basde"], ["model=basde: no such preset in model/", "known: ", "attention", "'based'?"]),
    "unknown-experiment": (["+experiment=dem"], ["experiment=dem", "known: demo", "did you mean 'demo'?"]),
    "no-close-preset": (["data=zzz"], ["known: mqar_tiny, mqar_zoology"]),
    "int-type": (["train.epochs=abc"], ["train.epochs=abc: Value 'abc' of type 'str' could not be converted"]),
    "float-type": (["optim.lr=fast"], ["optim.lr=fast:", "Float"]),
    "key-typo": (["train.epchs=3"], ["train.epchs: no such key in train; did you mean 'train.epochs'?"]),
    "key-without-section": (["epochs=3"], ["did you mean 'train.epochs'?"]),
    "threads": (["train.threads=-1"], ["train.threads must be >= 0"]),
    # `zoo-train data.train=[{seq_len: 64}]` unquoted: the shell splits the value at its space.
    "split-by-shell": (["optim.lr=1e-3", "data.train=[{seq_len:", "64}]"],
                       ["data.train=[{seq_len:: not a valid override", "quote a value that holds spaces"]),
    "bad-token": (["a b=1"], ["a b=1: not a valid override: token recognition error"]),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_config_error_is_one_plain_line(case):
    overrides, expected = ERRORS[case]
    with pytest.raises(ConfigError) as e:
        load_config(overrides)
    message = str(e.value)
    assert "\n" not in message and "$" not in message and "None" not in message, message
    for part in expected:
        assert part in message, message


def test_cli_error_exits_2_with_the_line(capsys):
    from zoo.cli import run_train

    with pytest.raises(SystemExit) as e:
        run_train(["model=basde"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zoo-train: error: model=basde:")


@pytest.mark.parametrize("threads", [0, 1, 2])
def test_set_threads(threads):
    import torch

    from zoo.device import available_cores, set_threads

    before = torch.get_num_threads()
    try:
        n = set_threads(threads)
        assert n == (threads or available_cores()) and torch.get_num_threads() == n
    finally:
        torch.set_num_threads(before)


def test_threads_is_run_control(tmp_path):
    """train.threads changes how fast a run goes, not what it computes: same run dir, same identity."""
    from zoo.train import run_name

    a, _ = load_config(["train.threads=1"])
    b, _ = load_config(["train.threads=2"])
    assert run_name(a) == run_name(b)


@pytest.mark.parametrize("threads", ["1", "0"])
def test_cartridges_threads_option(threads):
    import torch

    from cartridges.config import run_command
    from zoo.device import available_cores

    before = torch.get_num_threads()
    try:
        got = run_command("cartridges-distill", "distill", "usage", lambda cfg: torch.get_num_threads(),
                          ["--threads", threads, "data=x", "output=y", "corpus.path=z"])
    finally:
        torch.set_num_threads(before)
    assert got == (int(threads) or available_cores())


def test_cartridges_threads_needs_a_number(capsys):
    from cartridges.config import run_command

    with pytest.raises(SystemExit) as e:
        run_command("cartridges-distill", "distill", "usage", lambda cfg: None, ["--threads", "many"])
    assert e.value.code == 2 and "--threads needs a whole number" in capsys.readouterr().err


@pytest.mark.parametrize("override", ["runs_root=/tmp/elsewhere", "logger.backend=wandb"])
def test_run_name_ignores_where_a_run_goes(override):
    """A sweep under another runs root (or a moved runs folder) must still find and skip its finished runs."""
    from zoo.train import run_name

    a, _ = load_config([])
    b, _ = load_config([override])
    assert run_name(a) == run_name(b)


@pytest.mark.parametrize("override", ["optim.lr=0.5", "model.d_model=48", "train.epochs=3"])
def test_run_name_changes_with_what_a_run_computes(override):
    from zoo.train import run_name

    a, _ = load_config([])
    b, _ = load_config([override])
    assert run_name(a) != run_name(b)
