"""Packed runs (zoo/steps.py) over the Triton kernels whose custom ops have vmap rules, on the CPU through the
interpreter: a pack of 2 lrs of a 2-layer LM equals the plain model, member by member, on loss and gradient, and
check_pack accepts it; a pack of members that start apart (seeds) equals each member's own model, so the vmap rule
keeps every member's sequences with that member. tests/kernels/conftest.py runs these items under TRITON_INTERPRET=1."""

import pytest
import torch

from zoo.config import ModelConfig
from zoo.eval import query_loss
from zoo.models import LanguageModel
from zoo.steps import PackedParams, check_pack, pack_members
from zoo.train import load_config

# mixer -> the preset that selects it (its impl is overridden to triton)
PRESETS = {"based": "zoology_fig2/based", "mamba": "mamba", "rwkv4": "zoology_fig2/rwkv"}


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


def _lm(mixer: str, seed: int) -> LanguageModel:
    torch.manual_seed(seed)
    return LanguageModel(ModelConfig(vocab_size=64, d_model=16, n_layers=2, pattern=[mixer],
                                     mixers={mixer: {"impl": "triton"}}))


@pytest.mark.parametrize("mixer", sorted(PRESETS))
def test_packed_members_that_differ_each_equal_their_own_model(mixer):
    cfg, _ = load_config([f"model={PRESETS[mixer]}", "model.d_model=16"])
    models = [_lm(mixer, seed) for seed in (1, 2)]
    pack = PackedParams(models[0], [1e-3, 2e-3], cfg.optim, total_steps=1, init=models)
    torch.manual_seed(3)
    inputs, labels = torch.randint(0, 64, (2, 4, 16)), torch.randint(0, 64, (2, 4, 3))  # a batch per member
    query_pos = torch.randint(0, 16, (2, 4, 3))
    losses = pack.losses(inputs, query_pos, labels)
    losses.sum().backward()
    for member, model in enumerate(models):
        loss = query_loss(model, inputs[member], query_pos[member], labels[member])
        loss.backward()
        grad = torch.cat([p.grad.reshape(-1) for _, p in model.named_parameters()])
        torch.testing.assert_close(losses[member].detach(), loss.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pack.flat.grad[member], grad, rtol=1e-4, atol=1e-6)


def test_a_compiled_pack_on_based_s_kernel_equals_the_eager_pack():
    """Sweeps train packs compiled (train.compile=true): torch.compile traces the vmapped custom op through its vmap
    rule and fake impl. Based only: the interpreted compile of the other two takes 30-60 s here."""
    cfg, _ = load_config(["model=zoology_fig2/based", "model.d_model=16"])
    model = _lm("based", 0)
    eager = PackedParams(model, [1e-3, 2e-3], cfg.optim, total_steps=1)
    compiled = PackedParams(model, [1e-3, 2e-3], cfg.optim, total_steps=1, compile_mode="default")
    torch.manual_seed(3)
    inputs, labels = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 3))
    query_pos = torch.randint(0, 16, (4, 3))
    losses = [pack.losses(inputs, query_pos, labels) for pack in (eager, compiled)]
    for loss in losses:
        loss.sum().backward()
    torch.testing.assert_close(losses[1].detach(), losses[0].detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled.flat.grad, eager.flat.grad, rtol=1e-4, atol=1e-6)
