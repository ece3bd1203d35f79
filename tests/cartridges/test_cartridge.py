"""Cartridge invariants on a tiny random Llama: exact-prefix equivalence, gradients, file format, composition."""

import json
import struct

import pytest
import torch

from cartridges.cache import (
    Cartridge,
    CartridgeFileError,
    CartridgeMismatchError,
    cache_kwargs,
    generate,
)
from zoo.pretrained import tiny_llama

PREFIX, QUERY = 24, 16


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def ids():
    gen = torch.Generator().manual_seed(1)
    return torch.randint(3, 259, (1, PREFIX + QUERY), generator=gen)


def forward_with(model, cartridge, input_ids, dtype=None):
    cache = cartridge.as_cache(input_ids.shape[0], dtype=dtype, config=model.config)
    return model(input_ids=input_ids, **cache_kwargs(model, cache)).logits


def test_exact_prefix_reproduces_full_context_logits(model, ids):
    full = model(input_ids=ids).logits[:, PREFIX:]  # [1, QUERY, V]
    cartridge = Cartridge.from_prefix(model, ids[:, :PREFIX])
    assert cartridge.num_tokens == PREFIX
    batch = ids[:, PREFIX:].expand(3, -1)
    out = forward_with(model, cartridge, batch)
    torch.testing.assert_close(out, full.expand(3, -1, -1), rtol=1e-5, atol=1e-5)
    # Without the cartridge the logits differ: the comparison above has teeth.
    assert not torch.allclose(model(input_ids=ids[:, PREFIX:]).logits, full, atol=1e-3)


def test_as_cache_shares_storage_across_the_batch(model, ids):
    cartridge = Cartridge.from_prefix(model, ids[:, :PREFIX])
    cache = cartridge.as_cache(4)
    k = cache.layers[0].keys
    assert k.shape == (4, cartridge.info.model.num_kv_heads, PREFIX, cartridge.info.model.head_dim)
    assert k.stride(0) == 0  # an expanded view, not four copies


def test_gradients_reach_only_the_trainable_tokens(model, ids):
    cartridge = Cartridge.from_prefix(model, ids[:, :PREFIX], num_frozen=1)
    trainable = {name for name, p in cartridge.named_parameters() if p.requires_grad}
    assert trainable == {"trainable_keys", "trainable_values"}
    assert cartridge.trainable_keys.shape[2] == PREFIX - 1
    forward_with(model, cartridge, ids[:, PREFIX:].expand(2, -1)).logsumexp(-1).sum().backward()
    for p in (cartridge.trainable_keys, cartridge.trainable_values):
        assert p.grad is not None and p.grad.abs().sum() > 0
        # every layer and token receives gradient
        assert (p.grad.abs().sum(dim=(1, 3)) > 0).all()
    assert cartridge.frozen_keys.grad is None and not cartridge.frozen_keys.requires_grad
    assert all(p.grad is None for p in model.parameters())


def test_greedy_generate_equals_prefix_in_prompt(model, ids):
    prompt = ids[:, : PREFIX + 6]
    reference = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    cartridge = Cartridge.from_prefix(model, ids[:, :PREFIX])
    out = generate(model, cartridge, ids[:, PREFIX : PREFIX + 6], max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 6 + 12)
    assert torch.equal(out, reference[:, PREFIX:])


def test_save_load_round_trip(model, ids, tmp_path):
    cartridge = Cartridge.from_prefix(model, ids[:, :PREFIX], num_frozen=2, corpus_hash="abc")
    with torch.no_grad():
        cartridge.trainable_keys.add_(0.5)
    cartridge.info.training_config = {"lr": 0.02}
    path = cartridge.save(tmp_path / "c.safetensors")
    loaded = Cartridge.load(path, model)
    assert torch.equal(loaded.keys(), cartridge.keys()) and torch.equal(loaded.values(), cartridge.values())
    assert loaded.num_frozen == 2 and loaded.info.corpus_hash == "abc"
    assert loaded.info.training_config == {"lr": 0.02}
    assert loaded.info.model == cartridge.info.model
    assert not list(tmp_path.glob(".*tmp"))  # the atomic write left no temp file


def test_save_load_bf16(model, ids, tmp_path):
    cartridge = Cartridge.from_prefix(model, ids[:, :PREFIX], dtype=torch.bfloat16)
    loaded = Cartridge.load(cartridge.save(tmp_path / "c.safetensors"), model)
    assert loaded.dtype == torch.bfloat16 and torch.equal(loaded.keys(), cartridge.keys())


