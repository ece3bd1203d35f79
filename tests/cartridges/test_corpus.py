"""Corpus loading and chunking, chat rendering, model-name resolution."""

import random

import datasets
import pytest

from cartridges.corpus import Corpus, CorpusError, context_ids, load_texts, turn_ids
from zoo.pretrained import ByteTokenizer, ModelNotFoundError, load_model


def test_load_texts_from_file_directory_and_dataset(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.md").write_text("second")
    (tmp_path / "d" / "a.txt").write_text("first")
    (tmp_path / "d" / "skip.bin").write_bytes(b"\0")
    assert load_texts(tmp_path / "d") == [("a.txt", "first"), ("b.md", "second")]
    assert load_texts(tmp_path / "d" / "a.txt") == [("a.txt", "first")]
    datasets.Dataset.from_dict({"body": ["x y", "", "z"]}).save_to_disk(str(tmp_path / "ds"))
    assert [t for _, t in load_texts(tmp_path / "ds", text_field="body")] == ["x y", "z"]
    with pytest.raises(CorpusError, match="no column"):
        load_texts(tmp_path / "ds")
    with pytest.raises(CorpusError, match="neither"):
        load_texts(tmp_path / "missing")


def test_chunks_respect_min_and_max_tokens():
    tok = ByteTokenizer()
    corpus = Corpus([("a", "a" * 100), ("b", "b" * 30)], tok, min_tokens=40, max_tokens=64)
    rng = random.Random(0)
    for _ in range(50):
        chunk = corpus.sample_chunk(rng)
        assert chunk.doc == 0 and 40 <= chunk.end - chunk.start <= 64  # doc b is shorter than min_tokens
    assert [len(w) for w in corpus.windows()] == [64]  # the 36-token tail of a is dropped, b is too short
    with pytest.raises(CorpusError, match="min_tokens"):
        Corpus([("b", "b" * 30)], tok, min_tokens=40, max_tokens=64)


def test_turns_follow_the_context_exactly():
    tok = ByteTokenizer()
    msgs = [{"role": "user", "content": "hi"}]
    ctx = context_ids(tok, "doc")
    from cartridges.corpus import render, system_message

    full = render(tok, [system_message("doc"), *msgs], add_generation_prompt=True)
    assert ctx + turn_ids(tok, msgs, add_generation_prompt=True) == full


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(ModelNotFoundError, match="not a known name"):
        load_model("no-such-model-anywhere")
