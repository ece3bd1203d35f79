import os

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
