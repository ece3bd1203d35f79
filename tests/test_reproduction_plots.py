"""The reproductions' plot steps end to end on CPU: tiny runs of the paper presets -> `plot.py collect` -> results.json
with one row per run (the fields the figures' data promise), the best lr marked per point, a figure and the
README's comparison block filled."""

import json
import runpy
import shutil
from pathlib import Path

import pytest

from zoo.train import load_config, train

REPO = Path(__file__).resolve().parent.parent
FIELDS = {"mixer", "d_model", "seq_len", "lr", "epochs", "state_bytes", "valid_accuracy", "test_accuracy",
          "test_accuracy_by_slice"}
SEG = "{seq_len:16,num_kv_pairs:2,num_examples:64,batch_size:32}"


@pytest.mark.parametrize("experiment,presets", [
    ("zoology_fig2", ["zoology_fig2/attention", "zoology_fig2/based"]),
    ("based_frontier", ["based_fig2/attention", "based_fig2/based"]),
])
def test_plot_step_writes_results_figure_and_readme(tmp_path, experiment, presets):
    for preset in presets:
        for lr in (1e-3, 1e-2):
            cfg, resolved = load_config([
                f"model={preset}", "model.d_model=16", "data.vocab_size=64", f"data.train=[{SEG}]",
                f"data.valid=[{SEG}]", f"data.test=[{SEG}]", "train.epochs=1", "train.progress=false",
                f"optim.lr={lr}", f"runs_root={tmp_path / 'runs'}", "experiment_name=e",
                f"data.cache_dir={tmp_path / 'cache'}",
            ])
            train(cfg, resolved)
    plot = runpy.run_path(str(REPO / "experiments" / experiment / "plot.py"), run_name="plot")
    assert plot["collect"](tmp_path / "runs" / "e", tmp_path / "summaries") == 4
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(REPO / "experiments" / experiment / "README.md", out / "README.md")
    built = plot["build"](tmp_path / "summaries", out)
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert built["runs"] == len(rows) == 4
    assert all(FIELDS <= set(r) for r in rows)
    assert sum(r["best_lr_by_valid"] for r in rows) == 2  # one run per (model, d_model) point
    assert (out / built["figure"]).stat().st_size > 1000
    readme = (out / "README.md").read_text()
    block = readme.split(plot["START"], 1)[1].split(plot["END"], 1)[0]
    assert "| verdict |" in block


@pytest.mark.parametrize(
    ("experiment", "extra", "message"),
    [("zoology_fig2_launched", "model.mlp=tanh", "launched models"),
     ("zoology_fig2_seeds", "train.seed=1", "a run of another seed")],
    ids=["launched", "other-seeds"],
)
def test_fig2_collect_refuses_runs_outside_the_figure(tmp_path, experiment, extra, message):
    """ZOO_FIG2_MODELS=launched runs (experiment zoology_fig2_launched) and the SEEDS checks' runs of seeds other than
    0 (zoology_fig2_seeds) stay out of the config figure's summaries."""
    cfg, resolved = load_config([
        "model=zoology_fig2/attention", "model.d_model=16", extra, "data.vocab_size=64",
        f"data.train=[{SEG}]", f"data.valid=[{SEG}]", f"data.test=[{SEG}]", "train.epochs=1", "train.progress=false",
        f"runs_root={tmp_path / 'runs'}", f"experiment_name={experiment}", f"data.cache_dir={tmp_path / 'c'}",
    ])
    train(cfg, resolved)
    plot = runpy.run_path(str(REPO / "experiments" / "zoology_fig2" / "plot.py"), run_name="plot")
    with pytest.raises(SystemExit, match=message):
        plot["collect"](tmp_path / "runs" / experiment, tmp_path / "summaries")
    assert not (tmp_path / "summaries").exists()
    with pytest.raises(SystemExit, match=message):  # the runs root: the run lies two levels down
        plot["collect"](tmp_path / "runs", tmp_path / "summaries")
    assert not (tmp_path / "summaries").exists()


