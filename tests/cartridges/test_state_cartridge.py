"""StateCartridge invariants on a tiny random Zoo hybrid (BaseConv, Based, sliding window, attention): a prefilled
state continues exactly like the corpus in context, gradients reach only the state (and are right), the file
round-trips and refuses other models and damaged bytes, and distillation runs end to end."""

import json

import pytest
import torch

from cartridges import distill, self_study
from cartridges.cache import (
    Cartridge,
    CartridgeFileError,
    CartridgeMismatchError,
    generate,
    load_cartridge,
    read_cartridge_file,
)
from cartridges.config import load_config
from cartridges.corpus import Corpus, context_ids
from cartridges.state import StateCartridge, differentiable
from zoo.models.hf import ZooConfig, ZooForCausalLM
from zoo.pretrained import ByteTokenizer, tiny_llama

WINDOW = 8
CORPUS_LEN = 29  # > WINDOW, so the ring buffer has wrapped


def make_config(window: int = WINDOW, **kwargs) -> ZooConfig:
    return ZooConfig(
        n_layers=5,
        pattern=["base_conv", "based", "sliding_window", "attention", "base_conv"],
        mixers={
            "based": {"feature_dim": 4, "num_heads": 2, "chunk_size": 16},
            "sliding_window": {"window": window, "num_heads": 2},
            "attention": {"num_heads": 2, "max_seq_len": 512},
        },
        d_model=32,
        eos_token_id=2,
        pad_token_id=0,
        **kwargs,
    )


def make_model(seed: int = 0, dtype=torch.float32, **kwargs) -> ZooForCausalLM:
    torch.manual_seed(seed)
    model = ZooForCausalLM(make_config(**kwargs)).to(dtype).eval()
    return model.requires_grad_(False)


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def corpus():
    return torch.randint(3, 512, (CORPUS_LEN,), generator=torch.Generator().manual_seed(1))


