"""zoo-sweep and zoo-plot on CPU: a 4-config sweep runs, a re-run skips them, a bad config fails alone, the
plot gets written."""

import json
import shlex
from pathlib import Path

import pytest
from tiny_run import SEGMENT, TINY_DATA, TINY_MODEL

from zoo.jobs import error_line
from zoo.plot import best_lr_points, frontier, make_figures
from zoo.sweep import load_sweep, main, run_sweep

TINY = [
    *TINY_MODEL,
    *TINY_DATA[:2],
    f"data.test=[{SEGMENT % 32},{{seq_len:32,num_kv_pairs:4,num_examples:32,batch_size:32}}]",
    "train.epochs=1",
    "train.early_stop=null",
]
GRID = [[f"model={m}", f"optim.lr={lr}"] for m in ("based", "attention") for lr in ("1e-3", "3e-3")]


def test_sweep_runs_skips_and_isolates_failures(tmp_path):
    extra = TINY + ["experiment_name=t", f"data.cache_dir={tmp_path / 'cache'}"]
    first = run_sweep(GRID, "t", workers=1, device="cpu", extra=extra, runs_root=str(tmp_path))
    assert (first["finished"], first["skipped"], first["failed"]) == (4, 0, 0)
    dirs = {r["run_dir"] for r in first["runs"]}
    assert len(dirs) == 4 and all((Path(d) / "summary.json").exists() for d in dirs)

    bad_config = ["model=based", "optim.lr=-1"]  # rejected when composed
    # A valid config that raises in training: Hyena's history is shorter than the sequences.
    bad_run = ["model=hyena", "model.mixers.hyena.max_seq_len=8"]
    second = run_sweep(GRID + [bad_config, bad_run], "t", workers=1, device="cpu", extra=extra, runs_root=str(tmp_path))
    # the second call skips the 4 runs; the sweep's record keeps them as the first call finished them
    assert (second["calls"][1]["skipped"], second["calls"][1]["failed"]) == (4, 2)
    assert second["runs"][:4] == first["runs"]
    statuses = [r["status"] for r in second["runs"]]
    assert statuses == ["finished"] * 4 + ["failed", "failed"]
    assert "optim.lr must be > 0" in second["runs"][4]["error"]
    error_txt = Path(second["runs"][5]["run_dir"]) / "error.txt"
    assert "exceed max_seq_len=8" in error_txt.read_text()
    record = json.loads((tmp_path / "_sweeps" / "t.json").read_text())
    assert record["failed"] == 2 and record["finished"] == 4 and record["skipped"] == 0

    out = make_figures(tmp_path / "t", tmp_path / "fig")
    assert (tmp_path / "fig" / "accuracy_vs_state.png").stat().st_size > 1000
    assert (tmp_path / "fig" / "accuracy_vs_d_model.png").stat().st_size > 1000
    on_disk = json.loads((tmp_path / "fig" / "summary.json").read_text())
    assert on_disk["num_runs"] == 4 and len(on_disk["points"]) == 2 == len(out["points"])
    assert {p["mixer"] for p in on_disk["points"]} == {"base_conv+based", "attention"}
    assert all(p["lrs_tried"] == [0.001, 0.003] for p in on_disk["points"])
    assert all(set(p["test_slices"]) >= {"seq_len=16", "seq_len=32"} for p in on_disk["points"])


def test_sweep_files_python_and_yaml(tmp_path):
    py = tmp_path / "s.py"
    py.write_text(
        "def sweep():\n"
        "    return [['model=based'], {'model': 'attention', 'optim.lr': 0.01, 'train.early_stop': None}]\n"
    )
    assert load_sweep(py) == [["model=based"], ["model=attention", "optim.lr=0.01", "train.early_stop=null"]]
    yml = tmp_path / "s.yaml"
    yml.write_text(
        "grids:\n  - base: [model=based]\n    grid: {optim.lr: [1, 2], model.d_model: [8]}\n"
        "  - grid: {model: [attention]}\n"
    )
    assert load_sweep(yml) == [
        ["model=based", "optim.lr=1", "model.d_model=8"],
        ["model=based", "optim.lr=2", "model.d_model=8"],
        ["model=attention"],
    ]
    yml.write_text("grid: {optim.lr: []}\n")
    with pytest.raises(ValueError, match="non-empty list"):
        load_sweep(yml)
    yml.write_text("grid: {optim.lr: [1]}\nbases: []\n")
    with pytest.raises(ValueError, match="unknown keys"):
        load_sweep(yml)