def test_collect_keeps_one_summary_per_run_across_renames(tmp_path):
    """A run collected again under another name (its hash changed with the code) replaces its earlier summary
    instead of adding a second row; a run of another lr is kept beside it."""
    from zoo.plot import copy_summaries

    def run(lr, root):
        cfg, resolved = load_config([
            "model=zoology_fig2/attention", "model.d_model=16", "data.vocab_size=64", f"data.train=[{SEG}]",
            f"data.valid=[{SEG}]", f"data.test=[{SEG}]", "train.epochs=1", "train.progress=false",
            f"optim.lr={lr}", f"runs_root={root}", "experiment_name=e", f"data.cache_dir={tmp_path / 'cache'}",
        ])
        train(cfg, resolved)

    run(1e-3, tmp_path / "a")
    run(1e-2, tmp_path / "a")
    out = tmp_path / "summaries"
    assert copy_summaries(tmp_path / "a" / "e", out) == 2
    (old,) = [p for p in out.glob("*.json") if json.loads(p.read_text())["lr"] == 1e-3]
    renamed = old.with_name("attention-d16-lr0.001-s0-00000000.json")  # as if named by an earlier hash
    old.rename(renamed)
    assert copy_summaries(tmp_path / "a" / "e", out) == 2
    assert sorted(p.name for p in out.glob("*.json")) == sorted([old.name, *(p.name for p in out.glob("*lr0.01*"))])
    assert not renamed.exists()


def _frontier_summary(layers, state_size, slices):
    return {"run": "r", "layers": layers, "d_model": 64, "lr": 1e-3, "epochs": 1, "state_bytes_seq_len": 256,
            "state_bytes_fp32": 4 * state_size["256"], "state_size": state_size, "valid/accuracy": 0.5,
            **{f"test/accuracy/seq_len={L}": 0.5 for L in slices}, "test/accuracy": 0.5}


def test_frontier_state_is_read_at_the_longest_test_length():
    """Zoology logs a model's state at max(test input_seq_len): attention's KV at L=1024, not the training 256."""
    plot = runpy.run_path(str(REPO / "experiments" / "based_frontier" / "plot.py"), run_name="plot")
    sizes = {"64": 10, "256": 40, "1024": 160}
    (row,) = plot["rows"]([_frontier_summary(["short_conv", "attention"], sizes, [64, 256, 1024])])
    assert (row["seq_len"], row["state_bytes"]) == (1024, 640)


def test_frontier_refuses_a_run_without_its_test_length_state():
    plot = runpy.run_path(str(REPO / "experiments" / "based_frontier" / "plot.py"), run_name="plot")
    with pytest.raises(ValueError, match="no state_size at its test length 1024"):
        plot["rows"]([_frontier_summary(["short_conv", "attention"], {"64": 10, "256": 40}, [64, 1024])])


def test_learning_curve_has_one_row_per_evaluation():
    """Training losses are averaged between evaluations; an evaluation with none before it gets None."""
    from zoo.plot import learning_curve

    metrics = [
        {"epoch": 0, "step": 1, "train/loss": 4.0},
        {"epoch": 0, "step": 2, "train/loss": 2.0},
        {"epoch": 1, "step": 2, "valid/accuracy": 0.25, "valid/loss": 1.5},
        {"epoch": 2, "step": 4, "valid/accuracy": 0.5, "valid/loss": 3.0},
        {"epoch": 2, "step": 5, "train/loss": 0.5},
    ]
    assert learning_curve(metrics) == {"epoch": [1, 2], "step": [2, 4], "train_loss": [3.0, None],
                                       "valid_loss": [1.5, 3.0], "valid_accuracy": [0.25, 0.5]}


def test_collected_summary_holds_the_learning_curve(tmp_path):
    """`collect` commits each run's curve: one row per epoch's evaluation, as its metrics.jsonl logged them."""
    from zoo.plot import copy_summaries
    from zoo.runs import RunDir

    cfg, resolved = load_config([
        "model=zoology_fig2/attention", "model.d_model=16", "data.vocab_size=64", f"data.train=[{SEG}]",
        f"data.valid=[{SEG}]", f"data.test=[{SEG}]", "train.epochs=3", "train.progress=false", "train.log_every=1",
        f"runs_root={tmp_path / 'runs'}", "experiment_name=e", f"data.cache_dir={tmp_path / 'cache'}",
    ])
    summary = train(cfg, resolved)
    assert copy_summaries(tmp_path / "runs" / "e", tmp_path / "out") == 1
    curve = json.loads((tmp_path / "out" / f"{summary['run']}.json").read_text())["curve"]
    evals = [r for r in RunDir(tmp_path / "runs" / "e" / summary["run"]).read_metrics() if "valid/accuracy" in r]
    assert curve["epoch"] == [r["epoch"] for r in evals] and len(evals) == 3
    assert curve["valid_accuracy"] == [round(r["valid/accuracy"], 5) for r in evals]
    assert all(loss is not None and loss > 0 for loss in curve["train_loss"])


