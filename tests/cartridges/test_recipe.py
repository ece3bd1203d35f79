"""The recipe ablation (experiments/cartridges_recipe/run.py) end to end in its CPU smoke mode, its resume, and
the benchmark document's questions."""

import json
import random
from pathlib import Path

import pytest

from cartridges.corpus import Corpus
from cartridges.eval import is_correct, load_qa
from zoo.pretrained import ByteTokenizer

RECIPE = Path(__file__).resolve().parents[2] / "experiments" / "cartridges_recipe"
ARMS = ["ntp", "hard_labels", "ss"]  # the baselines first


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    from experiments.cartridges_recipe import run

    out = tmp_path_factory.mktemp("recipe")
    return out, run.main(["--smoke", "--out", str(out), "--export", str(out / "export")])


def test_smoke_run_writes_every_arm(smoke):
    out, final = smoke
    arms = [r["arm"] for r in final["rows"]]
    assert arms == ["icl", f"truncated_{final['p']}", "none", *ARMS]
    assert final["p"] == final["context_tokens"] // 14 and not final["incomplete"]
    rows = {r["arm"]: r for r in json.loads((out / "results.json").read_text())}
    for arm in ARMS:
        r = rows[arm]
        assert r["kv_tokens"] == final["p"] and r["n"] == 8 and r["memory_bytes"] > 0 and r["steps"] == 4
        assert r["initial_heldout_kl"] > 0 and r["final_heldout_kl"] >= 0
    assert rows["ss"]["data_info_kl"] > 0 and rows["ntp"]["data_info_kl"] is None
    assert [rows[a]["method"] for a in ARMS] == ["ntp", "hard_labels", "self_study"]
    assert rows["icl"]["n_in_prefix"] == rows["icl"]["n"]
    assert (out / "recipe.png").stat().st_size > 0
    assert set(final["targets"]) >= {"ss_over_truncated", "ss_2x_truncated", "ss_70pct_icl", "ss_gt_hard_gt_ntp"}


@pytest.mark.parametrize("arm", ARMS)
def test_smoke_arms_share_the_training_settings(smoke, arm):
    """Every trained arm runs the same optimiser, schedule, init and frozen count; only the targets differ."""
    out, _ = smoke
    from cartridges.format import read_header

    record = json.loads((out / "export" / "run.json").read_text())["distill"][arm]
    metrics = record["metrics"]
    assert record["summary"]["steps"] == 4 and [m["step"] for m in metrics] == [1, 2, 3, 4]
    # the cosine schedule: full lr at the first step, decaying towards 0 at the last
    assert metrics[0]["lr"] == pytest.approx(2e-2) and metrics[-1]["lr"] < 0.2 * 2e-2
    training = read_header(out / f"c_{arm}" / "cartridge.safetensors")["training_config"]["distill"]
    assert (training["lr_schedule"], training["init"], training["num_frozen"]) == ("cosine", "first_tokens", 0)


def test_smoke_attention_matching_arms(tmp_path):
    """--arms am ss_am: the untrained compaction is evaluated at p beside the baselines, and ss_am trains
    self-study from it (its file records init=attention_matching)."""
    from cartridges.format import read_header
    from experiments.cartridges_recipe import run

    final = run.main(["--smoke", "--out", str(tmp_path), "--arms", "am", "ss_am"])
    rows = {r["arm"]: r for r in final["rows"]}
    assert set(rows) == {"icl", f"truncated_{final['p']}", "none", "am", "ss_am"}
    assert rows["am"]["kv_tokens"] == rows["ss_am"]["kv_tokens"] == final["p"]
    assert read_header(tmp_path / "c_am" / "cartridge.safetensors")["init_method"] == "attention_matching"
    training = read_header(tmp_path / "c_ss_am" / "cartridge.safetensors")["training_config"]["distill"]
    assert (training["method"], training["init"]) == ("self_study", "attention_matching")


def test_smoke_rerun_resumes_without_retraining(smoke):
    from experiments.cartridges_recipe import run

    out, first = smoke
    stamp = {arm: (out / f"c_{arm}" / "cartridge.safetensors").stat().st_mtime_ns for arm in ARMS}
    again = run.main(["--smoke", "--out", str(out)])
    assert {arm: (out / f"c_{arm}" / "cartridge.safetensors").stat().st_mtime_ns for arm in ARMS} == stamp
    assert again["rows"] == first["rows"]


def test_readme_table_is_built_from_an_export(smoke, tmp_path):
    """plot.py --readme fills a run's README block from its exported results.json, and keeps the rest."""
    from experiments.cartridges_recipe import plot

    out, final = smoke
    readme = tmp_path / "README.md"
    readme.write_text("before\n<!-- results:export:start -->\nold\n<!-- results:export:end -->\nafter\n")
    plot.fill_readme(out / "export", readme)
    text = readme.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    assert f"| `ss` | {final['p']} | {final['targets']['best_self_study_accuracy']:.3f} |" in text
    met = "met" if final["targets"]["ss_gt_hard_gt_ntp"] else "unmet"
    assert f"ss > hard_labels > ntp: {met}" in text and text.count("\n| `") == 6


