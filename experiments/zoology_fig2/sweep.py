"""Zoology Fig. 2 (Arora et al., 2023): MQAR accuracy against d_model for seven models at three lengths.

The models are the paper presets `zoo/configs/model/zoology_fig2/*.yaml`, each as Zoology's Fig. 2 config defines
it (shared/REFERENCE.md §1; every preset's header says where ours differs): attention (1 head, dropout 0.1,
learned absolute positions), base_conv (gated short conv k=3, then a gated long conv over L), hyena (l_max=L),
h3 (d_state=L, head_dim 2), rwkv (RWKV-4 time mixing), based (gated short conv, then Based f=8, 1 head) and
mamba (d_state 16, expand 2). Grid: (L, n) ∈ {(64, 4), (128, 8), (256, 16)}, d_model ∈ {64, 128, 256, 512},
lr ∈ logspace(-4, -2, 4): 7·4·4·3 = 336 runs. 2 layers, no MLP, 100k train / 1k valid / 3k test examples,
batch 512/512/256, 64 epochs, early stop at 0.99 valid accuracy; AdamW as Zoology runs it (wd 0.1, betas
(0.9, 0.999), no gradient clipping), cosine to 0, no warmup; from the L=128 panel on, Zoology's per-epoch cosine,
decay on every parameter and init exactly (`ZOOLOGY_EXACT`; the L=64 panel's runs predate those options). Each
length is its own run (one panel). The data keep our MQAR's random query order, where Zoology queries the j-th
context key at its j-th slot draw (the README says what that changes: almost nothing in key-to-query distance).
Learning rates are selected on validation (Zoology selected and stopped on test). Under `--pack-lrs` a point's
four lrs train as one pack that stops as soon as one of them reaches 0.99 (`train.pack_stop=first`): that lr is
then the point's best up to 0.01, so the figure is the same, while the other three end where they stand
(`stopped_by_pack` in their summaries and results.json rows: lower bounds, not 64-epoch runs). The L = 64 panel
and L = 128 at d = 64 and 128 ran before it, every lr to its own end.

    ZOO_FIG2=L64 zoo-sweep experiments/zoology_fig2/sweep.py --pack-lrs --runs-root runs    # one panel (GPU)
    zoo-sweep experiments/zoology_fig2/sweep.py --pack-lrs --runs-root runs                 # all three panels
    ZOO_FIG2=tiny zoo-sweep experiments/zoology_fig2/sweep.py --device cpu --runs-root runs  # CPU smoke grid

Selectors (environment variables, all optional):
- `ZOO_FIG2`: `full` (default: L64, L128, L256), one or more panels (`L64`, `L128,L256`; `L512` is the paper's
  optional (512, 64) panel, batch 128) or `tiny`.
- `MIXERS`: a comma list of preset names (e.g. `attention,base_conv`); `D`: a comma list of d_models; `LRS`: a
  comma list of learning rates of the grid (e.g. `1e-4,1e-2`), matched within 1%.
- `POINTS`: a comma list of preset:d_model pairs (e.g. `h3:64,base_conv:512`), the grid points to run where
  MIXERS × D would take their whole cross product; combined with MIXERS, D and LRS, a run must pass all of them.
- `SEEDS`: a comma list of train.seed values (default: the grid's one seed, 0), to measure the spread between
  seeds at a point. Runs of seeds other than 0 land in the experiment zoology_fig2_seeds, whose summaries
  `plot.py collect` keeps out of the figure's; `zoo-sweep --pack-seeds` trains a point's seeds and lrs as one
  pack. E.g. `ZOO_FIG2=L128 POINTS=h3:64 LRS=2.154e-3,1e-2 SEEDS=1,2`.
- `ZOO_FIG2_MODELS`: `config` (default: the models above, as Zoology's Fig. 2 config defines them) or `launched`:
  the models the runs behind Zoology's published figure trained (experiments/zoology_fig2/README.md, "What the
  published figure ran"): attention, Hyena and RWKV with the tanh MLP of width 4d in every block (RWKV-4's init
  schedule over 2 layers), BaseConv as 8 gated convolutions, H3 as 4 layers; each at its launch's batch size,
  weight decay 0.01 on every parameter, Zoology's per-epoch cosine and init; experiment zoology_fig2_launched.
  Two deviations from those launches, for GPU time: the early stop at 0.99 and bf16 autocast stay (the launches
  ran 64 epochs in fp32; `train.early_stop=null train.precision=fp32` on the command line restores both).
Runs come cheapest and most informative first: panel by panel from L=64, each panel from the narrowest
d_model, and within one d the models that stop early or train fastest first (attention, based, base_conv,
rwkv, hyena, h3, mamba).
`ZOO_FIG2=tiny` is a CPU smoke grid (`tiny_runs`: L=64, vocabulary 256, d ∈ {32, 64}, one lr, 3k examples, 8
epochs, the default presets, 10 runs; `--device cpu --workers 2`); it lands in its own experiment,
zoology_fig2_tiny.
"""

