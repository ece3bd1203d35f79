"""The Based recall–state frontier (Arora et al., 2024, Fig. 2 left), as Zoology's arxiv24_based_figure2 config
defines it: MQAR accuracy against recurrent state size, each architecture at its own state dials.

Models (presets `zoo/configs/model/based_fig2/*.yaml`; each header says where ours differs):
- Hybrid[BaseConv k=3, X] (layer 0 the gated short conv, layer 1 X) for X = attention (d ∈ {64, 128}, 1 head,
  dropout 0.1, no positions), Based (d ∈ {48, 64, 128} × feature_dim ∈ {8, 16, 24}, 1 head) and sliding-window
  attention (d = 128, Zoology's block_size w ∈ {8, 16, ..., 1024}: our window of w + 1 keys, no positions).
- Alone, as the config has them: Mamba and Mamba-2 (d ∈ {64, 128, 256} × d_state ∈ {8, 16, 24}), Hyena
  (d ∈ {64, 128, 256}, l_max 1024) and H3 (d ∈ {64, 128, 256}, d_state = d/4, head_dim 2). REFERENCE §1 says
  every model but Mamba is wrapped; the config wraps only attention, Based and the sliding window (Hyena and H3
  carry their own short convolutions).
- Extra rows beyond the paper: Hybrid[BaseConv k=3, GLA] and Hybrid[BaseConv k=3, Gated DeltaNet], d ∈ {64, 128,
  256}, 1 head.
Data: Zoology's standard mixture, (L, n) = (64, 4) 100k, (128, 8) 20k, (256, 16/32/64) 20k each, batch 256
for every segment (180k examples an epoch), random filler tokens (the config leaves `random_non_queries` at its
default, True), the batches in Zoology's fixed order (segment after segment, the same every epoch:
`train.batch_order=fixed`); test 1k each of (64, 4), (64, 8), (64, 16), (128, 32), (256, 64),
(512, 128), (1024, 256); a validation split of the same (L, n) list, drawn from its own seeds, selects the lr
and stops early at 0.99 (Zoology stopped on its test set). 32 epochs, lr ∈ logspace(-3, -1.5, 4) = {1e-3,
3.16e-3, 1e-2, 3.16e-2}, AdamW as Zoology runs it (wd 0.1 on every parameter, betas (0.9, 0.999), no gradient
clipping), its per-epoch cosine to 0 with no warmup (`optim.schedule=cosine_epoch`, `optim.decay=all`); the
presets take Zoology's init (`init: zoology`). 49 models × 4 lrs = 196 runs. Under `--pack-lrs` a model's four
lrs are one pack that stops once one of them reaches 0.99 (`train.pack_stop=first`): that lr is the model's best
up to 0.01, and the other three end where they stand (`stopped_by_pack` in their summaries and rows).

    zoo-sweep experiments/based_frontier/sweep.py --pack-lrs --runs-root runs
    python experiments/based_frontier/plot.py
    ZOO_FRONTIER=tiny zoo-sweep experiments/based_frontier/sweep.py --device cpu --runs-root runs   # CPU smoke

Selectors (environment variables, all optional): `ZOO_FRONTIER` = full (default) | reduced (the same grid at 8
epochs and lr ∈ {1e-3, 3.16e-3}, experiment based_frontier_reduced: a first look) | tiny; `MODELS`, a comma list
of preset names (e.g. `based,attention`); `D`, a comma list of d_models. Runs come narrowest d_model first,
Based before the others.
"""

import os
import re

# Preset names (zoo/configs/model/based_fig2/<name>.yaml) in run order within one d_model.
MODELS = ["based", "attention", "sliding_window", "mamba", "mamba2", "hyena", "h3", "gla", "gated_deltanet"]
LRS = [float(f"{10 ** (-3 + 0.5 * i):.4g}") for i in range(4)]  # logspace(-3, -1.5, 4)
TRAIN = [(64, 4, 100_000), (128, 8, 20_000), (256, 16, 20_000), (256, 32, 20_000), (256, 64, 20_000)]
TEST = [(64, 4), (64, 8), (64, 16), (128, 32), (256, 64), (512, 128), (1024, 256)]


def _fla_gated_backward_refused() -> bool:
    """True where FLA's gated chunk backward raises: an NVIDIA Hopper GPU (sm_90) with Triton < 3.7.1."""
    import torch
    import triton

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    major, minor, patch = re.match(r"(\d+)\.(\d+)\.?(\d*)", triton.__version__).groups()
    return (int(major), int(minor), int(patch or 0)) < (3, 7, 1)


def _csv(name: str) -> list[str] | None:
    value = os.environ.get(name, "").strip()
    return [v.strip() for v in value.split(",") if v.strip()] or None


