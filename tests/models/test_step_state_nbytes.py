"""The decode byte model: `step_state_nbytes`, and the bench and the decode profile that both count with it.

Every expected number is worked out by hand from the state shapes of `small()`: d_model 32, Based with 2 heads,
f = 4 (E = 1 + 4 + 10 = 15 features) and d_v = 16, a sliding window of 4 slots, BaseConv with 64 channels
(expand 2) and kernel 3.
"""

import pytest
import torch

from experiments.bench.decode_profile import part_budget, weight_bytes
from experiments.bench.generation import decode_state_bytes
from zoo.models.hf import ZooConfig, ZooForCausalLM
from zoo.models.mixers import MIXERS, step_state_nbytes

# Based: kv [2, 15, 16] + k_sum [2, 15] = 480 + 30 fp32 elements, read and written whole.
BASED_FP32 = 2 * (480 + 30) * 4
# BaseConv: the tail [2, 64] (the last k-1 = 2 conv inputs), read and written whole, in the model's dtype.
CONV = 2 * (2 * 64)
# Window: the rings k and v [4, 2, 16], read whole; one slot of each (2 · 32 elements) written.
RING, SLOT = 2 * 4 * 32, 2 * 32


def small(dtype: torch.dtype = torch.float32, **based) -> ZooForCausalLM:
    mixers = {"based": {"feature_dim": 4, "num_heads": 2, **based}, "sliding_window": {"window": 4, "num_heads": 2}}
    config = ZooConfig(vocab_size=64, d_model=32, n_layers=3, pattern=["base_conv", "based", "sliding_window"],
                       mixers=mixers)
    return ZooForCausalLM(config).to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_mixer_kind_counts_its_state_read_and_written(dtype):
    lm = small(dtype).model
    size = dtype.itemsize
    by_name = {block.mixer.name: block.mixer for block in lm.blocks}
    assert step_state_nbytes(by_name["based"], 100) == (BASED_FP32 // 2, BASED_FP32 // 2)  # fp32 under any model
    assert step_state_nbytes(by_name["base_conv"], 100) == (CONV // 2 * size, CONV // 2 * size)
    assert step_state_nbytes(by_name["sliding_window"], 100) == (RING * size, SLOT * size)
    assert lm.step_state_nbytes(100) == {"base_conv": CONV * size, "based": BASED_FP32,
                                         "sliding_window": (RING + SLOT) * size}


def test_rings_read_only_their_filled_slots_and_bf16_kv_halves_based():
    lm = small(state_dtype="bf16").model
    window = lm.blocks[2].mixer
    assert step_state_nbytes(window, 2) == (RING // 2 * 4, SLOT * 4)  # 2 of the 4 slots hold tokens
    assert step_state_nbytes(lm.blocks[1].mixer, 100) == (480 * 2 + 30 * 4,) * 2
    attention = MIXERS["attention"](32, num_heads=2, max_seq_len=16)  # a KV cache of 16 positions
    assert step_state_nbytes(attention, 10) == (2 * 10 * 32 * 4, 2 * 32 * 4)
    assert step_state_nbytes(attention, 50) == (2 * 16 * 32 * 4, 2 * 32 * 4)


def test_bench_and_profile_count_the_same_bytes():
    """generation.py's GB/s and the decode profile's MB use the one model: the state once a sequence, per kind."""
    model = small(torch.bfloat16)
    batch = 3
    per_seq = BASED_FP32 + (CONV + RING + SLOT) * 2
    assert decode_state_bytes("based", model, batch, 100) == batch * per_seq
    budget = part_budget(model.model, batch, seq_len=100)
    blocks = {block.mixer.name: block.mixer for block in model.model.blocks}  # one layer of each kind
    state = {name: budget[f"part:mixer {name}"]["bytes"] - weight_bytes(mixer) for name, mixer in blocks.items()}
    assert state == {"based": batch * BASED_FP32, "base_conv": batch * CONV * 2,
                     "sliding_window": batch * (RING + SLOT) * 2}


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_every_mixer_counts_its_floating_state_at_least_once(name):
    """Without slot buffers, a step reads and writes each floating state tensor whole; with them, reads no more."""
    mixer = MIXERS[name](64)
    state = mixer.init_state(1, device="meta") or {}
    total = sum(t.numel() * t.element_size() for t in state.values() if t.is_floating_point())
    read, written = step_state_nbytes(mixer, 10**6)
    assert read == total
    if not getattr(mixer, "slot_state", ()):
        assert written == total
    else:
        assert 0 < written < total