import os

# Preset names (zoo/configs/model/zoology_fig2/<name>.yaml), in run order within one (L, d).
MIXERS = ["attention", "based", "base_conv", "rwkv", "hyena", "h3", "mamba"]
PANELS = {"L64": (64, 4, 512), "L128": (128, 8, 512), "L256": (256, 16, 256), "L512": (512, 64, 128)}
FULL = ["L64", "L128", "L256"]
D_MODELS = [64, 128, 256, 512]
LRS = [float(f"{10 ** (-4 + 2 * i / 3):.4g}") for i in range(4)]  # logspace(-4, -2, 4)


def _csv(name: str) -> list[str] | None:
    value = os.environ.get(name, "").strip()
    return [v.strip() for v in value.split(",") if v.strip()] or None


def _selected_mixers() -> list[str]:
    chosen = _csv("MIXERS")
    if chosen is None:
        return MIXERS
    unknown = sorted(set(chosen) - set(MIXERS))
    if unknown:
        raise ValueError(f"MIXERS: unknown presets {unknown} (known: {','.join(MIXERS)})")
    return [m for m in MIXERS if m in chosen]


def _selected_d_models() -> list[int]:
    chosen = _csv("D")
    if chosen is None:
        return D_MODELS
    try:
        ds = sorted({int(d) for d in chosen})
    except ValueError:
        raise ValueError(f"D must be a comma list of integers, got {os.environ['D']!r}") from None
    if any(d < 1 for d in ds):
        raise ValueError(f"D: d_model must be >= 1, got {ds}")
    return ds


def _selected_points() -> set[tuple[str, int]] | None:
    chosen = _csv("POINTS")
    if chosen is None:
        return None
    points = set()
    for item in chosen:
        mixer, _, d = item.partition(":")
        if mixer.strip() not in MIXERS or not d.strip().isdigit() or int(d) < 1:
            raise ValueError(f"POINTS: {item!r} is not preset:d_model with a preset of {','.join(MIXERS)}")
        points.add((mixer.strip(), int(d)))
    return points


def _selected_seeds() -> list[int]:
    chosen = _csv("SEEDS")
    if chosen is None:
        return [0]
    if not all(v.isdigit() for v in chosen):
        raise ValueError(f"SEEDS must be a comma list of integers >= 0, got {os.environ['SEEDS']!r}")
    return sorted({int(v) for v in chosen})


def _selected_lrs() -> list[float]:
    chosen = _csv("LRS")
    if chosen is None:
        return LRS
    try:
        wanted = [float(v) for v in chosen]
    except ValueError:
        raise ValueError(f"LRS must be a comma list of numbers, got {os.environ['LRS']!r}") from None
    def near(w: float, lr: float) -> bool:  # the grid's values are rounded to 4 digits
        return abs(w - lr) <= 0.01 * lr

    off_grid = [w for w in wanted if not any(near(w, lr) for lr in LRS)]
    if off_grid:
        raise ValueError(f"LRS: {off_grid} not in the grid {LRS}")
    return [lr for lr in LRS if any(near(w, lr) for w in wanted)]


# Zoology's trainer and init exactly (zoo/config.py: OptimConfig.schedule and .decay, ModelConfig.init and
# .final_norm): the lr held through each epoch on a per-epoch cosine, weight decay on every parameter, convolutions
# at PyTorch's init, `out_proj` at 0.02/sqrt(2 n_layers), RWKV-4's per-layer init, and a LayerNorm before the head
# (Mamba's blocks keep RMSNorm). The L=64 panel's runs predate these options and keep the per-step cosine, decay on
# matrices only, the default init and Mamba's final RMSNorm they ran with, so that each panel is one setting.
ZOOLOGY_EXACT = {"optim.schedule": "cosine_epoch", "optim.decay": "all", "model.init": "zoology",
                 "model.final_norm": "layernorm"}
