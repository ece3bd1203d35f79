"""The package as a wheel: built from this tree, installed into a fresh venv outside the repo, its commands run
from a directory that is not the repo.

The venv has no pip and no dependencies of its own: a .pth file lets it see the installed dependencies of the
interpreter running the tests (their site-packages, without the editable zoo they may hold), and the wheel is
installed with `pip --python venv/bin/python install --no-deps --no-index`. So it builds and installs offline
in seconds, and zoo, cartridges and kernels come from the wheel alone.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    )
    return Path(out.stdout.strip())


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    if shutil.which("git") is None:
        pytest.skip("needs git")
    root = tmp_path_factory.mktemp("wheel")
    # Build from a clean copy of the tracked (and new, not ignored) files: no build/ or egg-info of the tree.
    src = root / "src"
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    dist = root / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(src)],
        check=True, capture_output=True, text=True,
    )
    (wheel,) = dist.glob("zoo-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    (_site_packages(python) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True, capture_output=True, text=True,
    )
    work = root / "work"  # outside the repo: nothing here but what the commands write
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ZOO_CONFIG_DIR", "CARTRIDGES_CONFIG_DIR")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["ZOO_CACHE_DIR"] = str(root / "cache")  # set here: module fixtures run before the autouse cache fixture
    env["HF_MODULES_CACHE"] = str(root / "hf-modules")
    return {"venv": venv, "work": work, "env": env, "wheel": wheel}


def run(wheel_venv, *cmd, timeout=300):
    return subprocess.run(
        [str(wheel_venv["venv"] / "bin" / cmd[0]), *cmd[1:]],
        cwd=wheel_venv["work"], env=wheel_venv["env"], capture_output=True, text=True, timeout=timeout,
    )


def test_zoo_comes_from_the_wheel(wheel_venv):
    out = run(wheel_venv, "python", "-c", "import zoo, cartridges, kernels; print(zoo.__file__, cartridges.__file__)")
    assert out.returncode == 0, out.stderr
    for path in out.stdout.split():
        assert Path(path).is_relative_to(wheel_venv["venv"]), path


def test_version(wheel_venv):
    import zoo

    out = run(wheel_venv, "zoo-train", "--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"zoo-train (zoo {zoo.__version__})"


def test_cfg_model_based(wheel_venv):
    out = run(wheel_venv, "zoo-train", "--cfg", "model=based")
    assert out.returncode == 0, out.stderr
    assert "feature_dim: 8" in out.stdout and "experiment_name: default" in out.stdout


def test_one_epoch_demo(wheel_venv):
    out = run(wheel_venv, "zoo-train", "+experiment=demo", "train.epochs=1", "train.progress=false")
    assert out.returncode == 0, out.stderr
    assert "valid/accuracy=" in out.stdout
    assert list((wheel_venv["work"] / "runs" / "demo").glob("*/summary.json"))


def test_embedded_corpus_ships(wheel_venv):
    code = "from zoo.lm_data import read_documents; print(len(read_documents('embedded')))"
    out = run(wheel_venv, "python", "-c", code)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == len(list((REPO / "zoo" / "data" / "corpus").glob("*.txt")))


def test_cartridges_presets_ship(wheel_venv):
    out = run(wheel_venv, "cartridges-distill", "--cfg", "data=x", "output=y", "corpus.path=z")
    assert out.returncode == 0, out.stderr
    assert "num_tokens:" in out.stdout


def test_serve_help(wheel_venv):
    out = run(wheel_venv, "cartridges-serve", "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: cartridges-serve") and "--cartridges" in out.stdout
