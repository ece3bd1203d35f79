"""The commands end to end on the tiny model: self-study -> distillation (with resume) -> evaluation."""

import json
import os

import datasets
import httpx
import pytest
import torch

from cartridges import distill, self_study
from cartridges import eval as ceval
from cartridges.cache import Cartridge
from cartridges.clients import ClientError, OpenAIClient
from cartridges.config import ConfigError, load_config
from zoo.pretrained import ByteTokenizer, tiny_llama

DOC = (
    "The river town of Osk Varen sits where the Tamel meets the Quirre. Its bridge, the Long Saddle, has nine "
    "arches and was finished in the year 1712 by the mason Beatrix Hollund. Every autumn the town holds the "
    "Lantern Count, when each household floats one paper lantern per member down the Quirre. "
) * 3
COMMON = ["model=tiny-llama", "device=cpu", "progress=false", "corpus.min_tokens=64", "corpus.max_tokens=160"]


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    (root / "doc.md").write_text(DOC)
    args = [
        *COMMON,
        f"corpus.path={root / 'doc.md'}",
        f"output={root / 'ss'}",
        "num_conversations=10",
        "batch_size=4",
        "conversations_per_chunk=5",
        "max_user_tokens=12",
        "max_answer_tokens=10",
        "top_logprobs=5",
    ]
    self_study.main(args)
    return root, args


def test_self_study_writes_a_dataset(synthesized):
    root, _ = synthesized
    ds = datasets.load_from_disk(str(root / "ss" / "dataset"))
    assert len(ds) == 10
    row = ds[0]
    answer_len = len(row["input_ids"]) - row["answer_start"]
    assert answer_len >= 1 and len(row["top_ids"]) == answer_len and len(row["top_ids"][0]) == 5
    assert row["seed_type"] in ("structuring", "summarization", "question", "use_case", "creative")
    # top-1 of a greedy teacher is the token it emitted
    assert [t[0] for t in row["top_ids"]] == row["input_ids"][row["answer_start"] :]
    assert len(set(ds["chunk_id"])) == 2  # 5 conversations per chunk


def test_self_study_resumes_to_the_same_data(synthesized):
    root, args = synthesized
    before = datasets.load_from_disk(str(root / "ss" / "dataset")).to_list()
    (root / "ss" / "shards" / "00000004.jsonl").unlink()
    self_study.main(args)
    assert datasets.load_from_disk(str(root / "ss" / "dataset")).to_list() == before
    with pytest.raises(SystemExit):  # same output dir, other settings: refused
        self_study.main([*args, "seed=1"])


