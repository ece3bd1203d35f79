"""The Based recall–state frontier (Arora et al., 2024, Fig. 2 left): MQAR accuracy against recurrent state
size at L = 256, with each architecture's own state dial.

- Based (after a gated short conv): feature dim f ∈ {4, 8, 16, 24} × d_model ∈ {64, 128, 256}; state
  H·(E·d_v + E), E = 1 + f + f(f+1)/2.
- Sliding-window attention: window ∈ {16, 32, 64, 128} × d_model ∈ {64, 128}; state 2·w·d.
- Attention: d_model ∈ {64, 128, 256}; state 2·L·d (the ceiling).
- Mamba: d_state ∈ {8, 16, 32} × d_model ∈ {64, 128, 256}; state d_inner·(N + k - 1).
- GLA and Gated DeltaNet through FLA (impl=fla on the GPU): d_model ∈ {64, 128, 256}; state H·d_k·d_v. Gated
  DeltaNet falls back to its chunked PyTorch form (impl=chunk) where FLA refuses its backward (Hopper,
  Triton < 3.7.1).
Every model gets lr ∈ {3e-4, 1e-3, 3e-3} (chosen on validation) and trains on the L = 256 part of Zoology's
mixture (n = 16, 32, 64; 20k each), 32 epochs, early stop at 0.99.

    zoo-sweep experiments/based_frontier/sweep.py --runs-root runs
    python experiments/based_frontier/plot.py runs/based_frontier
    ZOO_FRONTIER=reduced zoo-sweep experiments/based_frontier/sweep.py --pack-lrs train.cuda_graph=true  # H200
    ZOO_FRONTIER=tiny zoo-sweep experiments/based_frontier/sweep.py --device cpu --runs-root runs   # CPU smoke
"""

import os
import re


def _fla_gated_backward_refused() -> bool:
    """True where FLA's gated chunk backward raises: an NVIDIA Hopper GPU (sm_90) with Triton < 3.7.1."""
    import torch
    import triton

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    major, minor, patch = re.match(r"(\d+)\.(\d+)\.?(\d*)", triton.__version__).groups()
    return (int(major), int(minor), int(patch or 0)) < (3, 7, 1)


def sweep():
    grid = os.environ.get("ZOO_FRONTIER", "full")
    if grid not in ("full", "reduced", "tiny"):
        raise ValueError(f"ZOO_FRONTIER must be full, reduced or tiny, got {grid!r}")
    tiny = grid == "tiny"
    if tiny:
        L, pairs, n_train, n_eval, epochs, lrs, dims = 64, [4, 8], 1000, 200, 6, [3e-3], [16, 32]
        features, windows, states, experiment = [2, 4, 8], [8, 16], [4, 8], "based_frontier_tiny"
    else:
        L, pairs, n_train, n_eval, epochs, lrs, dims = (
            256,
            [16, 32, 64],
            20_000,
            1000,
            32,
            [3e-4, 1e-3, 3e-3],
            [64, 128, 256],
        )
        features, windows, states, experiment = [4, 8, 16, 24], [16, 32, 64, 128], [8, 16, 32], "based_frontier"
        if grid == "reduced":  # one H200 call of a few minutes: d_model 128 only, fewer dials, 2 lrs, 12 epochs
            dims, features, windows, states = [128], [4, 8, 16], [16, 32, 64], [8, 16]
            lrs, epochs, experiment = [1e-3, 3e-3], 12, "based_frontier_reduced"
    batch = 256 if L >= 256 else 64

    def segs(k: int) -> list[dict]:
        return [{"seq_len": L, "num_kv_pairs": n, "num_examples": k, "batch_size": batch} for n in pairs]

    common = {
        "data.vocab_size": 8192,
        "data.train": segs(n_train),
        "data.valid": segs(n_eval),
        "data.test": segs(n_eval),
        "optim.weight_decay": 0.1,
        "optim.warmup_frac": 0.0,
        "train.epochs": epochs,
        "train.early_stop": 0.99,
        "experiment_name": experiment,
    }
    impl = "naive" if tiny else "fla"
    # FLA 0.6 refuses the gated chunk backward on Hopper with Triton < 3.7.1 (wrong results, FLA #640); the H200
    # machine has Triton 3.6, so there Gated DeltaNet trains on its chunked PyTorch form (impl=chunk) instead.
    gdn_impl = "naive" if tiny else "chunk" if _fla_gated_backward_refused() else "fla"
    # Mamba's scan on the GPU: the Triton selective scan (13-20x the PyTorch loop's forward+backward on the H200,
    # bench/mamba_scan.py, session 6); its runs then train one at a time instead of as a vmapped lr pack.
    scan = {} if tiny else {"+model.mixers.mamba.impl": "triton"}
    models = []
    for d in dims:
        models += [{"model": "based", "model.d_model": d, "model.mixers.based.feature_dim": f} for f in features]
        models += [{"model": "attention", "model.d_model": d}]
        models += [{"model": "mamba", "model.d_model": d, "model.mixers.mamba.d_state": n, **scan} for n in states]
        models += [{"model": "gla", "model.d_model": d, "+model.mixers.gla.impl": impl}]
        models += [{"model": "gated_deltanet", "model.d_model": d, "+model.mixers.gated_deltanet.impl": gdn_impl}]
        if d <= dims[min(1, len(dims) - 1)]:
            models += [
                {
                    "model": "sliding_window",
                    "model.d_model": d,
                    "model.mixers.sliding_window.window": w,
                }
                for w in windows
            ]
    return [m | common | {"optim.lr": lr} for m in models for lr in lrs]