def test_benchmark_questions_are_answerable_and_spread():
    """Every answer of the new document's questions is in the document, and their first places are spread over
    it: each fifth of the document holds at least a tenth of the questions."""
    text = (RECIPE / "document.md").read_text()
    items = load_qa(RECIPE / "qa.json")
    assert len(items) >= 60 and len({it["question"] for it in items}) == len(items)
    places = []
    for it in items:
        assert is_correct(text, it), it
        ends = [n for n in range(0, len(text) + 400, 400) if is_correct(text[:n], it)]
        places.append(ends[0] / len(text))
    fifths = [sum(1 for p in places if i / 5 < p <= (i + 1) / 5 + 1e-9) for i in range(5)]
    assert min(fifths) >= len(items) / 10, fifths


def test_chunks_cover_the_document_edges():
    """Chunk sampling covers the first and last tokens about as often as the middle."""
    text = (RECIPE / "document.md").read_text()
    corpus = Corpus([("doc", text)], ByteTokenizer(), min_tokens=64, max_tokens=512)
    rng = random.Random(0)
    chunks = [corpus.sample_chunk(rng) for _ in range(1000)]
    n = len(corpus.tokens[0])
    counts = [0] * n
    for c in chunks:
        assert 64 <= c.end - c.start <= 512
        for i in range(c.start, c.end):
            counts[i] += 1
    middle = sum(counts[n // 2 - 50 : n // 2 + 50]) / 100
    assert counts[0] > 0.5 * middle and counts[-1] > 0.5 * middle
    assert corpus.coverage(chunks)["uncovered_fraction"] == 0


def test_more_sizes_train_self_study_at_each_size_beside_its_truncation(tmp_path):
    """--more-sizes 4: self-study at p = context // 4 (arm ss_p<p>) on the same conversations, with
    truncated_<p> beside it; the targets stay those of the run's own p."""
    from experiments.cartridges_recipe import run

    final = run.main(["--smoke", "--out", str(tmp_path), "--arms", "ss", "--more-sizes", "4"])
    q = final["context_tokens"] // 4
    rows = {r["arm"]: r for r in final["rows"]}
    assert set(rows) == {"icl", f"truncated_{final['p']}", f"truncated_{q}", "none", "ss", f"ss_p{q}"}
    assert rows[f"ss_p{q}"]["kv_tokens"] == q and rows["ss"]["kv_tokens"] == final["p"]
    assert rows[f"ss_p{q}"]["method"] == "self_study" and rows[f"ss_p{q}"]["lever"][-1] == f"num_tokens={q}"
    assert final["targets"]["best_self_study_arm"] == "ss"


def test_smoke_half_frozen_arm_keeps_the_prefix_half(tmp_path):
    """--arms ss_half_frozen: self-study with the first p/2 tokens frozen at the prefix's KV (its file records
    first-tokens init and num_frozen = p // 2; `ss` beside it freezes none)."""
    from cartridges.format import read_header
    from experiments.cartridges_recipe import run

    final = run.main(["--smoke", "--out", str(tmp_path), "--arms", "ss", "ss_half_frozen"])
    p = final["p"]
    rows = {r["arm"]: r for r in final["rows"]}
    assert rows["ss_half_frozen"]["kv_tokens"] == p and rows["ss_half_frozen"]["method"] == "self_study"
    header = read_header(tmp_path / "c_ss_half_frozen" / "cartridge.safetensors")
    training = header["training_config"]["distill"]
    assert (training["init"], training["num_frozen"], header["num_frozen"]) == ("first_tokens", p // 2, p // 2)
    assert read_header(tmp_path / "c_ss" / "cartridge.safetensors")["num_frozen"] == 0


def test_smoke_closed_arm_and_seed_choice(tmp_path):
    """--arms ss_closed trains self-study from the truncated context's own KV; --seeds picks the conversations'
    seed kinds; a second run with other settings in the same --out stops with a one-line error."""
    from cartridges.format import read_header
    from experiments.cartridges_recipe import run

    final = run.main(["--smoke", "--out", str(tmp_path), "--arms", "ss_closed", "--seeds", "question", "quiz"])
    rows = {r["arm"]: r for r in final["rows"]}
    assert rows["ss_closed"]["method"] == "self_study" and rows["ss_closed"]["kv_tokens"] <= final["p"]
    header = read_header(tmp_path / "c_ss_closed" / "cartridge.safetensors")
    assert header["training_config"]["distill"]["init"] == "truncated_context"
    synth = json.loads((tmp_path / "synth_recipe" / "summary.json").read_text())
    assert set(synth["conversations_by_seed_type"]) == {"question", "quiz"}
    with pytest.raises(SystemExit, match=r"holds a run with other settings \(seeds\)"):
        run.main(["--smoke", "--out", str(tmp_path), "--arms", "ss_closed"])
