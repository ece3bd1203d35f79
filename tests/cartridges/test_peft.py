"""PEFT interoperability with the real peft package: a Cartridge and a PEFT CARTRIDGE adapter give the same
logits both ways, and cartridges-distill starts from and saves PEFT adapters."""

import os
from pathlib import Path

import pytest
import torch

from cartridges.cache import Cartridge, CartridgeError, CartridgeFileError, cache_kwargs
from zoo.pretrained import tiny_llama

peft = pytest.importorskip("peft")


def cartridge_logits(model, cartridge, ids):
    """Logits [B, T, V] of `ids` read after the cartridge through our own cache path."""
    p, (b, t) = cartridge.num_tokens, ids.shape
    pos = torch.arange(p, p + t)[None].expand(b, -1)
    cache = cartridge.as_cache(b, dtype=model.dtype, config=model.config)
    return model(input_ids=ids, position_ids=pos, **cache_kwargs(model, cache)).logits


@pytest.fixture
def case():
    model = tiny_llama(seed=0)
    cartridge = Cartridge.random(model, num_tokens=7, num_frozen=1, seed=3)
    ids = torch.randint(3, 250, (2, 11), generator=torch.Generator().manual_seed(0))
    return model, cartridge, ids


@pytest.mark.parametrize("num_frozen", [0, 1, 3])
def test_to_peft_gives_the_cartridge_logits(case, num_frozen):
    model, _, ids = case
    cartridge = Cartridge.random(model, num_tokens=7, num_frozen=num_frozen, seed=4)
    expected = cartridge_logits(model, cartridge, ids)
    peft_model = cartridge.to_peft(model)
    assert isinstance(peft_model, peft.PeftModel)
    assert peft_model.peft_config["default"].num_frozen_tokens == num_frozen
    torch.testing.assert_close(peft_model(input_ids=ids).logits, expected, rtol=0, atol=0)
    mask = torch.ones_like(ids)
    torch.testing.assert_close(peft_model(input_ids=ids, attention_mask=mask).logits, expected, rtol=0, atol=0)


def test_from_peft_round_trip_is_exact(case):
    model, cartridge, ids = case
    back = Cartridge.from_peft(cartridge.to_peft(model))
    assert back.num_tokens == cartridge.num_tokens and back.num_frozen == cartridge.num_frozen
    assert back.keys().equal(cartridge.keys()) and back.values().equal(cartridge.values())
    torch.testing.assert_close(cartridge_logits(model, back, ids), cartridge_logits(model, cartridge, ids))


def test_a_peft_trained_adapter_converts_to_a_cartridge(case):
    """The other way round: an adapter PEFT itself initialised (random, its own layout) -> Cartridge -> same logits."""
    model, _, ids = case
    config = peft.CartridgeConfig(task_type="CAUSAL_LM", num_virtual_tokens=5, num_frozen_tokens=1)
    torch.manual_seed(1)
    peft_model = peft.get_peft_model(model, config)
    expected = peft_model(input_ids=ids).logits
    cartridge = Cartridge.from_peft(peft_model)
    torch.testing.assert_close(cartridge_logits(peft_model.get_base_model(), cartridge, ids), expected, rtol=0, atol=0)


def test_adapter_directory_round_trip(case, tmp_path):
    from cartridges.peft import save_adapter

    model, cartridge, ids = case
    expected = cartridge_logits(model, cartridge, ids)
    save_adapter(cartridge, tiny_llama(seed=0), tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(tmp_path / "adapter"))
    loaded = peft.PeftModel.from_pretrained(tiny_llama(seed=0), str(tmp_path / "adapter"))
    torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=0, atol=0)
    back = Cartridge.from_peft_adapter(tmp_path / "adapter", model)
    assert back.keys().equal(cartridge.keys()) and back.num_frozen == cartridge.num_frozen


