"""The 16-run sweep-speed probe (issue 35): L=256, n=16, 100k train examples, d_model=64, attention and Based
(BaseConv + Based, f=8), the 4 learning rates of the Zoology grid, seeds 0 and 1, 3 epochs, early stop off.

    zoo-sweep experiments/bench/probe16.py --runs-root /tmp/probe
    ZOO_PROBE_BASED_IMPL=triton zoo-sweep experiments/bench/probe16.py ...   # Based on its Triton kernels

ZOO_PROBE_EPOCHS sets the epochs; ZOO_PROBE_BASED_IMPL the Based runs' `impl` (default: the preset's PyTorch form),
which an override on the command line cannot do without also reaching the attention runs.
"""

import os

LRS = [1e-4, 4.642e-4, 2.154e-3, 1e-2]


def sweep():
    seg = {"seq_len": 256, "num_kv_pairs": 16, "batch_size": 256}
    data = {
        "data.vocab_size": 8192,
        "data.train": [seg | {"num_examples": 100_000}],
        "data.valid": [seg | {"num_examples": 1000}],
        "data.test": [seg | {"num_examples": 1000}],
    }
    epochs = int(os.environ.get("ZOO_PROBE_EPOCHS", "3"))
    based = {"model.mixers.based.feature_dim": 8}
    based_impl = os.environ.get("ZOO_PROBE_BASED_IMPL")
    if based_impl:
        based["+model.mixers.based.impl"] = based_impl
    runs = []
    for mixer, extra in (("attention", {}), ("based", based)):
        for seed in (0, 1):
            for lr in LRS:
                runs.append(
                    {
                        "model": mixer,
                        **extra,
                        "model.d_model": 64,
                        **data,
                        "optim.lr": lr,
                        "optim.weight_decay": 0.1,
                        "optim.warmup_frac": 0.0,
                        "train.epochs": epochs,
                        "train.early_stop": None,
                        "train.seed": seed,
                        "experiment_name": "probe16",
                    }
                )
    return runs
