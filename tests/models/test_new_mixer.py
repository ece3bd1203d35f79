"""docs/DESIGN.md's "Adding a mixer", followed with a toy mixer defined here: registered in `MIXERS` and nowhere
else, it trains from a command line's pattern and options, packs, and decodes inside the HF model."""

import math
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from zoo.models.hf import ZooConfig, ZooForCausalLM
from zoo.models.mixers import MIXERS
from zoo.models.mixers._common import check_input, check_step_input, make_config, module_device_dtype
from zoo.steps import pack_members
from zoo.train import load_config, train, train_runs


@dataclass
class EMAConfig:
    decay_init: float = 2.0

    def validate(self, d_model: int) -> None:
        if not math.isfinite(self.decay_init):
            raise ValueError(f"ema: decay_init must be finite, got {self.decay_init}")


class EMA(nn.Module):
    """h_t = a ⊙ h_{t-1} + (1 − a) ⊙ u_t, y_t = W_out(h_t ⊙ σ(g_t)), [u, g] = W_in x_t, a = σ(decay)."""

    Config = EMAConfig
    name = "ema"

    def __init__(self, d_model: int, **options) -> None:
        super().__init__()
        self.config = make_config(self.name, self.Config, d_model, options)
        self.d_model = d_model
        self.in_proj = nn.Linear(d_model, 2 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.decay = nn.Parameter(torch.full((d_model,), float(self.config.decay_init)))

    def forward(self, x, state=None):
        check_input(x, self.d_model, self.name)
        u, g = self.in_proj(x).chunk(2, dim=-1)
        a = torch.sigmoid(self.decay).to(x.dtype)
        h = torch.zeros_like(u[:, 0]) if state is None else state["h"].to(x.dtype)
        ys = []
        for t in range(x.shape[1]):
            h = a * h + (1 - a) * u[:, t]
            ys.append(h)
        if state is not None:
            state["h"].copy_(h)
        return self.out_proj(torch.stack(ys, 1) * torch.sigmoid(g))

    def step(self, x_t, state):
        check_step_input(x_t, self.d_model, self.name)
        return self.forward(x_t[:, None], state)[:, 0]

    def init_state(self, batch_size, device=None, dtype=None):
        device, dtype = module_device_dtype(self, device, dtype)
        return {"h": torch.zeros(batch_size, self.d_model, device=device, dtype=dtype)}

    def state_size(self, seq_len: int) -> int:
        return self.d_model


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(MIXERS, "ema", EMA)


SEG = "{seq_len:16,num_kv_pairs:2,num_examples:32,batch_size:32}"


@pytest.mark.parametrize("pack", [False, True], ids=["one-run", "lr-pack"])
def test_a_registered_mixer_trains_from_the_command_line(registered, tmp_path, pack):
    overrides = ["model.pattern=[short_conv,ema]", "model.mixers.ema.decay_init=1.0", "model.d_model=16",
                 "data.vocab_size=64", f"data.train=[{SEG}]", f"data.valid=[{SEG}]", f"data.test=[{SEG}]",
                 "train.epochs=1", "train.progress=false", f"runs_root={tmp_path}", f"data.cache_dir={tmp_path}/c"]
    if pack:
        overrides.append("train.pack_lrs=[1e-3,3e-3]")
    cfg, resolved = load_config(overrides)
    assert cfg.model.mixers == {"ema": {"decay_init": 1.0}}  # the default preset's Based options are dropped
    summaries = train_runs(pack_members(cfg)) if pack else [train(cfg, resolved)]
    assert len(summaries) == (2 if pack else 1)
    assert all(s["state_bytes_fp32"] == 4 * (16 * 2 + 16) for s in summaries)  # short_conv (k-1)·d + ema d


def test_a_registered_mixer_decodes_in_the_hf_model(registered):
    torch.manual_seed(0)
    model = ZooForCausalLM(ZooConfig(vocab_size=64, d_model=32, n_layers=2, pattern=["ema", "sliding_window"])).eval()
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    seq = ids
    with torch.no_grad():
        for _ in range(8):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)
