"""The commands end to end on the tiny model: self-study -> distillation (with resume) -> evaluation."""

import json

import datasets
import httpx
import pytest

from cartridges import distill, self_study
from cartridges import eval as ceval
from cartridges.cache import Cartridge
from cartridges.clients import ClientError, OpenAIClient
from cartridges.config import ConfigError, load_config
from zoo.pretrained import tiny_llama

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
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and all(r["loss"] >= 0 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    summary = json.loads((root / "straight" / "summary.json").read_text())
    assert summary["memory_bytes"] == a.memory_bytes()
    with pytest.raises(SystemExit):  # the run dir is taken
        distill.main([*base, f"output={root / 'straight'}", "steps=5"])


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
            "truncated_tokens=[100]",
            f"+cartridges.ss={root / 'straight' / 'cartridge.safetensors'}",
            f"output={root / 'eval'}",
        ]
    )
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(results) == {"icl", "truncated_100", "none", "ss"}
    assert results["ss"]["kv_tokens"] == 16 and results["truncated_100"]["kv_tokens"] <= 100
    assert results["icl"]["memory_bytes"] > results["ss"]["memory_bytes"]
    assert all(r["n"] == 2 for r in results.values())


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