def test_prefilled_state_reproduces_full_context_logits(model, corpus):
    cartridge = StateCartridge.from_prefix(model, corpus)
    assert cartridge.num_tokens == CORPUS_LEN
    cont = torch.randint(3, 512, (3, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(input_ids=torch.cat([corpus.expand(3, -1), cont], dim=1)).logits[:, CORPUS_LEN:]
        out = model(input_ids=cont, cache=cartridge.as_cache(3), use_cache=True).logits
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
    # The model updated its cache in place; the cartridge itself must not have moved.
    again = StateCartridge.from_prefix(model, corpus)
    for (name, a), b in zip(cartridge.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


def test_generate_continues_from_the_state(model, corpus):
    cartridge = StateCartridge.from_prefix(model, corpus)
    prompt = torch.randint(3, 512, (2, 7), generator=torch.Generator().manual_seed(3))
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    reference = model.generate(torch.cat([corpus.expand(2, -1), prompt], dim=1), **kwargs)[:, CORPUS_LEN:]
    assert torch.equal(generate(model, cartridge, prompt, **kwargs), reference)
    # A ragged batch (left padding) gives each row what it gets alone.
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0
    ragged = generate(model, cartridge, prompt, attention_mask=mask, **kwargs)
    alone = generate(model, cartridge, prompt[1:, 3:], **kwargs)
    assert torch.equal(ragged[0], reference[0])
    assert torch.equal(ragged[1, 3 : 3 + alone.shape[1]], alone[0])


def test_gradients_reach_only_the_state_and_are_right():
    model = make_model(dtype=torch.float64)
    corpus = torch.randint(3, 512, (CORPUS_LEN,), generator=torch.Generator().manual_seed(1))
    cartridge = StateCartridge.from_prefix(model, corpus, dtype=torch.float64)
    names = {name for name, _ in cartridge.named_parameters()}
    # Every floating state tensor is a parameter, the integer positions are buffers.
    assert names == {
        "layer0_conv",
        "layer1_kv",
        "layer1_k_sum",
        "layer2_k",
        "layer2_v",
        "layer3_k",
        "layer3_v",
        "layer4_conv",
    }
    assert {name for name, _ in cartridge.named_buffers()} == {"layer2_pos", "layer3_pos"}
    cont = torch.randint(3, 512, (2, 5), generator=torch.Generator().manual_seed(4))
    weights = torch.randn(2, 5, 512, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def loss_fn() -> torch.Tensor:
        # Through the LanguageModel, as distill.py does: the HF forward returns fp32 logits, too coarse here.
        cache = cartridge.as_cache(2, dtype=torch.float64)
        with differentiable(cache):
            logits = model.model.logits(model.model.hidden_states(cont, cache.states))
        return (logits * weights).sum()

    loss_fn().backward()
    assert all(p.grad is None for p in model.parameters())  # the frozen model gets nothing
    # Autograd against central differences at a few coordinates of every state tensor.
    gen = torch.Generator().manual_seed(6)
    for name, param in cartridge.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
        for idx in torch.randint(0, param.numel(), (3,), generator=gen).tolist():
            flat = param.data.view(-1)
            old, h = flat[idx].item(), 1e-6
            with torch.no_grad():
                flat[idx] = old + h
                up = loss_fn()
                flat[idx] = old - h
                down = loss_fn()
                flat[idx] = old
            numeric = (up - down).item() / (2 * h)
            assert param.grad.reshape(-1)[idx].item() == pytest.approx(numeric, rel=1e-5, abs=1e-8), name


def test_save_load_round_trip(model, corpus, tmp_path):
    cartridge = StateCartridge.from_prefix(model, corpus, corpus_hash="abc")
    with torch.no_grad():  # a trained state differs from any prefill
        cartridge.layer1_kv.add_(0.5)
    path = cartridge.save(tmp_path / "state.safetensors")
    loaded = load_cartridge(path, model)
    assert isinstance(loaded, StateCartridge)
    assert loaded.num_tokens == CORPUS_LEN and loaded.info.corpus_hash == "abc"
    assert loaded.memory_bytes() == cartridge.memory_bytes() > 0
    want = cartridge.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]) and got[name].dtype == want[name].dtype, name
    cont = torch.randint(3, 512, (1, 6), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        a = model(input_ids=cont, cache=cartridge.as_cache(1), use_cache=True).logits
        b = model(input_ids=cont, cache=loaded.as_cache(1), use_cache=True).logits
    assert torch.equal(a, b)
    meta, _ = read_cartridge_file(path)
    assert meta["kind"] == "state" and meta["num_tokens"] == CORPUS_LEN


def test_memory_bytes_counts_the_state(model, corpus):
    cartridge = StateCartridge.from_prefix(model, corpus)
    lm = model.model
    # fp32: exactly the model's own state size (attention counted for its live rows), in bytes
    assert cartridge.memory_bytes(torch.float32) == 4 * lm.state_size(CORPUS_LEN)
    # bf16 serving halves everything but Based's fp32 accumulators
    based = lm.blocks[1].mixer.state_size(CORPUS_LEN)
    assert cartridge.memory_bytes(torch.bfloat16) == 2 * lm.state_size(CORPUS_LEN) + 2 * based


def test_mismatched_model_fails(model, corpus, tmp_path):
    path = StateCartridge.from_prefix(model, corpus).save(tmp_path / "state.safetensors")
    with pytest.raises(CartridgeMismatchError, match="embedding weights differ"):
        load_cartridge(path, make_model(seed=1))
    with pytest.raises(CartridgeMismatchError, match="config hash"):
        load_cartridge(path, make_model(window=WINDOW * 2))
    with pytest.raises(CartridgeMismatchError, match="ZooForCausalLM"):
        load_cartridge(path, tiny_llama())
    with pytest.raises(CartridgeMismatchError, match="'state' cartridge, not a 'kv'"):
        Cartridge.load(path, model)
    # A faster kernel choice is the same model: the cartridge still loads.
    triton_config = make_config()
    triton_config.mixers["based"]["impl"] = "naive"
    triton_config.mixers["based"]["chunk_size"] = 8
    other_impl = ZooForCausalLM(triton_config)
    other_impl.load_state_dict(model.state_dict())
    assert isinstance(load_cartridge(path, other_impl), StateCartridge)


def test_corrupted_file_fails_cleanly(model, corpus, tmp_path):
    path = StateCartridge.from_prefix(model, corpus).save(tmp_path / "state.safetensors")
    data = path.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) - 100])
    flipped = tmp_path / "flipped.safetensors"
    flipped.write_bytes(data[:-5] + bytes([data[-5] ^ 0xFF]) + data[-4:])
    for bad, reason in ((truncated, "truncated"), (flipped, "checksum"), (tmp_path / "missing", "cannot read")):
        with pytest.raises(CartridgeFileError, match=reason) as info:
            load_cartridge(bad, model)
        assert "\n" not in str(info.value)


