"""The two-stream decode step (`zoo.models.cache.split_rows`, DecodeGraph(streams=2)): its two halves, stepped one
after the other here on the CPU, give the logits and the state of one step of the whole batch, step after step,
shared positions ("pos") included. The CUDA graph with two streams is checked against eager decoding in
tests/models/test_hf.py (GPU)."""

import copy

import pytest
import torch

from zoo.models.cache import split_rows
from zoo.models.hf import ZooConfig
from zoo.models.lm import LanguageModel

BATCH = 4


def hybrid() -> LanguageModel:
    """ZooConfig's default hybrid (BaseConv, Based, sliding window) with a learned position table, so both kinds
    of shared "pos" (the window's, the model's) are in the state."""
    torch.manual_seed(0)
    mixers = {"based": {"feature_dim": 4, "num_heads": 2}, "sliding_window": {"window": 4, "num_heads": 2}}
    config = ZooConfig(vocab_size=64, d_model=32, mixers=mixers).model_config()
    config.max_position_embeddings = 64
    model = LanguageModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model


def equal_states(a: list, b: list) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        assert (x is None) == (y is None), i
        if x is not None:
            assert x.keys() == y.keys(), i
            for key in x:
                # fp32 GEMMs at another batch size round differently: 1e-5 relative
                torch.testing.assert_close(x[key], y[key], rtol=1e-5, atol=1e-5, msg=f"layer {i} {key}")


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_two_halves_step_as_the_whole_batch(rows):
    model = hybrid()
    g = torch.Generator().manual_seed(rows)
    with torch.no_grad():
        whole = model.init_state(BATCH)
        for _ in range(5):  # a ring of 4 overrun: every slot written, the position past the window
            model.step(torch.randint(0, 64, (BATCH,), generator=g), whole)
        halves = copy.deepcopy(whole)
        first, second, shared = split_rows(halves, rows)
        assert len(shared) == 2  # the window's position and the model's
        for _ in range(3):
            ids = torch.randint(0, 64, (BATCH,), generator=g)
            expected = model.step(ids, whole)
            for original, copy_ in shared:
                copy_.copy_(original)
            got = torch.cat([model.step(ids[:rows], first), model.step(ids[rows:], second)])
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            equal_states(halves, whole)
    assert int(halves[-1]["pos"]) == 8


def test_decode_streams_must_be_one_or_two():
    with pytest.raises(ValueError, match="decode_streams must be 1 or 2"):
        ZooConfig(decode_streams=3)
