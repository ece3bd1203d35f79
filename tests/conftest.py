import importlib.util
import os
from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Synthetic-data caches of tests go to a per-session temp dir, never the user's ~/.cache."""
    if "ZOO_CACHE_DIR" not in os.environ:
        monkeypatch.setenv("ZOO_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "zoo-cache"))


@pytest.fixture(scope="session")
def demo_runs(tmp_path_factory):
    """The README's demo (zoo.demo.run), trained once per session: (rows, runs root). tests/test_readme.py
    compares its table with the README's, tests/test_train.py checks that each model passes 90%, and
    tests/test_resume.py compares a killed and resumed run with it."""
    from zoo import demo

    root = tmp_path_factory.mktemp("demo-runs")
    cache = os.environ.get("ZOO_CACHE_DIR") or str(tmp_path_factory.getbasetemp() / "zoo-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZOO_CACHE_DIR", cache)
        before = torch.get_num_threads()
        try:
            rows = demo.run([f"runs_root={root}", "train.progress=false"])
        finally:
            torch.set_num_threads(before)
    return rows, root


@pytest.fixture(scope="session")
def sweep_speed_bench():
    """experiments/bench/sweep_speed.py as a module (it is a script, not part of the package)."""
    path = Path(__file__).resolve().parents[1] / "experiments" / "bench" / "sweep_speed.py"
    spec = importlib.util.spec_from_file_location("sweep_speed_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