def paper_models() -> list[dict]:
    """Every model of the grid: {"preset", "d", dial overrides}."""
    models = []
    for d in (48, 64, 128):
        models += [{"preset": "based", "d": d, "model.mixers.based.feature_dim": f} for f in (8, 16, 24)]
    models += [{"preset": "attention", "d": d} for d in (64, 128)]
    # Zoology's block_size w keeps keys i-w..i: our window (keys per query) of w + 1
    models += [{"preset": "sliding_window", "d": 128, "model.mixers.sliding_window.window": 2**i + 1}
               for i in range(3, 11)]
    for preset in ("mamba", "mamba2"):
        for d in (64, 128, 256):
            models += [{"preset": preset, "d": d, f"model.mixers.{preset}.d_state": n} for n in (8, 16, 24)]
    for d in (64, 128, 256):
        models += [{"preset": "hyena", "d": d}]
        models += [{"preset": "h3", "d": d, "model.mixers.h3.d_state": d // 4, "model.mixers.h3.shift_size": d // 4}]
        models += [{"preset": "gla", "d": d}, {"preset": "gated_deltanet", "d": d}]
    return models


def impl_overrides(preset: str, gpu: bool) -> dict:
    """The fast path per preset on the GPU; the PyTorch paths (which pack) elsewhere."""
    if not gpu:
        return {}
    if preset == "mamba":
        # the Triton selective scan (its custom op has a vmap rule: these runs pack under --pack-lrs too)
        return {"+model.mixers.mamba.impl": "triton"}
    if preset == "gla":
        return {"+model.mixers.gla.impl": "fla"}
    if preset == "gated_deltanet":
        # FLA 0.6 refuses the gated chunk backward on Hopper with Triton < 3.7.1 (wrong results, FLA #640); there
        # Gated DeltaNet trains on its chunked PyTorch form (impl=chunk) instead.
        return {"+model.mixers.gated_deltanet.impl": "chunk" if _fla_gated_backward_refused() else "fla"}
    return {}


def _segments(pairs, num_examples: int | None) -> list[dict]:
    """The config's MQAR segments: its `MQARConfig`s leave `random_non_queries` at Zoology's default, True, so
    every position that is neither context nor query holds a random token (seeded here)."""
    def batch(L: int) -> int:
        return 256 if L <= 256 else 65536 // L

    return [
        {"seq_len": L, "num_kv_pairs": n, "num_examples": num_examples or k[0], "batch_size": batch(L),
         "random_non_queries": True}
        for L, n, *k in pairs
    ]


def full_runs(epochs: int, lrs: list[float], experiment: str) -> list[dict]:
    wanted_models, wanted_d = _csv("MODELS"), _csv("D")
    if wanted_models is not None and set(wanted_models) - set(MODELS):
        unknown = sorted(set(wanted_models) - set(MODELS))
        raise ValueError(f"MODELS: unknown presets {unknown} (known: {','.join(MODELS)})")
    try:
        wanted_d = None if wanted_d is None else {int(d) for d in wanted_d}
    except ValueError:
        raise ValueError(f"D must be a comma list of integers, got {os.environ['D']!r}") from None
    common = {
        "data.vocab_size": 8192,
        "data.train": _segments(TRAIN, None),
        "data.valid": _segments(TEST, 1000),
        "data.test": _segments(TEST, 1000),
        "optim.weight_decay": 0.1,
        "optim.beta2": 0.999,
        "optim.grad_clip": 0.0,
        "optim.warmup_frac": 0.0,
        "optim.schedule": "cosine_epoch",
        "optim.decay": "all",
        "train.epochs": epochs,
        "train.early_stop": 0.99,
        "train.pack_stop": "first",
        "train.batch_order": "fixed",  # Zoology's DataLoader: segment after segment, the same every epoch
        "experiment_name": experiment,
    }
    models = sorted(paper_models(), key=lambda m: (m["d"], MODELS.index(m["preset"])))
    runs = []
    for m in models:
        if (wanted_models is not None and m["preset"] not in wanted_models) or (
            wanted_d is not None and m["d"] not in wanted_d
        ):
            continue
        dials = {k: v for k, v in m.items() if k not in ("preset", "d")}
        model = {"model": f"based_fig2/{m['preset']}", **impl_overrides(m["preset"], gpu=True), "model.d_model": m["d"]}
        runs += [model | dials | common | {"optim.lr": lr} for lr in lrs]
    return runs


def tiny_runs() -> list[dict]:
    """The CPU smoke grid: every preset at d ∈ {16, 32}, L = 64 (n = 4, 8), one lr, 1k examples, 6 epochs, with the
    full grid's random filler and fixed batch order."""
    segs = [{"seq_len": 64, "num_kv_pairs": n, "num_examples": 1000, "batch_size": 64, "random_non_queries": True}
            for n in (4, 8)]
    evals = [s | {"num_examples": 200} for s in segs]
    common = {
        "data.vocab_size": 8192,
        "data.train": segs,
        "data.valid": evals,
        "data.test": evals,
        "optim.lr": 3e-3,
        "optim.weight_decay": 0.1,
        "optim.warmup_frac": 0.0,
        "train.epochs": 6,
        "train.early_stop": 0.99,
        "train.batch_order": "fixed",
        "experiment_name": "based_frontier_tiny",
    }
    dials = {
        "based": {"model.mixers.based.feature_dim": 4},
        "sliding_window": {"model.mixers.sliding_window.window": 8},
        "mamba": {"model.mixers.mamba.d_state": 4},
        "mamba2": {"model.mixers.mamba2.d_state": 4, "model.mixers.mamba2.head_dim": 16},
        "h3": {"model.mixers.h3.d_state": 4, "model.mixers.h3.shift_size": 4},
        "gated_deltanet": {"+model.mixers.gated_deltanet.impl": "naive"},
    }
    return [
        {"model": f"based_fig2/{p}", "model.d_model": d, **dials.get(p, {})} | common for d in (16, 32) for p in MODELS
    ]


def sweep() -> list[dict]:
    grid = os.environ.get("ZOO_FRONTIER", "full").strip()
    if grid == "tiny":
        return tiny_runs()
    if grid == "full":
        return full_runs(32, LRS, "based_frontier")
    if grid == "reduced":
        return full_runs(8, LRS[:2], "based_frontier_reduced")
    raise ValueError(f"ZOO_FRONTIER must be full, reduced or tiny, got {grid!r}")