def test_distillation_runs_end_to_end(tmp_path):
    """Self-study with the Zoo model itself, then distillation: the exact state has zero loss, a random state
    learns, the model does not move, and the result loads and resumes."""
    model, tok = make_model(), ByteTokenizer(vocab_size=512)
    doc = tmp_path / "doc.md"
    doc.write_text("Ines lit the lamp of Vellmar in 1843.")
    n_ctx = len(context_ids(tok, doc.read_text()))
    n_doc = len(tok.encode(doc.read_text()))  # chunks of at least the document's length: the teacher reads all of it
    corpus_args = [f"corpus.path={doc}", f"corpus.min_tokens={n_doc}", "corpus.max_tokens=60"]
    common = ["model=unused", "device=cpu", "progress=false", *corpus_args]
    synth_cfg, _ = load_config(
        "synthesize",
        [
            *common,
            f"output={tmp_path / 'ss'}",
            "num_conversations=4",
            "batch_size=4",
            "max_user_tokens=6",
            "max_answer_tokens=5",
            "top_logprobs=4",
        ],
    )
    self_study.synthesize(synth_cfg, model, tok)  # works with a ZooForCausalLM in-process
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def run(name: str, *extra: str) -> dict:
        cfg, _ = load_config(
            "distill",
            [
                *common,
                f"data={tmp_path / 'ss'}",
                f"output={tmp_path / name}",
                "pack_len=64",
                "batch_size=2",
                "log_every=1",
                "checkpoint_every=2",
                "lr=5e-2",
                *extra,
            ],
        )
        return distill.distill(cfg, model, tok)

    # The teacher read the whole (short) document, so the state of the document in context is already exact.
    corpus = Corpus.from_path(doc, tok, 30, 60)
    exact = StateCartridge.from_prefix(model, torch.tensor(context_ids(tok, corpus.full_text())))
    examples = distill.load_examples(
        load_config("distill", [*common, f"data={tmp_path / 'ss'}", "output=x"])[0], corpus
    )
    batch = distill.collate_rows([examples], "cpu")
    assert distill.distill_loss(model, exact, batch).item() == pytest.approx(0.0, abs=1e-5)

    summary = run("random", "init=random", "num_tokens=12", "steps=6")
    assert summary["kind"] == "state"
    losses = [json.loads(line)["loss"] for line in (tmp_path / "random" / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0]
    trained = load_cartridge(tmp_path / "random" / "cartridge.safetensors", model)
    assert isinstance(trained, StateCartridge) and trained.info.training_config["distill"]["steps"] == 6
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    run("ntp", "method=ntp", f"num_tokens={n_ctx}", "steps=2")
    run("ntp", "method=ntp", f"num_tokens={n_ctx}", "steps=3", "resume=true")
    assert len((tmp_path / "ntp" / "metrics.jsonl").read_text().splitlines()) == 3


def test_answer_only_pretraining_data_of_the_experiment(tmp_path):
    """experiments/state_cartridges with --answer-loss: each row is the document's own tokenization, padded to
    the window, and its labels keep exactly the answers (the value of every question line, and its newline
    with label_newline)."""
    import dataclasses

    import datasets
    from transformers import PreTrainedTokenizerFast

    from experiments.state_cartridges import run

    values = {v for vals in run.ATTRIBUTES.values() for v in vals}
    for newline in (False, True):
        scale = dataclasses.replace(
            run.QUICK, layout="kv1", entities=3, sheets=20, answer_loss=True, label_newline=newline
        )
        data, tok_dir = run.write_pretraining_data(tmp_path / str(newline), scale, seed=0)
        tok = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
        for row in datasets.load_from_disk(str(data)):
            ids, labels = row["input_ids"], row["labels"]
            assert len(ids) == len(labels) == scale.seq_len - 1
            assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids
            kept = [tok.decode([t]) for t, label in zip(ids, labels) if label != -100]
            assert kept and all(label in (-100, t) for t, label in zip(ids, labels))
            words = kept[0::2] if newline else kept
            assert all(w.strip() in values for w in words)
            if newline:
                assert kept[1::2] == ["\n"] * (len(kept) // 2)
    # generated answers are read as trained: the value's one token, whatever untrained tokens follow it
    run.check_values(tok)
    value = tok.encode(" miller", add_special_tokens=False)
    tail = tok.encode("Tolmi\nxq", add_special_tokens=False)
    assert run.read_answer(tok, value + tail, kv=True) == "miller"
    assert run.read_answer(tok, value + tail, kv=False) == "millerTolmi"
    assert run.stop_at_answer(tok, value + tail, kv=True) == 1


def test_query_regions_of_the_experiment():
    """draw_queries: "passes" asks each question once per pass; "iid" draws with replacement (repeats within
    the first len(questions) queries, which a permutation never has); a typo fails with one line."""
    import random

    import pytest

    from experiments.state_cartridges import run

    questions = [f"q{i}" for i in range(8)]
    passes = run.draw_queries(random.Random(0), questions, 3, "passes")
    assert len(passes) == 24 and all(sorted(passes[i : i + 8]) == questions for i in range(0, 24, 8))
    iid = [run.draw_queries(random.Random(s), questions, 1, "iid") for s in range(20)]
    assert all(len(q) == 8 and set(q) <= set(questions) for q in iid)
    assert any(len(set(q)) < 8 for q in iid)
    with pytest.raises(ValueError, match="iid or passes"):
        run.draw_queries(random.Random(0), questions, 1, "pases")


def test_attention_lm_of_the_experiment():
    """The hybrid attention LM is Based's block with global attention in place of Based and the window (same
    convs, same layer count); a typo fails with one line."""
    import dataclasses

    import pytest

    from experiments.state_cartridges import run
    from zoo.config import register_pretrain_configs
    from zoo.train import load_config

    register_pretrain_configs()
    scale = dataclasses.replace(run.QUICK)
    based, _ = load_config(["model=based_tiny"], config_name="pretrain")
    hybrid, _ = load_config(run.attention_model_args(scale), config_name="pretrain")
    swap = {"based": "attention", "sliding_window": "attention"}
    assert list(hybrid.model.pattern) == [swap.get(m, m) for m in based.model.pattern]
    assert hybrid.model.n_layers == based.model.n_layers and set(hybrid.model.mixers) == {"attention"}
    with pytest.raises(ValueError, match="hybrid or plain"):
        run.attention_model_args(dataclasses.replace(scale, attention="hybird"))


def test_experiment_rejects_impossible_settings(capsys):
    """run.py: a sheet larger than the name pool, a non-positive count or a typo fails before any work, with
    one line."""
    import pytest

    from experiments.state_cartridges import run

    for argv, message in (
        (["--entities", "200", "--layout", "kv1", "--names-per-entity", "1"], "needs 200 distinct names"),
        (["--corpora", "-1"], "corpora must be >= 1"),
        (["--steps", "-5"], "steps must be >= 1"),
        (["--curriculum", "--no-curriculum"], "exclude each other"),
    ):
        with pytest.raises(SystemExit):
            run.main([*argv, "--out", "/nonexistent/never-written"])
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="queries must be one of"):
        run.Scale(entities=4, sheets=1, d_model=8, n_layers=1, steps=1, batch_size=1, conversations=1,
                  distill_steps=1, queries="idd").validate()  # fmt: skip


def test_experiment_summary_is_written_whole_after_every_corpus(tmp_path):
    """run.write_summary: what a cut run leaves is a readable summary of the arms done so far, marked incomplete,
    with its answers, and no temporary file."""
    import dataclasses

    from experiments.state_cartridges import run

    scale = dataclasses.replace(run.QUICK)
    results = {"based/icl": {"model": "based", "arm": "icl", "correct": 3, "n": 4, "accuracy": 0.75}}
    answers = [{"model": "based", "arm": "icl", "corpus": 0, "output": "Tolmi"}] * 4
    for complete in (False, True):
        run.write_summary(tmp_path, scale, "cpu", results, {"based": 1.0}, answers, {}, 0.0, complete=complete)
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert summary["complete"] is complete and summary["results"] == results
        assert summary["scale"]["entities"] == scale.entities
        lines = (tmp_path / "answers.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == answers
        assert sorted(p.name for p in tmp_path.iterdir()) == ["answers.jsonl", "summary.json"]