# ... and per preset: Hyena's filter reads Zoology's learned position features (one band); H3 runs Zoology's complex
# S4D-Lin SSM and the shift's separate skip weight.
ZOOLOGY_EXACT_MIXER = {"hyena": {"+model.mixers.hyena.positions": "zoology", "model.mixers.hyena.num_freqs": 1},
                       "h3": {"+model.mixers.h3.ssm": "zoology"}}
PANELS_BEFORE_EXACT = {"L64"}

# ZOO_FIG2_MODELS=launched: preset -> (its overrides, batch at L <= 128, batch at L = 256), from the commits nearest
# each launch behind the published figure (the README's table); Based and Mamba are not in that figure.
LAUNCHED = {
    "attention": ({"model.mlp": "tanh"}, 256, 256),
    "base_conv": ({"model.n_layers": 8, "model.pattern": ["short_conv", "short_conv", "long_conv", "long_conv"],
                   "model.mlp": "none"}, 1024, 1024),
    "rwkv": ({"model.mlp": "tanh", "+model.mixers.rwkv4.init_layers": 2}, 1024, 1024),
    "hyena": ({"model.mlp": "tanh"}, 1024, 1024),
    "h3": ({"model.n_layers": 4, "model.mlp": "none"}, 1024, 256),
}
# The H3 launch of 2023-11-12 (L = 128, 256, 512) swept lr over logspace(-3.3, -2, 4) (commit 174d6cc), the others
# the grid's: the i-th lr of the grid (or of LRS) becomes the i-th of these for H3 at L >= 128.
LAUNCHED_H3_LRS = [float(f"{10 ** (-3.3 + 1.3 * i / 3):.4g}") for i in range(4)]
# ... and the trainer of those launches: AdamW's default weight decay (0.01) on every parameter; the rest of it (the
# per-epoch cosine, decay on every parameter, Zoology's init) is ZOOLOGY_EXACT, which launched runs always take
LAUNCHED_TRAINER = {"optim.weight_decay": 0.01, "experiment_name": "zoology_fig2_launched"}

# Presets whose recurrence runs as a Triton kernel on the GPU: preset -> its mixer's name.
TRITON_MIXERS = {"mamba": "mamba", "rwkv": "rwkv4"}


def gpu_overrides(mixer: str) -> dict:
    """Mamba's scan (kernels/selective_scan) and RWKV-4's WKV (kernels/rwkv4) through their Triton kernels on the
    GPU (their custom ops have vmap rules, so these runs pack under --pack-lrs too); every other preset runs its
    PyTorch path, which packs."""
    return {f"+model.mixers.{TRITON_MIXERS[mixer]}.impl": "triton"} if mixer in TRITON_MIXERS else {}


def launched_runs(panels: list[str], mixers: list[str], d_models: list[int], lrs: list[float]) -> list[dict]:
    """The config's runs turned into the launched models (LAUNCHED): their overrides, batch, trainer and (H3 at
    L >= 128) lrs."""
    runs = []
    for run in panel_runs(panels, [m for m in mixers if m in LAUNCHED], d_models, lrs, exact_always=True):
        mixer = run["model"].removeprefix("zoology_fig2/")
        overrides, small, large = LAUNCHED[mixer]
        L = run["data.train"][0]["seq_len"]
        batch = small if L <= 128 else large if L == 256 else 128  # every launch: 128 at L = 512
        data = {k: [seg | {"batch_size": batch} for seg in run[k]] for k in ("data.train", "data.valid", "data.test")}
        if mixer == "h3" and L >= 128:
            data["optim.lr"] = dict(zip(LRS, LAUNCHED_H3_LRS))[run["optim.lr"]]
        runs.append(run | overrides | data | LAUNCHED_TRAINER)
    return runs


