"""The paper presets at Fig. 2 shapes: the bf16-autocast forward (how training runs them) agrees with the fp32
forward, and every gradient is finite. On the GPU when there is one (batch 32), else on the CPU (batch 2)."""

import glob
from pathlib import Path

import pytest
import torch

from zoo.models.lm import LanguageModel
from zoo.train import load_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

REPO = Path(__file__).resolve().parents[2]
PRESETS = sorted(
    p[len(str(REPO / "zoo/configs/model")) + 1 : -5] for p in glob.glob(str(REPO / "zoo/configs/model/*_fig2/*.yaml"))
)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_bf16_forward_matches_fp32(name):
    L, d, batch = 256, 128, 32 if DEVICE == "cuda" else 2
    seg = f"{{seq_len: {L}, num_kv_pairs: 16, num_examples: 8, batch_size: 8}}"
    splits = [f"data.{s}=[{seg}]" for s in ("train", "valid", "test")]
    cfg, _ = load_config([f"model={name}", "data=mqar_zoology", f"model.d_model={d}", *splits])
    torch.manual_seed(0)
    lm = LanguageModel(cfg.model).to(DEVICE).eval()
    ids = torch.randint(0, cfg.model.vocab_size, (batch, L), device=DEVICE)
    with torch.no_grad():
        ref = lm.hidden_states(ids).float()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            got = lm.hidden_states(ids).float()
    err = float((got - ref).norm() / ref.norm())
    assert err < 3e-2, err
    lm.train()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss = lm(ids).float().logsumexp(-1).mean()
    loss.backward()
    for pname, p in lm.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
