"""A saved Zoo checkpoint loads through `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` in a
process that never imports zoo itself (the checkpoint's modeling_zoo.py does), and gives the same logits."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zoo.models.hf import AUTO_MAP, REMOTE_MODULE, ZooConfig, ZooForCausalLM

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("zoo-hf")
    torch.manual_seed(0)
    model = ZooForCausalLM(ZooConfig(vocab_size=64, d_model=32)).eval()
    model.save_pretrained(path)
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        torch.save(model(ids).logits, path / "expected.pt")
    return path


def fresh_python(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_MODULES_CACHE": str(tmp_path / "modules")}
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)


def test_checkpoint_carries_auto_map_and_code(checkpoint):
    assert json.loads((checkpoint / "config.json").read_text())["auto_map"] == AUTO_MAP
    code = (checkpoint / f"{REMOTE_MODULE}.py").read_text()
    assert "from zoo.models.hf import ZooConfig, ZooForCausalLM" in code


def test_loads_with_trust_remote_code_without_import_zoo(checkpoint, tmp_path):
    code = f"""
import sys, torch
from transformers import AutoModelForCausalLM
assert "zoo" not in sys.modules
model = AutoModelForCausalLM.from_pretrained({str(checkpoint)!r}, trust_remote_code=True).eval()
assert type(model).__name__ == "ZooForCausalLM", type(model)
with torch.no_grad():
    logits = model(torch.tensor([[1, 5, 9, 2, 7]])).logits
torch.testing.assert_close(logits, torch.load({str(checkpoint / "expected.pt")!r}))
print("REMOTE-OK")
"""
    out = fresh_python(code, tmp_path)
    assert out.returncode == 0 and "REMOTE-OK" in out.stdout, out.stderr[-3000:]


def test_without_trust_remote_code_the_error_says_so(checkpoint, tmp_path):
    code = f"""
from transformers import AutoModelForCausalLM
try:
    AutoModelForCausalLM.from_pretrained({str(checkpoint)!r})
except ValueError as e:
    print("ERROR:", e)
"""
    out = fresh_python(code, tmp_path)
    assert "trust_remote_code=True" in out.stdout, out.stdout + out.stderr[-2000:]