def test_repo_sweep_files_compose(capsys):
    """Every committed sweep file loads and each of its runs composes into a valid config (nothing runs)."""
    from zoo.train import load_config

    repo = Path(__file__).resolve().parents[1]
    experiments = [repo / "experiments" / name / "sweep.py" for name in ("zoology_fig2", "based_frontier")]
    files = sorted(repo.glob("zoo/configs/sweep/*.yaml")) + experiments
    assert files
    for path in files:
        runs = load_sweep(path)
        # one run per preset and set of overridden keys (a preset-specific override composes too), plus a stride
        kinds = {}
        for run in runs:
            keys = frozenset(arg.split("=", 1)[0] for arg in run)
            preset = next((arg for arg in run if arg.startswith("model=")), "")
            kinds.setdefault((preset, keys), run)
        for run in [*kinds.values(), *runs[:: max(1, len(runs) // 8)]]:
            load_config(run)
    main([str(repo / "zoo/configs/sweep/tiny.yaml"), "--emit"])
    assert capsys.readouterr().out.count("zoo-train ") == len(load_sweep(repo / "zoo/configs/sweep/tiny.yaml"))
    # --pack-lrs --emit: one zoo-train per group of runs differing only in optim.lr (4 lrs per Fig. 2 point).
    fig2 = repo / "experiments/zoology_fig2/sweep.py"
    main([str(fig2), "--emit", "--pack-lrs"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(load_sweep(fig2)) // 4 and all("train.pack_lrs=[" in line for line in lines)
    cfg, _ = load_config(shlex.split(lines[0])[1:])
    assert len(cfg.train.pack_lrs) == 4


def test_emit_pack_seeds_writes_one_command_per_full_product(tmp_path, capsys):
    """--pack-seeds --emit: a group over seeds and lrs that is a full product is one zoo-train with pack_seeds and
    pack_lrs; a group that is not (a missing pair) splits into its lr packs."""
    path = tmp_path / "s.py"
    path.write_text(
        "def sweep():\n"
        "    full = [{'model': 'based', 'optim.lr': lr, 'train.seed': s} for s in (1, 2) for lr in (1e-3, 1e-2)]\n"
        "    part = [{'model': 'attention', 'optim.lr': lr, 'train.seed': s} for s, lr in ((1, 1e-3), (1, 1e-2),"
        " (2, 1e-3))]\n"
        "    return full + part\n"
    )
    from zoo.train import load_config

    main([str(path), "--emit", "--pack-seeds"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    cfg, _ = load_config(shlex.split(lines[0])[1:])
    assert (cfg.train.pack_seeds, cfg.train.pack_lrs) == ([1, 2], [1e-3, 1e-2])
    assert "train.pack_seeds" not in lines[1] and "train.seed=1" in lines[1]
    assert "train.pack_lrs=[0.001,0.01]" in lines[1]
    assert "train.pack_lrs" not in lines[2] and "train.seed=2" in lines[2]


def test_emit_splits_a_pack_whose_run_names_no_lr():
    """A run without optim.lr= (the config's default) cannot be listed in train.pack_lrs: its group goes run by run."""
    from zoo.jobs import emit_jobs

    runs = [["model=based", "optim.lr=1e-3"], ["model=based"], ["model=attention", "optim.lr=1e-3"],
            ["model=attention", "optim.lr=1e-2"]]
    assert emit_jobs(runs, seeds=False) == [[0], [1], [2, 3]]


WIDE_CASES = {  # run overrides -> whether a pack of its two lrs splits under --pack-max-d 32
    "d_model above the limit": (["model=based", "model.d_model=64"], True),
    "d_model at the limit": (["model=based", "model.d_model=32"], False),
    "the preset's d_model (64), from the composed config": (["model=based"], True),
    "an interpolation, from the composed config": (["model=based", "model.d_model=${model.vocab_size}"], True),
}


@pytest.mark.parametrize("case", WIDE_CASES)
def test_pack_max_d_splits_only_packs_wider_than_the_limit(case):
    from zoo.jobs import lr_groups, unpack_wide

    run, splits = WIDE_CASES[case]
    runs = [[*run, f"optim.lr={lr}"] for lr in ("1e-3", "1e-2")] + [["model=attention", "optim.lr=1e-3"]]
    jobs = lr_groups(runs)
    assert unpack_wide(jobs, runs, [], 32) == ([[0], [1], [2]] if splits else [[0, 1], [2]])
    assert unpack_wide(jobs, runs, [], 0) == [[0, 1], [2]], "0 packs every width"


def test_pack_max_d_takes_the_sweeps_own_overrides_last():
    """An override given to every run (`zoo-sweep FILE model.d_model=16`) comes after the run's own."""
    from zoo.jobs import unpack_wide

    runs = [["model=based", "model.d_model=64", f"optim.lr={lr}"] for lr in ("1e-3", "1e-2")]
    assert unpack_wide([[0, 1]], runs, ["model.d_model=16"], 32) == [[0, 1]]


def test_dry_run_counts_the_jobs_a_packed_sweep_would_start(tmp_path, monkeypatch, capsys):
    """--dry-run --pack-lrs [--pack-max-d 256] over L = 128's H3 at d = 256 (committed) and 512 (todo)."""
    import shutil

    repo = Path(__file__).resolve().parents[1]
    for path in (repo / "experiments/zoology_fig2/summaries").glob("h3-d256-*.json"):
        if json.loads(path.read_text())["state_bytes_seq_len"] == 128:
            shutil.copy(path, tmp_path)
    monkeypatch.setenv("ZOO_FIG2", "L128")
    monkeypatch.setenv("POINTS", "h3:256,h3:512")
    args = [str(repo / "experiments/zoology_fig2/sweep.py"), "--dry-run", "--pack-lrs", "--skip-summaries",
            str(tmp_path), "--runs-root", str(tmp_path / "runs")]
    main([*args, "--pack-max-d", "256"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("8 runs: 4 committed, 4 todo")
    assert lines[-1] == "4 jobs to start: 0 packs of 0 runs, 4 single runs"
    main(args)
    assert capsys.readouterr().out.splitlines()[-1] == "1 job to start: 1 pack of 4 runs, 0 single runs"


def test_emit_pack_max_d_writes_wide_runs_one_per_command(monkeypatch, capsys):
    repo = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("ZOO_FIG2", "L128")
    monkeypatch.setenv("POINTS", "h3:256,h3:512")
    main([str(repo / "experiments/zoology_fig2/sweep.py"), "--emit", "--pack-lrs", "--pack-max-d", "256"])
    lines = capsys.readouterr().out.splitlines()
    packs = [line for line in lines if "train.pack_lrs=[" in line]
    assert len(packs) == 1 and "model.d_model=256" in packs[0]
    assert len(lines) == 5 and all("model.d_model=512" in line for line in lines if line not in packs)


PACK_MAX_D_ERRORS = {
    "below zero": (["--pack-lrs", "--pack-max-d", "-1"], r"^zoo-sweep: --pack-max-d must be >= 0, got -1$"),
    "without packing": (["--pack-max-d", "256"], r"^zoo-sweep: --pack-max-d limits packing: pass it with "),
}


@pytest.mark.parametrize("case", PACK_MAX_D_ERRORS)
def test_pack_max_d_misuse_is_one_line_error(case):
    flags, message = PACK_MAX_D_ERRORS[case]
    with pytest.raises(SystemExit, match=message):
        main(["zoo/configs/sweep/tiny.yaml", *flags])


def test_sweep_pack_max_d_trains_wide_runs_unpacked(tmp_path):
    extra = TINY + ["experiment_name=w", f"data.cache_dir={tmp_path / 'cache'}"]
    runs = [["model=attention", f"model.d_model={d}", f"optim.lr={lr}"] for d in (8, 16) for lr in ("1e-3", "3e-3")]
    record = run_sweep(runs, "w", device="cpu", extra=[e for e in extra if not e.startswith("model.d_model")],
                       runs_root=str(tmp_path), pack_lrs=True, pack_max_d=8)
    assert [r["status"] for r in record["runs"]] == ["finished"] * 4
    assert [r.get("packed") for r in record["runs"]] == [2, 2, None, None]


def test_frontier_data_are_the_configs(monkeypatch):
    """Based Fig. 2's config: random filler in every segment (its MQARConfigs keep Zoology's default
    random_non_queries=True) and Zoology's fixed batch order."""
    from zoo.train import load_config

    monkeypatch.setenv("MODELS", "based")
    monkeypatch.setenv("D", "48")
    runs = load_sweep(Path(__file__).resolve().parents[1] / "experiments/based_frontier/sweep.py")
    cfg, _ = load_config(runs[0])
    assert cfg.train.batch_order == "fixed"
    for split in ("train", "valid", "test"):
        assert all(seg.random_non_queries for seg in getattr(cfg.data, split)), split


def test_frontier_keeps_only_improvements():
    runs = [
        {
            "layers": ["a"],
            "d_model": 8,
            "state_bytes_fp32": 10,
            "lr": 1e-3,
            "valid/accuracy": 0.5,
            "test/accuracy": 0.4,
            "run_dir": "x",
        },
        {
            "layers": ["a"],
            "d_model": 8,
            "state_bytes_fp32": 10,
            "lr": 1e-2,
            "valid/accuracy": 0.6,
            "test/accuracy": 0.3,
            "run_dir": "y",
        },
        {
            "layers": ["b"],
            "d_model": 8,
            "state_bytes_fp32": 20,
            "lr": 1e-3,
            "valid/accuracy": 0.2,
            "test/accuracy": 0.2,
            "run_dir": "z",
        },
        {
            "layers": ["b"],
            "d_model": 16,
            "state_bytes_fp32": 40,
            "lr": 1e-3,
            "valid/accuracy": 0.9,
            "test/accuracy": 0.9,
            "run_dir": "w",
        },
    ]
    points = best_lr_points(runs)
    a = next(p for p in points if p["mixer"] == "a")
    assert a["lr"] == 1e-2 and a["test_accuracy"] == 0.3, "lr is chosen on validation, not test"
    assert [(f["state_bytes_fp32"], f["test_accuracy"]) for f in frontier(points)] == [(10, 0.3), (40, 0.9)]
    # The same constant state trained at another length is another point, not another lr to choose from.
    other_length = dict(runs[0], state_bytes_seq_len=64, **{"valid/accuracy": 0.99})
    assert len(best_lr_points([*runs, other_length])) == len(points) + 1


def test_sweep_pack_lrs_trains_each_lr_group_as_one_pack(tmp_path):
    from zoo.jobs import lr_groups

    extra = TINY + ["experiment_name=p", f"data.cache_dir={tmp_path / 'cache'}"]
    # A group that cannot pack (impl=fla has no vmap rule) runs unpacked and says why.
    fla = [["model=based", "+model.mixers.based.impl=fla", f"optim.lr={lr}"] for lr in ("1e-3", "3e-3")]
    assert lr_groups(GRID + fla) == [[0, 1], [2, 3], [4, 5]]
    first = run_sweep(GRID + fla, "p", device="cpu", extra=extra, runs_root=str(tmp_path), pack_lrs=True)
    packed, unpacked = first["runs"][:4], first["runs"][4:]
    assert [r["status"] for r in packed] == ["finished"] * 4 and all(r["packed"] == 2 for r in packed)
    assert all("impl=fla" in r["unpacked"] for r in unpacked)
    summaries = [json.loads((Path(r["run_dir"]) / "summary.json").read_text()) for r in packed]
    assert [s["pack_size"] for s in summaries] == [2] * 4 and [s["lr"] for s in summaries] == [1e-3, 3e-3] * 2
    # The packed runs sit in the unpacked runs' dirs: an unpacked re-run skips them all.
    second = run_sweep(GRID, "p", device="cpu", extra=extra, runs_root=str(tmp_path))
    assert second["calls"][1]["skipped"] == 4 and second["runs"] == packed


def test_sweep_pack_seeds_trains_each_point_over_lrs_and_seeds_as_one_pack(tmp_path):
    from zoo.jobs import lr_groups

    # the runs set their training data: extra overrides come after a run's own
    extra = [o for o in TINY if not o.startswith("data.train=")]
    extra += ["experiment_name=s", f"data.cache_dir={tmp_path / 'cache'}"]
    seeded = [["model=attention", f"optim.lr={lr}", f"train.seed={seed}", TINY_DATA[0]]
              for seed in (0, 1) for lr in ("1e-3", "3e-3")]
    # a mixture of two training segments: its seeds cannot share a step, so it packs per seed
    mixture = ["data.train=[{seq_len:16,num_kv_pairs:2,num_examples:32,batch_size:16},"
               "{seq_len:32,num_kv_pairs:4,num_examples:32,batch_size:16}]"]
    mixed = [["model=based", f"optim.lr={lr}", f"train.seed={seed}", *mixture] for seed in (0, 1) for lr in ("1e-3",)]
    assert lr_groups(seeded + mixed) == [[0, 1], [2, 3], [4], [5]]
    assert lr_groups(seeded + mixed, seeds=True) == [[0, 1, 2, 3], [4, 5]]
    record = run_sweep(seeded + mixed, "s", device="cpu", extra=extra, runs_root=str(tmp_path), pack_seeds=True)
    assert [r["status"] for r in record["runs"]] == ["finished"] * 6
    assert [r.get("packed") for r in record["runs"][:4]] == [4] * 4
    assert all("one training segment" in r["packed_by_seed"] for r in record["runs"][4:])
    summaries = [json.loads((Path(r["run_dir"]) / "summary.json").read_text()) for r in record["runs"]]
    assert [(s["lr"], s["seed"]) for s in summaries[:4]] == [(1e-3, 0), (3e-3, 0), (1e-3, 1), (3e-3, 1)]


def test_shard_takes_every_nth_lr_group_and_rejects_bad_specs():
    from zoo.sweep import shard

    grid = [[f"model={m}", f"model.d_model={d}", f"optim.lr={lr}"]
            for m in ("based", "attention") for d in (16, 32) for lr in ("1e-3", "3e-3")]
    # four lr groups (model, d); shard 1/2 is the second and the fourth, each with both lrs
    assert shard(grid, "1/2") == grid[2:4] + grid[6:8]
    assert sorted(map(tuple, shard(grid, "0/2") + shard(grid, "1/2"))) == sorted(map(tuple, grid))
    for bad in ("2/2", "x", "1/0"):
        with pytest.raises(SystemExit, match="--shard must be I/N"):
            shard(grid, bad)


def test_record_is_rewritten_after_every_job(tmp_path, monkeypatch):
    """A sweep stopped after its first job keeps a record: that run finished, the others pending."""
    import zoo.sweep as sweep_mod

    real, calls = sweep_mod.run_job, []

    def stop_after_one(runs, extra):
        if calls:
            raise KeyboardInterrupt
        calls.append(runs)
        return real(runs, extra)

    monkeypatch.setattr(sweep_mod, "run_job", stop_after_one)
    extra = TINY + ["experiment_name=t", f"data.cache_dir={tmp_path / 'cache'}"]
    with pytest.raises(KeyboardInterrupt):
        run_sweep(GRID[:3], "t", workers=1, device="cpu", extra=extra, runs_root=str(tmp_path))
    record = json.loads((tmp_path / "_sweeps" / "t.json").read_text())
    assert [r["status"] for r in record["runs"]] == ["finished", "pending", "pending"]
    assert (record["finished"], record["pending"]) == (1, 2)


def test_worker_gpu_is_taken_from_the_visible_devices():
    """A worker of a sweep started under CUDA_VISIBLE_DEVICES=1 (cuda:0 in the sweep) must stay on GPU 1."""
    from zoo.gpus import visible_device

    assert visible_device(0, {"CUDA_VISIBLE_DEVICES": "1"}) == "1"
    assert visible_device(1, {"CUDA_VISIBLE_DEVICES": "2, 3"}) == "3"
    assert visible_device(1, {}) == "1"
    assert visible_device(0, {"CUDA_VISIBLE_DEVICES": ""}) == "0"
    with pytest.raises(ValueError, match="not among"):
        visible_device(2, {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_frontier_sweep_picks_gated_deltanet_impl_by_machine(monkeypatch):
    """experiments/based_frontier/sweep.py: FLA's Gated DeltaNet on machines where FLA runs its backward, the
    chunked PyTorch form on a Hopper GPU with Triton < 3.7.1 (where FLA refuses it), the token loop in the tiny
    CPU grid."""
    import runpy

    import torch
    import triton

    repo = Path(__file__).resolve().parents[1]
    module = runpy.run_path(str(repo / "experiments/based_frontier/sweep.py"))

    def gdn_impls(grid):
        monkeypatch.setenv("ZOO_FRONTIER", grid)
        runs = module["sweep"]()
        return {r["+model.mixers.gated_deltanet.impl"] for r in runs if r["model"].endswith("gated_deltanet")}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, version, expected in [((9, 0), "3.6.0", "chunk"), ((9, 0), "3.7.1", "fla"),
                                          ((8, 0), "3.6.0", "fla"), ((9, 0), "3.10.0+git1", "fla"),
                                          ((9, 0), "3.7.0rc1", "chunk")]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=capability: c)
        monkeypatch.setattr(triton, "__version__", version)
        assert gdn_impls("reduced") == {expected}, (capability, version)
    assert gdn_impls("tiny") == {"naive"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gdn_impls("full") == {"fla"}


@pytest.mark.parametrize(
    ("message", "want"),
    [("stride 64==1 at dim=0\nError in op: x\nSee https://docs", "AssertionError: stride 64==1 at dim=0"),
     ("\n\n  first\nlast", "AssertionError: first"), ("", "AssertionError")],
    ids=["footer-last", "leading-blank", "empty"],
)
def test_a_failed_run_is_recorded_by_its_exception_and_first_line(message, want):
    assert error_line(AssertionError(message)) == want


FIG2_SELECTIONS = {
    "all": ({}, 7 * 4 * 4),
    "mixers": ({"MIXERS": "attention,base_conv"}, 2 * 4 * 4),
    "d": ({"D": "256"}, 7 * 4),
    "lrs": ({"LRS": "1e-4,0.01", "MIXERS": "attention", "D": "512"}, 2),
    "points": ({"POINTS": "h3:64, base_conv:512"}, 2 * 4),
    "points-and-mixers": ({"POINTS": "h3:64,base_conv:512", "MIXERS": "h3,attention"}, 4),
    "seeds": ({"POINTS": "h3:64", "LRS": "2.154e-3,1e-2", "SEEDS": "2,1"}, 2 * 2),
}


@pytest.mark.parametrize("name", FIG2_SELECTIONS)
def test_fig2_selectors_pick_their_runs(name, monkeypatch):
    """MIXERS, D and LRS select the Fig. 2 runs they name, at the L=64 panel."""
    env, count = FIG2_SELECTIONS[name]
    monkeypatch.setenv("ZOO_FIG2", "L64")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    runs = load_sweep(Path(__file__).resolve().parents[1] / "experiments/zoology_fig2/sweep.py")
    assert len(runs) == count
    if name == "lrs":
        assert sorted(o for r in runs for o in r if o.startswith("optim.lr=")) == ["optim.lr=0.0001", "optim.lr=0.01"]
    if name == "seeds":
        seeds = [[o for o in r if o.startswith(("train.seed=", "experiment_name="))] for r in runs]
        assert [sorted(s) for s in seeds] == [["experiment_name=zoology_fig2_seeds", f"train.seed={k}"]
                                              for k in (1, 1, 2, 2)]
        from zoo.jobs import lr_groups

        assert lr_groups(runs, seeds=True) == [[0, 1, 2, 3]]  # one pack under --pack-seeds
    if name.startswith("points"):
        points = {(next(o for o in r if o.startswith("model=")), next(o for o in r if o.startswith("model.d_model=")))
                  for r in runs}
        want = {("model=zoology_fig2/h3", "model.d_model=64"), ("model=zoology_fig2/base_conv", "model.d_model=512")}
        assert points == (want if name == "points" else {("model=zoology_fig2/h3", "model.d_model=64")})


def test_fig2_seeds_that_are_not_integers_are_refused(monkeypatch):
    monkeypatch.setenv("ZOO_FIG2", "L64")
    monkeypatch.setenv("SEEDS", "1,x")
    with pytest.raises(ValueError, match="SEEDS must be a comma list of integers"):
        load_sweep(Path(__file__).resolve().parents[1] / "experiments/zoology_fig2/sweep.py")


@pytest.mark.parametrize("value", ["h3", "h3:x", "gla:64", "h3:0"])
def test_fig2_points_that_are_not_preset_and_width_are_refused(value, monkeypatch):
    monkeypatch.setenv("ZOO_FIG2", "L64")
    monkeypatch.setenv("POINTS", value)
    with pytest.raises(ValueError, match="POINTS: .* is not preset:d_model"):
        load_sweep(Path(__file__).resolve().parents[1] / "experiments/zoology_fig2/sweep.py")


@pytest.mark.parametrize("env", [{"POINTS": "mamba:100"}, {"POINTS": "h3:64", "MIXERS": "attention"}],
                         ids=["width-off-grid", "preset-not-selected"])
def test_fig2_points_that_match_no_run_say_so(env, monkeypatch):
    monkeypatch.setenv("ZOO_FIG2", "L64")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"POINTS: .* match no run of this selection \(its d_model: \[64"):
        load_sweep(Path(__file__).resolve().parents[1] / "experiments/zoology_fig2/sweep.py")


@pytest.mark.parametrize(
    ("mixer", "layers", "mlp", "batch"),
    [("attention", ["attention"] * 2, "tanh", 256), ("rwkv", ["rwkv4"] * 2, "tanh", 1024),
     ("hyena", ["hyena"] * 2, "tanh", 1024), ("h3", ["h3"] * 4, "none", 1024),
     ("base_conv", ["short_conv", "short_conv", "long_conv", "long_conv"] * 2, "none", 1024)],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_fig2_launched_models_are_the_published_figures(mixer, layers, mlp, batch, monkeypatch):
    """ZOO_FIG2_MODELS=launched: the models and trainer of the runs behind Zoology's published Fig. 2."""
    from zoo.train import load_config

    monkeypatch.setenv("ZOO_FIG2", "L128")
    monkeypatch.setenv("ZOO_FIG2_MODELS", "launched")
    monkeypatch.setenv("MIXERS", f"{mixer},based,mamba")  # Based and Mamba are not in that figure
    monkeypatch.setenv("D", "64")
    runs = load_sweep(Path(__file__).resolve().parents[1] / "experiments/zoology_fig2/sweep.py")
    assert len(runs) == 4
    cfg, _ = load_config([o for o in runs[0] if not o.startswith("+model.mixers.rwkv4.impl")])
    assert (cfg.model.layers(), cfg.model.mlp, cfg.data.train[0].batch_size) == (layers, mlp, batch)
    assert (cfg.optim.weight_decay, cfg.optim.decay, cfg.optim.schedule, cfg.model.init) == (
        0.01, "all", "cosine_epoch", "zoology")
    assert cfg.experiment_name == "zoology_fig2_launched"
    if mixer == "rwkv":
        assert cfg.model.mixers["rwkv4"]["init_layers"] == 2
    lrs = [float(o.removeprefix("optim.lr=")) for run in runs for o in run if o.startswith("optim.lr=")]
    # the H3 launch at L >= 128 swept logspace(-3.3, -2, 4); the others the grid's logspace(-4, -2, 4)
    assert lrs == ([5.012e-4, 1.359e-3, 3.687e-3, 1e-2] if mixer == "h3" else [1e-4, 4.642e-4, 2.154e-3, 1e-2])


def test_fig2_models_selector_refuses_unknown_values(monkeypatch):
    monkeypatch.setenv("ZOO_FIG2", "L64")
    monkeypatch.setenv("ZOO_FIG2_MODELS", "published")
    with pytest.raises(ValueError, match="ZOO_FIG2_MODELS must be config or launched"):
        load_sweep(Path(__file__).resolve().parents[1] / "experiments/zoology_fig2/sweep.py")


def test_fig2_lrs_off_the_grid_is_refused(monkeypatch):
    monkeypatch.setenv("ZOO_FIG2", "L64")
    monkeypatch.setenv("LRS", "3e-3")
    with pytest.raises(ValueError, match="not in the grid"):
        load_sweep(Path(__file__).resolve().parents[1] / "experiments/zoology_fig2/sweep.py")


@pytest.mark.parametrize("pack_lrs", [False, True])
def test_a_fresh_runs_root_skips_the_committed_summaries(tmp_path, pack_lrs):
    """`--skip-summaries DIR`: on a fresh runs root, the runs whose summary a reproduction committed are skipped
    (no run dir made), whether packed or not; the others train, a pack keeping its uncommitted members."""
    from zoo.plot import copy_summaries

    extra = TINY + ["experiment_name=t", f"data.cache_dir={tmp_path / 'cache'}"]
    run_sweep(GRID[:3], "t", workers=1, device="cpu", extra=extra, runs_root=str(tmp_path / "a"))
    committed = tmp_path / "summaries"
    assert copy_summaries(tmp_path / "a" / "t", committed) == 3
    record = run_sweep(GRID, "t", workers=1, device="cpu", extra=extra, runs_root=str(tmp_path / "b"),
                       pack_lrs=pack_lrs, skip_summaries=[str(committed)])
    assert [r["status"] for r in record["runs"]] == ["skipped"] * 3 + ["finished"]
    assert all(Path(r["summary"]).parent == committed for r in record["runs"][:3])
    assert [p.name for p in (tmp_path / "b" / "t").iterdir()] == [Path(record["runs"][3]["run_dir"]).name]


def test_committed_summary_of_other_data_is_not_skipped(tmp_path, capsys):
    """A committed summary records its data, optimiser and training settings: a sweep whose run has the same point
    but other data (random filler) or another batch order trains it; the same settings skip it; a summary from
    before summaries held their settings skips on its point alone."""
    import json

    from zoo.plot import copy_summaries
    from zoo.sweep import committed_runs

    extra = TINY + ["experiment_name=t", f"data.cache_dir={tmp_path / 'cache'}"]
    run_sweep(GRID[:1], "t", workers=1, device="cpu", extra=extra, runs_root=str(tmp_path / "a"))
    committed = tmp_path / "summaries"
    assert copy_summaries(tmp_path / "a" / "t", committed) == 1
    (path,) = committed.glob("*.json")
    assert set(json.loads(path.read_text())["setup"]) == {"data", "optim", "train"}
    assert list(committed_runs(GRID[:1], extra, [str(committed)])) == [0]
    assert committed_runs(GRID[:1], extra + ["train.batch_order=fixed"], [str(committed)]) == {}
    assert "trained otherwise" in capsys.readouterr().err
    record = json.loads(path.read_text())
    setup = record["setup"]
    del record["setup"]
    path.write_text(json.dumps(record))
    assert list(committed_runs(GRID[:1], extra + ["train.batch_order=fixed"], [str(committed)])) == [0]
    # a setup recorded before a field existed (here: no batch_order, no segment query_order option) matches a run
    # that leaves the field at its default, and not one that sets it otherwise
    del setup["train"]["batch_order"]
    for segment in setup["data"]["train"]:
        segment.pop("options", None)
    path.write_text(json.dumps(record | {"setup": setup}))
    assert list(committed_runs(GRID[:1], extra, [str(committed)])) == [0]
    assert committed_runs(GRID[:1], extra + ["train.batch_order=fixed"], [str(committed)]) == {}


def test_skip_summaries_needs_a_directory(tmp_path):
    with pytest.raises(SystemExit, match="no such directory"):
        run_sweep(GRID[:1], "t", device="cpu", extra=TINY, runs_root=str(tmp_path),
                  skip_summaries=[str(tmp_path / "x")])


def test_dry_run_names_committed_done_and_todo_runs(tmp_path, capsys):
    """`zoo-sweep FILE --dry-run [--skip-summaries DIR]`: one line a run, committed / done / todo / invalid."""
    from zoo.plot import copy_summaries
    from zoo.sweep import _dry_run

    extra = TINY + ["experiment_name=t", f"data.cache_dir={tmp_path / 'cache'}"]
    run_sweep(GRID[:2], "t", workers=1, device="cpu", extra=extra, runs_root=str(tmp_path / "a"))
    committed = tmp_path / "summaries"
    copy_summaries(tmp_path / "a" / "t", committed)
    run_sweep(GRID[2:3], "t", workers=1, device="cpu", extra=extra, runs_root=str(tmp_path / "b"))
    capsys.readouterr()
    _dry_run(GRID + [["model=based", "optim.lr=-1"]], extra + [f"runs_root={tmp_path / 'b'}"], [str(committed)])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["committed", "committed", "done", "todo", "invalid", "5"]
    assert lines[-1] == f"5 runs: 2 committed, 1 done, 1 todo, 1 invalid (committed: in {committed})"


BAD_SWEEP_FILES = {  # file name, content (None: the file is not written) -> the one line zoo-sweep prints
    "missing": ("gone.py", None, "no sweep file at"),
    "suffix": ("runs.txt", "x", "must be .py or .yaml"),
    "no_sweep_function": ("s.py", "RUNS = []\n", "must define sweep()"),
    "sweep_raises": ("s.py", "def sweep():\n    raise ValueError('D must be a comma list of integers')\n",
                     "s.py: D must be a comma list of integers"),
    "no_runs": ("s.py", "def sweep():\n    return []\n", "defines no runs"),
    "yaml_syntax": ("s.yaml", "grid: [1\n", "not valid YAML"),
    "yaml_not_a_mapping": ("s.yaml", "- 1\n", "expected a mapping"),
    "yaml_scalar_grid": ("s.yaml", "grid: {optim.lr: 3}\n", "must be a non-empty list"),
}


@pytest.mark.parametrize("case", list(BAD_SWEEP_FILES))
def test_bad_sweep_file_is_one_line(tmp_path, capsys, case):
    """A sweep file that cannot give runs stops zoo-sweep with one line naming the problem, not a traceback."""
    name, content, message = BAD_SWEEP_FILES[case]
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as stop:
        main([str(path), "--dry-run", "--runs-root", str(tmp_path / "runs")])
    line = str(stop.value.code)
    assert line.startswith("zoo-sweep: error: ") and message in line and "\n" not in line
    assert not (tmp_path / "runs").exists()


def test_dry_run_says_where_a_partial_run_resumes(tmp_path, capsys):
    """A run dir with a checkpoint and no summary (a run stopped at a time limit) is "partial" with the epoch and
    step it resumes from; one without a checkpoint says it trains from the start."""
    import shutil

    from zoo.runs import RunDir
    from zoo.sweep import _dry_run

    extra = TINY + ["experiment_name=t", f"data.cache_dir={tmp_path / 'cache'}"]
    record = run_sweep(GRID[:2], "t", workers=1, device="cpu", extra=extra, runs_root=str(tmp_path))
    first, second = (RunDir(r["run_dir"]) for r in record["runs"])
    for run in (first, second):
        (run.path / "summary.json").unlink()
    shutil.rmtree(second.path / "ckpt")
    capsys.readouterr()
    _dry_run(GRID[:2], extra + [f"runs_root={tmp_path}"])
    lines = capsys.readouterr().out.splitlines()
    ckpt = first.load_checkpoint()
    epochs = next(o for o in TINY if o.startswith("train.epochs=")).split("=")[1]
    resumes = f"(checkpoint after {ckpt['epoch']} of {epochs} epochs, step {ckpt['step']})"
    assert lines[0] == f"partial   {first.path} {resumes}"
    assert lines[1] == f"partial   {second.path} (no checkpoint: trains from the start)"
