"""Packed runs (zoo/steps.py) over the Triton kernels whose custom ops have vmap rules, on the CPU through the
interpreter: a pack of 2 lrs of a 2-layer LM equals the plain model, member by member, on loss and gradient, and
check_pack accepts it. tests/kernels/conftest.py runs these items under TRITON_INTERPRET=1."""

import pytest
import torch

from zoo.config import ModelConfig
from zoo.eval import query_loss
from zoo.models import LanguageModel
from zoo.steps import PackedParams, check_pack, pack_members
from zoo.train import load_config

# mixer -> the preset that selects it (its impl is overridden to triton)
PRESETS = {"mamba": "mamba", "rwkv4": "zoology_fig2/rwkv"}


@pytest.mark.parametrize("mixer", sorted(PRESETS))
def test_packed_lm_on_the_triton_kernel_equals_the_plain_one(mixer):
    torch.manual_seed(0)
    cfg, _ = load_config([f"model={PRESETS[mixer]}", f"+model.mixers.{mixer}.impl=triton", "model.d_model=16"])
    check_pack(pack_members(cfg, [1e-3, 2e-3]))
    model = LanguageModel(ModelConfig(vocab_size=64, d_model=16, n_layers=2, pattern=[mixer],
                                      mixers={mixer: {"impl": "triton"}}))
    pack = PackedParams(model, [1e-3, 2e-3], cfg.optim, total_steps=1)
    inputs, labels = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 3))
    query_pos = torch.randint(0, 16, (4, 3))
    pack.losses(inputs, query_pos, labels).sum().backward()
    loss = query_loss(model, inputs, query_pos, labels)
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1) for _, p in model.named_parameters()])
    losses = pack.losses(inputs, query_pos, labels).detach()
    for member in range(2):
        torch.testing.assert_close(losses[member], loss.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pack.flat.grad[member], grad, rtol=1e-4, atol=1e-6)