def _launched_summary(directory: Path, run: str, layers: list[str], lr: float, valid: float, test: float) -> None:
    (directory / run).mkdir(parents=True)
    (directory / run / "summary.json").write_text(json.dumps({
        "run": run, "layers": layers, "d_model": 64, "state_bytes_seq_len": 128, "lr": lr, "epochs": 64,
        "state_bytes_fp32": 1, "valid/accuracy": valid, "test/accuracy": test}))


def test_fig2_launched_points_map_the_launched_stacks_to_their_presets(tmp_path):
    """The launched models' check runs become figure markers: BaseConv's 8-layer stack is base_conv and H3's 4
    layers h3, each at its best lr by valid (reporting test); a stack of another kind is refused."""
    plot = runpy.run_path(str(REPO / "experiments" / "zoology_fig2" / "plot.py"), run_name="plot")
    stack = ["short_conv", "short_conv", "long_conv", "long_conv"] * 2
    _launched_summary(tmp_path, "bc-a", stack, 1e-2, valid=0.48, test=0.47)
    _launched_summary(tmp_path, "bc-b", stack, 1e-3, valid=0.10, test=0.52)
    _launched_summary(tmp_path, "h3-a", ["h3"] * 4, 1e-2, valid=0.3, test=0.31)
    (tmp_path / "cut").mkdir()  # a run cut before its end: no summary, left out
    got = plot["launched_points"](tmp_path)
    assert set(got) == {(128, "base_conv", 64), (128, "h3", 64)}
    assert got[(128, "base_conv", 64)]["test_accuracy"] == 0.47
    _launched_summary(tmp_path, "odd", ["short_conv", "based"], 1e-2, valid=0.9, test=0.9)
    with pytest.raises(ValueError, match="not one of the launched models'"):
        plot["launched_points"](tmp_path)


def test_fig2_committed_launched_checks_are_read():
    """The committed checks hold the launched BaseConv at L = 64, d = 512 (it stopped at 0.99)."""
    plot = runpy.run_path(str(REPO / "experiments" / "zoology_fig2" / "plot.py"), run_name="plot")
    assert plot["launched_points"]()[(64, "base_conv", 512)]["test_accuracy"] > 0.98


def test_fig2_line_breaks_where_a_d_model_has_not_run():
    plot = runpy.run_path(str(REPO / "experiments" / "zoology_fig2" / "plot.py"), run_name="plot")
    best = {(128, "hyena", 128): {"test_accuracy": 0.7}, (128, "hyena", 512): {"test_accuracy": 0.9},
            (128, "attention", 256): {"test_accuracy": 1.0}, (64, "hyena", 256): {"test_accuracy": 0.5}}
    ds, ys = plot["model_line"](best, 128, "hyena")
    assert ds == [128, 256, 512]
    assert ys[0] == 0.7 and ys[2] == 0.9 and ys[1] != ys[1]  # NaN at 256: a gap
    assert plot["model_line"](best, 128, "h3") == ([], [])


@pytest.mark.parametrize("argv,message", [
    (["collect", "no-such-runs-dir"], "no runs dir at no-such-runs-dir"),
    (["collect"], "usage: plot.py collect"),
    (["draw"], "usage: plot.py [collect"),
])
def test_plot_command_line_refuses_bad_arguments(tmp_path, argv, message):
    """`plot.py collect` with a mistyped runs dir stops with one line instead of reporting 0 summaries copied."""
    from zoo.plot import reproduction_main

    def never(*args):
        raise AssertionError("nothing may be collected or built")

    with pytest.raises(SystemExit, match=message.replace("[", r"\[")):
        reproduction_main(argv, tmp_path / "summaries", never, never)
    assert not (tmp_path / "summaries").exists()