def panel_runs(panels: list[str], mixers: list[str], d_models: list[int], lrs: list[float] = LRS,
               exact_always: bool = False) -> list[dict]:
    runs = []
    for panel in panels:
        L, n, batch = PANELS[panel]
        seg = {"seq_len": L, "num_kv_pairs": n, "batch_size": batch}
        exact = ZOOLOGY_EXACT if exact_always or panel not in PANELS_BEFORE_EXACT else {}
        data = {
            "data.vocab_size": 8192,
            "data.train": [seg | {"num_examples": 100_000}],
            "data.valid": [seg | {"num_examples": 1000}],
            "data.test": [seg | {"num_examples": 3000}],
        }
        for d in d_models:
            for mixer in mixers:
                for lr in lrs:
                    runs.append(
                        {
                            "model": f"zoology_fig2/{mixer}",
                            **gpu_overrides(mixer),
                            "model.d_model": d,
                            **data,
                            "optim.lr": lr,
                            "optim.weight_decay": 0.1,
                            "optim.beta2": 0.999,
                            "optim.grad_clip": 0.0,
                            "optim.warmup_frac": 0.0,
                            "train.epochs": 64,
                            "train.early_stop": 0.99,
                            "train.pack_stop": "first",
                            "experiment_name": "zoology_fig2",
                            **(exact | ZOOLOGY_EXACT_MIXER.get(mixer, {}) if exact else {}),
                        }
                    )
    return runs


def tiny_runs() -> list[dict]:
    """The CPU smoke grid (10 runs, about 3 minutes with `--workers 2` on 2 cores): one panel, L=64 with 4 pairs,
    a vocabulary of 256 that a tiny model learns in seconds, d in {32, 64}, one lr held after a 5% warmup (a
    cosine decay to zero over 8 epochs ends the runs before their jump in recall), 3k examples, 8 epochs.

    It trains the library's default presets (zoo/configs/model/<name>.yaml, `impl=naive`), not the paper presets:
    they are what a CPU can run in minutes. Mamba's and RWKV's PyTorch scans cost a CPU 10-20x the others per
    step, so the grid keeps the mixers that show the paper's gap: attention and Based recall, the gated
    convolutions (BaseConv, H3, Hyena) lag at small d_model."""
    seg = {"seq_len": 64, "num_kv_pairs": 4, "batch_size": 64}
    data = {
        "data.vocab_size": 256,
        "data.train": [seg | {"num_examples": 3000}],
        "data.valid": [seg | {"num_examples": 250}],
        "data.test": [seg | {"num_examples": 500}],
    }
    runs = []
    for mixer in ["based", "attention", "base_conv", "hyena", "h3"]:
        for d in [32, 64]:
            runs.append(
                {
                    "model": mixer,
                    **({"model.mixers.based.feature_dim": 8} if mixer == "based" else {}),
                    **({"model.mixers.h3.d_state": 64} if mixer == "h3" else {}),
                    **({"model.mixers.hyena.max_seq_len": 64} if mixer == "hyena" else {}),
                    "model.d_model": d,
                    **data,
                    "optim.lr": 3e-3,
                    "optim.weight_decay": 0.1,
                    "optim.warmup_frac": 0.05,
                    "optim.min_lr_ratio": 1.0,
                    "train.epochs": 8,
                    "train.early_stop": 0.99,
                    "experiment_name": "zoology_fig2_tiny",
                }
            )
    return runs


def sweep() -> list[dict]:
    grid = os.environ.get("ZOO_FIG2", "full").strip()
    if grid == "tiny":
        return tiny_runs()
    panels = FULL if grid == "full" else [p.strip() for p in grid.split(",") if p.strip()]
    unknown = [p for p in panels if p not in PANELS]
    if unknown or not panels:
        raise ValueError(f"ZOO_FIG2 must be full, tiny or a comma list of {','.join(PANELS)}, got {grid!r}")
    models = os.environ.get("ZOO_FIG2_MODELS", "config").strip()
    if models not in ("config", "launched"):
        raise ValueError(f"ZOO_FIG2_MODELS must be config or launched, got {models!r}")
    build = launched_runs if models == "launched" else panel_runs
    runs = build(panels, _selected_mixers(), _selected_d_models(), _selected_lrs())
    points = _selected_points()
    if points is not None:
        picked = [r for r in runs if (r["model"].removeprefix("zoology_fig2/"), r["model.d_model"]) in points]
        if not picked:  # the selectors intersect; say so rather than leave an empty sweep unexplained
            widths = sorted({r["model.d_model"] for r in runs})
            raise ValueError(f"POINTS: {','.join(f'{m}:{d}' for m, d in sorted(points))} match no run of this "
                             f"selection (its d_model: {widths}; MIXERS, D and LRS narrow it)")
        runs = picked
    seeds = _selected_seeds()
    if seeds == [0]:
        return runs
    # seed-major: each seed's runs in the grid's order, so --pack-seeds groups a point's lrs and seeds
    return [r | {"train.seed": seed} | ({} if seed == 0 else {"experiment_name": r["experiment_name"] + "_seeds"})
            for seed in seeds for r in runs]
