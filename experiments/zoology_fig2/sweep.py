"""Zoology Fig. 2 (Arora et al., 2023): MQAR accuracy against d_model for seven mixers at three lengths.

Grid (shared/REFERENCE.md §1): (L, n) ∈ {(64, 4), (128, 8), (256, 16)}, d_model ∈ {64, 128, 256, 512},
lr ∈ logspace(-4, -2, 4), mixers attention, Hyena, RWKV, BaseConv, H3 (d_state = L), Based (feature dim 8
after a gated short conv) and Mamba: 7·4·4·3 = 336 runs. 2 layers, no MLP, 100k train / 1k valid / 3k test
examples, batch 512/512/256, 64 epochs, early stop at 0.99 valid accuracy, AdamW wd 0.1, cosine, no warmup.
Each length is its own run (one panel of the figure). Learning rates are selected on validation.

    zoo-sweep experiments/zoology_fig2/sweep.py --runs-root runs          # the full grid (GPU)
    ZOO_FIG2=tiny zoo-sweep experiments/zoology_fig2/sweep.py --device cpu --workers 2   # CPU smoke grid

`ZOO_FIG2=reduced` keeps the grid's settings but runs the L=64 panel only, d_model ∈ {64, 128}, at most 16 epochs
(56 runs, experiment zoology_fig2_reduced): the part one H200 call of a few minutes holds.
`ZOO_FIG2=tiny` shrinks everything (L=64 only, vocabulary 256, d ∈ {32, 64}, one lr held after a 5% warmup, 3k examples,
8 epochs, naive impls, no Mamba or RWKV: 10 runs) so the whole pipeline runs on a laptop CPU (`--workers 2` on
2 cores); it lands in its own experiment, zoology_fig2_tiny.
"""

import os

# Run order: the sweep starts runs in this order, so a grid cut by a time limit has Based and attention first and
# the slowest runs (Mamba's PyTorch scan, H3, RWKV) last.
MIXERS = ["based", "attention", "base_conv", "hyena", "rwkv", "h3", "mamba"]


def model_overrides(mixer: str, L: int, gpu: bool) -> dict:
    """The model of one mixer at length L (2 layers, no MLP: the presets' defaults)."""
    if mixer == "based":
        return {"model": "based", "model.mixers.based.feature_dim": 8}
    if mixer == "h3":
        return {"model": "h3", "model.mixers.h3.d_state": L}
    if mixer == "hyena":
        return {"model": "hyena", "model.mixers.hyena.max_seq_len": L}
    if mixer == "rwkv":
        return {"model": "rwkv", "model.mixers.rwkv.num_heads": 1, "+model.mixers.rwkv.impl": "fla" if gpu else "naive"}
    if mixer == "mamba":
        # the Triton selective scan on the GPU: 13-20x the PyTorch loop's forward+backward on the H200
        # (bench/mamba_scan.py, session 6); these runs then train one at a time instead of as a vmapped lr pack
        return {"model": "mamba", **({"+model.mixers.mamba.impl": "triton"} if gpu else {})}
    return {"model": mixer}


def sweep():
    grid = os.environ.get("ZOO_FIG2", "full")
    if grid not in ("full", "reduced", "tiny"):
        raise ValueError(f"ZOO_FIG2 must be full, reduced or tiny, got {grid!r}")
    tiny = grid == "tiny"
    mixers, vocab, warmup = MIXERS, 8192, 0.0
    if tiny:
        # One panel (L=64, 4 pairs) and a vocabulary a tiny model can learn in seconds; Mamba's and RWKV's PyTorch
        # scans cost a CPU 10-20x the others per step, so the CPU grid keeps the mixers that show the paper's gap:
        # attention and Based recall, the gated convolutions (BaseConv, H3, Hyena) lag at small d_model.
        # A short warmup, then a constant lr (optim.min_lr_ratio=1): in 8 epochs, a cosine decay to zero ends the
        # runs before the models' jump in recall (attention without warmup stalls near 0.25).
        lengths, d_models, lrs, vocab, warmup = [(64, 4, 64)], [32, 64], [3e-3], 256, 0.05
        mixers = ["based", "attention", "base_conv", "hyena", "h3"]
        n_train, n_valid, n_test, epochs, experiment = 3000, 250, 500, 8, "zoology_fig2_tiny"
    else:
        lengths, d_models = [(64, 4, 512), (128, 8, 512), (256, 16, 256)], [64, 128, 256, 512]
        lrs = [1e-4, 10 ** (-4 + 2 / 3), 10 ** (-4 + 4 / 3), 1e-2]
        n_train, n_valid, n_test, epochs, experiment = 100_000, 1000, 3000, 64, "zoology_fig2"
        if grid == "reduced":  # what one H200 call of a few minutes holds: the L=64 panel, d <= 128, 16 epochs
            lengths, d_models, epochs, experiment = lengths[:1], d_models[:2], 16, "zoology_fig2_reduced"
    runs = []
    for L, n, batch in lengths:
        seg = {"seq_len": L, "num_kv_pairs": n, "batch_size": batch}
        data = {
            "data.vocab_size": vocab,
            "data.train": [seg | {"num_examples": n_train}],
            "data.valid": [seg | {"num_examples": n_valid}],
            "data.test": [seg | {"num_examples": n_test}],
        }
        for mixer in mixers:
            for d in d_models:
                for lr in lrs:
                    runs.append(
                        {
                            **model_overrides(mixer, L, gpu=not tiny),
                            "model.d_model": d,
                            **data,
                            "optim.lr": float(f"{lr:.4g}"),
                            "optim.weight_decay": 0.1,
                            "optim.warmup_frac": warmup,
                            **({"optim.min_lr_ratio": 1.0} if tiny else {}),
                            "train.epochs": epochs,
                            "train.early_stop": 0.99,
                            "experiment_name": experiment,
                        }
                    )
    return runs