def test_load_into_another_model_fails(model, ids, tmp_path):
    path = Cartridge.from_prefix(model, ids[:, :PREFIX]).save(tmp_path / "c.safetensors")
    with pytest.raises(CartridgeMismatchError, match="num_layers 2 != 3"):
        Cartridge.load(path, tiny_llama(num_layers=3))
    # Same architecture, other weights: caught by the weight sample even when the id check is off.
    with pytest.raises(CartridgeMismatchError, match="embedding weights differ"):
        Cartridge.load(path, tiny_llama(seed=1), check_model_id=False)
    with pytest.raises(CartridgeMismatchError, match="model id"):
        Cartridge.load(path, tiny_llama(seed=1))


def test_truncated_file_fails_cleanly(model, ids, tmp_path):
    path = Cartridge.from_prefix(model, ids[:, :PREFIX]).save(tmp_path / "c.safetensors")
    data = path.read_bytes()
    for cut in (4, 100, len(data) - 1):
        path.write_bytes(data[:cut])
        with pytest.raises(CartridgeFileError, match="truncated|too short|not a cartridge"):
            Cartridge.load(path, model)
    with pytest.raises(CartridgeFileError, match="cannot read"):
        Cartridge.load(tmp_path / "missing.safetensors", model)


def test_corrupted_tensor_data_fails_checksum(model, ids, tmp_path):
    path = Cartridge.from_prefix(model, ids[:, :PREFIX]).save(tmp_path / "c.safetensors")
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one byte of the last tensor
    path.write_bytes(bytes(data))
    with pytest.raises(CartridgeFileError, match="checksum"):
        Cartridge.load(path, model)


def test_edited_metadata_is_refused(model, ids, tmp_path):
    path = Cartridge.from_prefix(model, ids[:, :PREFIX]).save(tmp_path / "c.safetensors")
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = json.loads(header["__metadata__"]["zoo.cartridge"])
    meta["format_version"] = 99
    header["__metadata__"]["zoo.cartridge"] = json.dumps(meta)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    with pytest.raises(CartridgeFileError, match="format version 99"):
        Cartridge.load(path, model)


def test_concat_lengths_and_content(model, ids):
    a = Cartridge.from_prefix(model, ids[:, :10], num_frozen=1)
    b = Cartridge.from_prefix(model, ids[:, 10:17], num_frozen=1)
    c = Cartridge.concat([a, b])
    assert c.num_tokens == 17 and c.num_frozen == 1
    assert c.trainable_keys.shape[2] == 16
    assert torch.equal(c.keys()[:, :, :10], a.keys()) and torch.equal(c.values()[:, :, 10:], b.values())
    assert c.memory_bytes() == a.memory_bytes() + b.memory_bytes()
    out = forward_with(model, c, ids[:, 30:34])
    assert out.shape == (1, 4, model.config.vocab_size)
    with pytest.raises(CartridgeMismatchError):
        Cartridge.concat([a, Cartridge.from_prefix(tiny_llama(seed=2), ids[:, :5])])


def test_random_cartridge_has_the_model_sink(model):
    c = Cartridge.random(model, num_tokens=8, num_frozen=1, seed=3)
    sink = Cartridge.from_prefix(model, torch.tensor([model.config.bos_token_id]))
    assert c.num_tokens == 8
    torch.testing.assert_close(c.frozen_keys, sink.keys())
    assert not torch.equal(Cartridge.random(model, 8, seed=4).trainable_keys, c.trainable_keys)


def test_bad_arguments_raise_value_errors(model, ids):
    with pytest.raises(ValueError, match="num_frozen"):
        Cartridge.from_prefix(model, ids[:, :4], num_frozen=5)
    with pytest.raises(ValueError, match="one sequence"):
        Cartridge.from_prefix(model, ids.expand(2, -1))
    with pytest.raises(ValueError, match="batch_size"):
        Cartridge.from_prefix(model, ids[:, :4]).as_cache(0)


def test_left_padded_batch_generates_like_single_prompts(model, ids):
    cartridge = Cartridge.from_prefix(model, ids[:, :PREFIX])
    short, long = ids[0, PREFIX : PREFIX + 3], ids[0, PREFIX : PREFIX + 7]
    batch = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros(2, 7, dtype=torch.long)
    batch[0, 4:], mask[0, 4:] = short, 1
    batch[1], mask[1] = long, 1
    kw = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    out = generate(model, cartridge, batch, attention_mask=mask, **kw)
    for row, prompt in ((0, short), (1, long)):
        alone = generate(model, cartridge, prompt[None], **kw)
        assert torch.equal(out[row, 7:], alone[0, len(prompt) :])