def test_distill_runs_and_resumes_exactly(synthesized):
    root, _ = synthesized
    base = [
        *COMMON,
        f"corpus.path={root / 'doc.md'}",
        f"data={root / 'ss'}",
        "num_tokens=16",
        "pack_len=64",
        "batch_size=2",
        "log_every=1",
        "checkpoint_every=3",
    ]
    distill.main([*base, f"output={root / 'straight'}", "steps=5"])
    distill.main([*base, f"output={root / 'resumed'}", "steps=3"])
    distill.main([*base, f"output={root / 'resumed'}", "steps=5", "resume=true"])
    model = tiny_llama()
    a = Cartridge.load(root / "straight" / "cartridge.safetensors", model)
    b = Cartridge.load(root / "resumed" / "cartridge.safetensors", model)
    assert a.info.init_method == "first_tokens" and a.num_tokens == 16
    assert a.keys().equal(b.keys()) and a.values().equal(b.values())
    rows = [json.loads(x) for x in (root / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and all(r["kl"] >= 0 and r["heldout_kl"] >= 0 for r in rows)
    resumed = [json.loads(x) for x in (root / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]  # the resume dropped nothing and duplicated nothing
    summary = json.loads((root / "straight" / "summary.json").read_text())
    assert summary["memory_bytes"] == a.memory_bytes() and summary["heldout_examples"] == 1
    # it learns what generalises to conversations it never trained on
    assert summary["final_heldout_kl"] < summary["initial_heldout_kl"]
    assert json.loads((root / "resumed" / "summary.json").read_text())["initial_heldout_kl"] == pytest.approx(
        summary["initial_heldout_kl"]
    )
    with pytest.raises(SystemExit):  # the run dir is taken
        distill.main([*base, f"output={root / 'straight'}", "steps=5"])


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
@pytest.mark.parametrize("kill", ["before_rename", "mid_write"])
def test_distill_killed_while_checkpointing_resumes_to_the_same_cartridge(synthesized, monkeypatch, kill, schedule):
    """A kill during the second checkpoint (after its file was written, before the rename; or half-way through
    the write) leaves the first checkpoint whole; resuming from it gives the uninterrupted run's cartridge and
    one metrics row per step, under either lr schedule."""
    root, _ = synthesized
    base = [*COMMON, f"corpus.path={root / 'doc.md'}", f"data={root / 'ss'}", "num_tokens=16", "pack_len=64",
            "batch_size=2", "log_every=1", "checkpoint_every=2", "steps=5", f"lr_schedule={schedule}"]  # fmt: skip
    kill = f"{kill}_{schedule}"
    distill.main([*base, f"output={root / f'kill_ref_{kill}'}"])
    calls = []
    real_replace, real_save = os.replace, torch.save  # the checkpoint's save goes through both

    def killing_replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_replace(src, dst)

    def killing_save(obj, f):
        calls.append(f)
        if len(calls) == 2:
            with open(f, "wb") as fh:
                fh.write(b"PK\x03\x04 half a checkpoint")
            raise KeyboardInterrupt
        return real_save(obj, f)

    if kill.startswith("before_rename"):
        monkeypatch.setattr(os, "replace", killing_replace)
    else:
        monkeypatch.setattr(torch, "save", killing_save)
    out = root / f"kill_{kill}"
    with pytest.raises(KeyboardInterrupt):
        distill.main([*base, f"output={out}"])
    monkeypatch.undo()
    state = torch.load(out / "ckpt" / "state.pt", weights_only=True)
    assert state["step"] == 2 and not list((out / "ckpt").glob(".*.tmp"))
    distill.main([*base, f"output={out}", "resume=true"])
    model = tiny_llama()
    a = Cartridge.load(root / f"kill_ref_{kill}" / "cartridge.safetensors", model)
    b = Cartridge.load(out / "cartridge.safetensors", model)
    assert a.keys().equal(b.keys()) and a.values().equal(b.values())
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("change", ["steps=6", "lr_schedule=constant"])
def test_distill_cosine_resume_keeps_its_schedule(synthesized, change):
    """A cosine lr is a function of the total steps: resuming with another total, or another schedule, is refused
    with a one-line error instead of continuing on a schedule the checkpoint was not trained on."""
    root, _ = synthesized
    base = [*COMMON, f"corpus.path={root / 'doc.md'}", f"data={root / 'ss'}", "num_tokens=16", "pack_len=64",
            "checkpoint_every=2", "steps=4", "lr_schedule=cosine"]  # fmt: skip
    out = root / f"cosine_{change.split('=')[0]}"
    distill.main([*base, f"output={out}"])
    with pytest.raises(SystemExit) as exit_info:
        distill.main([*base, f"output={out}", "resume=true", change])
    assert exit_info.value.code == 2
    distill.main([*base, f"output={out}", "resume=true"])  # the same schedule continues (here: nothing left)


def test_distill_resumes_with_metrics_cut_to_the_checkpoint(synthesized):
    """Rows logged after the last checkpoint (work a kill threw away) are dropped on resume, not duplicated."""
    root, _ = synthesized
    base = [*COMMON, f"corpus.path={root / 'doc.md'}", f"data={root / 'ss'}", "num_tokens=16", "pack_len=64",
            "log_every=1", "checkpoint_every=2"]  # fmt: skip
    out = root / "cut"
    distill.main([*base, f"output={out}", "steps=2"])
    with open(out / "metrics.jsonl", "a") as f:  # what a run killed at step 3 had logged past its checkpoint
        f.write(json.dumps({"step": 3, "loss": 9.0}) + "\n" + '{"step": 4, "lo')
    distill.main([*base, f"output={out}", "steps=4", "resume=true"])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[2]["loss"] != 9.0


def test_self_study_reports_the_information_in_its_data(synthesized):
    root, _ = synthesized
    summary = json.loads((root / "ss" / "summary.json").read_text())
    assert summary["conversations"] == 10 and summary["info_kl"] > 0
    assert set(summary["info_kl_by_seed_type"]) == set(summary["conversations_by_seed_type"])
    assert summary["chunk_coverage"]["mean"] > 0
    ds = datasets.load_from_disk(str(root / "ss" / "dataset"))
    assert all(k >= 0 for k in ds["info_kl"])


@pytest.mark.parametrize("seed_type", ["extraction", "recall"])
def test_direct_seed_prompts_name_their_chunk(tmp_path, seed_type):
    """Direct prompts skip model A: the user message is the instruction with the chunk's opening words."""
    (tmp_path / "doc.md").write_text(DOC)
    args = [*COMMON, f"corpus.path={tmp_path / 'doc.md'}", f"output={tmp_path / 'ss'}", "num_conversations=3",
            "max_answer_tokens=4", "top_logprobs=3", f"seed_prompt_types=[{seed_type}]"]  # fmt: skip
    self_study.main(args)
    ds = datasets.load_from_disk(str(tmp_path / "ss" / "dataset"))
    for row in ds:
        start, end = (int(x) for x in row["chunk_id"].split(":")[1:])
        chunk = ByteTokenizer().decode(ByteTokenizer().encode(DOC)[start:end])
        expected = [p.format(start=self_study.opening(chunk)) for p in self_study.SEED_PROMPTS[seed_type]]
        assert row["seed_type"] == seed_type and row["user"] in expected


@pytest.mark.parametrize("method", ["hard_labels", "ntp"])
def test_distill_baselines_run(synthesized, method):
    root, _ = synthesized
    args = [
        *COMMON,
        f"corpus.path={root / 'doc.md'}",
        f"output={root / method}",
        "num_tokens=8",
        "steps=2",
        "pack_len=64",
        f"method={method}",
    ]
    if method != "ntp":
        args.append(f"data={root / 'ss'}")
    distill.main(args)
    assert (root / method / "cartridge.safetensors").is_file()


def test_eval_reports_every_arm(synthesized, capsys):
    root, _ = synthesized
    if not (root / "straight" / "cartridge.safetensors").is_file():
        pytest.skip("needs test_distill_runs_and_resumes_exactly")
    qa = [
        {"question": "Who finished the bridge?", "answer": "Beatrix Hollund"},
        {"question": "How many arches?", "answer": "nine", "aliases": ["9"]},
    ]
    (root / "qa.json").write_text(json.dumps(qa))
    ceval.main(
        [
            *COMMON[:3],
            f"corpus.path={root / 'doc.md'}",
            f"qa={root / 'qa.json'}",
            "max_new_tokens=4",
            "truncated_tokens=[100,200]",
            f"+cartridges.ss={root / 'straight' / 'cartridge.safetensors'}",
            f"output={root / 'eval'}",
        ]
    )
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(results) == {"icl", "truncated_100", "truncated_200", "none", "ss"}
    assert results["ss"]["kv_tokens"] == 16 and results["truncated_100"]["kv_tokens"] <= 100
    assert results["icl"]["memory_bytes"] > results["ss"]["memory_bytes"]
    assert all(r["n"] == 2 for r in results.values())
    # 57 tokens of chat template, then the document byte by byte: "nine" starts at byte 100, "Beatrix" at 159
    assert results["icl"]["n_in_prefix"] == 2 and results["none"]["n_in_prefix"] == 0
    assert results["truncated_100"]["n_in_prefix"] == 0 and results["truncated_200"]["n_in_prefix"] == 1
    rows = [json.loads(x) for x in (root / "eval" / "answers.jsonl").read_text().splitlines()]
    inside = {(r["arm"], r["reference"]) for r in rows if r["in_prefix"]}
    assert ("truncated_200", "nine") in inside and ("truncated_200", "Beatrix Hollund") not in inside


def test_eval_interrupted_keeps_finished_arms(synthesized, monkeypatch):
    """results.json is written after every arm: an eval killed part-way (a time limit) keeps what it finished."""
    root, _ = synthesized
    (root / "qa1.json").write_text(json.dumps([{"question": "How many arches?", "answer": "nine"}]))
    real, calls = ceval.answer, []

    def answer_then_stop(*args, **kwargs):
        calls.append(kwargs["desc"])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(ceval, "answer", answer_then_stop)
    with pytest.raises(KeyboardInterrupt):
        ceval.main([*COMMON[:3], f"corpus.path={root / 'doc.md'}", f"qa={root / 'qa1.json'}", "max_new_tokens=2",
                    f"output={root / 'eval_cut'}"])  # fmt: skip
    kept = json.loads((root / "eval_cut" / "results.json").read_text())
    assert list(kept) == calls[:1] and kept[calls[0]]["n"] == 1
    assert len((root / "eval_cut" / "answers.jsonl").read_text().splitlines()) == 1


def test_eval_scoring():
    item = {"question": "q", "answer": "Beatrix Hollund", "aliases": ["Hollund"]}
    assert ceval.is_correct("It was beatrix  Hollund.", item)
    assert ceval.is_correct("Hollund did", item)
    assert not ceval.is_correct("Hollunder", item)


def test_configs_are_strict():
    with pytest.raises(ConfigError, match="lr"):
        load_config("distill", ["data=x", "output=y", "corpus.path=z", "lr=-1"])
    with pytest.raises(ConfigError):
        load_config("distill", ["data=x", "output=y", "corpus.path=z", "num_tokns=3"])
    with pytest.raises(ConfigError, match="output"):
        load_config("synthesize", ["corpus.path=z"])
    with pytest.raises(ConfigError, match="needs data"):
        load_config("distill", ["output=y", "corpus.path=z"])
    with pytest.raises(ConfigError, match="targets"):
        load_config("distill", ["data=x", "output=y", "corpus.path=z", "targets=turns"])
    with pytest.raises(ConfigError, match="targets=conversation needs conversations"):
        load_config("distill", ["output=y", "corpus.path=z", "method=ntp", "targets=conversation"])


def fake_vllm(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    choices = []
    for i, prompt in enumerate(body["prompt"]):
        toks = [prompt[-1] + 1, 2]
        top = [{f"token_id:{t}": -0.1, f"token_id:{t + 7}": -2.5, "token_id:0": -4.0} for t in toks]
        choices.append(
            {"index": i, "text": "", "logprobs": {"tokens": [f"token_id:{t}" for t in toks], "top_logprobs": top}}
        )
    return httpx.Response(200, json={"choices": choices[::-1]})  # out of order on purpose


def test_openai_client_parses_token_ids_and_logprobs():
    client = OpenAIClient("http://fake/v1", "m", transport=httpx.MockTransport(fake_vllm))
    out = client.complete([[5, 6], [9]], max_tokens=4, temperature=0.0, top_logprobs=2)
    assert out[0].token_ids == [7, 2] and out[1].token_ids == [10, 2]
    assert out[0].top_ids[0] == [7, 14] and out[0].top_logprobs[0] == [-0.1, -2.5]
    with pytest.raises(ClientError, match="top logprobs"):
        client.complete([[5]], max_tokens=4, temperature=0.0, top_logprobs=5)


def test_self_study_reports_where_its_time_went(synthesized):
    """summary.json sums each batch's stage seconds (questions, answers, information KL, serialisation) from the
    shards' timing files; a batch without one (written before them) is left out and counted apart."""
    root, _ = synthesized
    summary = json.loads((root / "ss" / "summary.json").read_text())
    assert set(summary["timing_s"]) == {"questions", "answers", "info_kl", "write"}
    assert all(t >= 0 for t in summary["timing_s"].values()) and summary["timing_s"]["answers"] > 0
    assert summary["timed_batches"] == summary["batches"] >= 1


def test_batch_timings_skip_untimed_batches(tmp_path):
    from cartridges.self_study import batch_timings

    (tmp_path / "00000000.timing.json").write_text(json.dumps({"answers": 1.5, "write": 0.25}))
    (tmp_path / "00000004.timing.json").write_text(json.dumps({"answers": 2.0}))
    out = batch_timings(tmp_path, range(0, 12, 4))
    assert out == {"timing_s": {"answers": 3.5, "write": 0.25}, "timed_batches": 2, "batches": 3}


BAD_CORPUS = {  # each command with a corpus path that does not exist, and a model that cannot load
    "synthesize": (self_study.main, ["num_conversations=2"]),
    "distill": (distill.main, ["steps=1", "num_tokens=8", "method=ntp"]),
    "eval": (ceval.main, ["qa={qa}"]),
}


@pytest.mark.parametrize("command", list(BAD_CORPUS))
def test_bad_corpus_path_fails_before_the_model_loads(tmp_path, capsys, command):
    """A mistyped corpus path is a one-line error about the corpus, given before a (slow) model load, and
    nothing is written."""
    main, extra = BAD_CORPUS[command]
    (tmp_path / "qa.json").write_text(json.dumps([{"question": "Q?", "answer": "A"}]))
    args = ["model=no-such-model-anywhere", "device=cpu", "progress=false", f"corpus.path={tmp_path / 'typo.md'}",
            f"output={tmp_path / 'out'}", *(a.format(qa=tmp_path / "qa.json") for a in extra)]
    with pytest.raises(SystemExit):
        main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "typo.md" in err[0] and "neither a file" in err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", ["corpus", "data"])
def test_distill_overwrite_with_a_bad_input_keeps_the_earlier_run(synthesized, tmp_path, bad):
    """overwrite=true removes the earlier run's files only once the new run's inputs have been read."""
    root, _ = synthesized
    out = tmp_path / "run"
    args = [*COMMON, f"corpus.path={root / 'doc.md'}", f"data={root / 'ss'}", f"output={out}", "num_tokens=8",
            "steps=1", "pack_len=64"]
    distill.main(args)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert "cartridge.safetensors" in before and "summary.json" in before
    typo = {"corpus": f"corpus.path={root / 'typo.md'}", "data": f"data={root / 'no-such-dataset'}"}[bad]
    with pytest.raises(SystemExit):
        distill.main([*args, typo, "overwrite=true"])
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_the_seed_types_the_config_accepts_are_the_ones_with_prompts():
    """`seed_prompt_types` is checked against `cartridges.config.SEED_PROMPT_TYPES` when the config composes, and
    synthesis draws from `self_study.SEED_PROMPTS`: a type added to one and not the other would fail mid-run."""
    from cartridges.config import SEED_PROMPT_TYPES

    assert set(SEED_PROMPT_TYPES) == set(self_study.SEED_PROMPTS)
    assert set(self_study.DIRECT_TYPES) <= set(SEED_PROMPT_TYPES)
    for seed_type, prompts in self_study.SEED_PROMPTS.items():
        direct = seed_type in self_study.DIRECT_TYPES
        assert prompts and all(("{start}" in p) == direct for p in prompts), seed_type


def test_distill_on_whole_conversations(synthesized, capsys):
    """Self-study data with the teacher's top-k on the user turns (`turn_targets=true`), distilled with
    `targets=conversation`; the same data without them is refused with the setting to use."""
    root, args = synthesized
    out = root / "ss_turns"
    self_study.main([*(a for a in args if not a.startswith(("output=", "num_conversations="))), f"output={out}",
                     "num_conversations=4", "turn_targets=true"])
    rows = datasets.load_from_disk(str(out / "dataset")).to_list()
    assert all(len(r["turn_top_ids"]) == r["answer_start"] - 1 and len(r["turn_top_ids"][0]) == 5 for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["timing_s"]) == {"questions", "answers", "info_kl", "turn_targets", "write"}
    base = [*COMMON, f"corpus.path={root / 'doc.md'}", "num_tokens=8", "steps=2", "pack_len=96", "targets=conversation"]
    distill.main([*base, f"data={out}", f"output={root / 'c_turns'}"])
    assert (root / "c_turns" / "cartridge.safetensors").is_file()
    with pytest.raises(SystemExit):
        distill.main([*base, f"data={root / 'ss'}", f"output={root / 'c_turns_refused'}"])
    assert "targets=conversation needs data synthesized with turn_targets=true" in capsys.readouterr().err