def test_bad_adapters_are_refused(case, tmp_path):
    from cartridges.peft import save_adapter

    model, cartridge, _ = case
    with pytest.raises(CartridgeFileError, match="not a PEFT adapter"):
        Cartridge.from_peft_adapter(tmp_path, model)
    save_adapter(cartridge, model, tmp_path / "adapter")
    wider = tiny_llama(hidden_size=64, num_heads=4, num_kv_heads=2)  # head dim 16, not 8
    with pytest.raises(CartridgeError, match="do not fit the model"):
        Cartridge.from_peft_adapter(tmp_path / "adapter", wider)


def test_distill_starts_from_and_saves_a_peft_adapter(tmp_path):
    """cartridges-distill init=peft trains from a PEFT adapter; save_peft=true writes one PEFT loads back."""
    from cartridges import distill
    from cartridges.peft import save_adapter

    doc = tmp_path / "doc.md"
    doc.write_text("The ferry Marrow Lark crosses the Pell estuary four times a day since 1904. " * 4)
    model = tiny_llama()
    start = Cartridge.random(model, num_tokens=6, num_frozen=1, seed=5)
    save_adapter(start, model, tmp_path / "start")
    common = ["model=tiny-llama", "device=cpu", "progress=false", "corpus.min_tokens=32", "corpus.max_tokens=64",
              f"corpus.path={doc}", "method=ntp", "num_tokens=6", "pack_len=64", "steps=3", "lr=1e-2"]  # fmt: skip
    distill.main([*common, f"output={tmp_path / 'run'}", "init=peft", f"peft_adapter={tmp_path / 'start'}",
                  "save_peft=true"])  # fmt: skip
    trained = Cartridge.load(tmp_path / "run" / "cartridge.safetensors", model)
    assert trained.frozen_keys.equal(start.frozen_keys)  # the sink came from the adapter and stayed frozen
    assert not trained.trainable_keys.equal(start.trainable_keys)  # and the rest trained
    back = Cartridge.from_peft_adapter(tmp_path / "run" / "peft_adapter", model)
    assert back.keys().equal(trained.keys()) and back.values().equal(trained.values())
    with pytest.raises(SystemExit):  # the adapter's size must be the run's
        distill.main([*common[:-4], "num_tokens=8", "pack_len=64", "steps=1", f"output={tmp_path / 'bad'}",
                      "init=peft", f"peft_adapter={tmp_path / 'start'}"])  # fmt: skip


def smollm2_gguf() -> Path | None:
    """The SmolLM2 GGUF if this machine already has it (tests never download): $ZOO_SMOLLM2_GGUF, or the default
    model cache of `zoo.pretrained` (the tests' own ZOO_CACHE_DIR is a fresh temp dir)."""
    env = os.environ.get("ZOO_SMOLLM2_GGUF")
    candidates = [Path(env)] if env else []
    candidates.append(
        Path.home() / ".cache" / "zoo" / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    return next((c for c in candidates if c.is_file()), None)


@pytest.mark.slow
def test_smollm2_round_trip():
    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("SmolLM2 GGUF not on this machine (set ZOO_SMOLLM2_GGUF or fetch smollm2-135m-instruct once)")
    from cartridges.corpus import context_ids
    from zoo.pretrained import load_model

    model, tok = load_model(str(gguf))
    prefix = torch.tensor(context_ids(tok, "The Pell ferry sails at dawn.")[:12])
    cartridge = Cartridge.from_prefix(model, prefix)
    ids = torch.tensor([tok.encode("When does the ferry sail?", add_special_tokens=False)])
    expected = cartridge_logits(model, cartridge, ids)
    peft_model = cartridge.to_peft(model)
    torch.testing.assert_close(peft_model(input_ids=ids).logits, expected, rtol=0, atol=0)
    back = Cartridge.from_peft(peft_model)
    assert back.keys().equal(cartridge.keys()) and back.values().equal(cartridge.values())
