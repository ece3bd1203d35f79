"""Where a small MQAR run's time goes on the GPU: setup, the training step (eager, packed, graphed), evaluation.

    python experiments/bench/step_profile.py            # attention and Based at L=256, d=64, batch 256
    python experiments/bench/step_profile.py --mixers zoology_fig2/mamba --L 128 --n 8 --d 512 --batch 512 \
        --set +model.mixers.mamba.impl=triton   # a Fig. 2 pack as its sweep trains it

For each model: the wall time of config, data and model set-up; ms per training step with the device
synchronised, for a plain eager step, a pack of 4 learning rates eagerly and as a CUDA graph; the device's own
kernel time per step (torch.profiler), so host-bound and device-bound steps can be told apart; the top
kernels; and one validation pass. Prints a table, then one JSON line.
"""

import argparse
import dataclasses
import json
import time

import torch

from zoo.device import autocast
from zoo.eval import evaluate, query_loss
from zoo.models import LanguageModel
from zoo.steps import PackedParams, PackedStep, build_optimizer
from zoo.train import load_config, load_split


def overrides(mixer: str, L: int, n: int, d: int, batch: int, examples: int) -> list[str]:
    seg = f"{{seq_len:{L},num_kv_pairs:{n},num_examples:{examples},batch_size:{batch}}}"
    small = f"{{seq_len:{L},num_kv_pairs:{n},num_examples:1000,batch_size:{batch}}}"
    out = [f"model={mixer}", f"model.d_model={d}", "data.vocab_size=8192", f"data.train=[{seg}]",
           f"data.valid=[{small}]", f"data.test=[{small}]"]
    if mixer == "based":
        out.append("model.mixers.based.feature_dim=8")
    return out


def timed(fn, n: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def device_ms(fn, n: int, top: int) -> tuple[float, list[str]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.self_device_time_total for e in events) / 1e3 / n
    events.sort(key=lambda e: -e.self_device_time_total)
    rows = [f"{e.self_device_time_total / 1e3 / n:8.3f} ms x{e.count // n:<4d} {e.key[:90]}" for e in events[:top]]
    return total, rows


def profile_model(mixer: str, args) -> dict:
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    cfg, _ = load_config(overrides(mixer, args.L, args.n, args.d, args.batch, args.examples) + args.set)
    t1 = time.perf_counter()
    data = {s: load_split(cfg, s, dev) for s in ("train", "valid")}
    t2 = time.perf_counter()
    model = LanguageModel(cfg.model).to(dev)
    opt = build_optimizer(model, cfg)
    amp = autocast(dev, "bf16")
    seg = data["train"][0]
    idx = torch.arange(args.batch, device=dev)
    t3 = time.perf_counter()

    def plain():
        with amp:
            loss = query_loss(model, seg.inputs[idx], seg.query_pos[idx], seg.query_labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    lrs = [1e-4, 4.6e-4, 2.2e-3, 1e-2]
    pack = PackedParams(LanguageModel(cfg.model).to(dev), lrs, cfg.optim, 10_000)

    def packed():
        with amp:
            losses = pack.losses(seg.inputs[idx], seg.query_pos[idx], seg.query_labels[idx])
        pack.flat.grad = None
        losses.sum().backward()
        pack.adamw_step(1.0, 1)

    cfg.train.precision = "bf16"
    members = [dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=lr)) for lr in lrs]
    graphs = PackedStep(LanguageModel(cfg.model).to(dev), members, 10_000, dev, True)

    def graphed():
        graphs.step(seg, idx, 1)

    out = {"mixer": mixer, "config_s": t1 - t0, "data_s": t2 - t1, "model_s": t3 - t2}
    for name, fn in (("plain", plain), ("pack4", packed), ("pack4_graph", graphed)):
        for _ in range(3):
            fn()
        out[f"{name}_ms"] = timed(fn, args.steps)
        out[f"{name}_device_ms"], rows = device_ms(fn, 5, args.top)
        print(f"--- {mixer} {name}: {out[f'{name}_ms']:.3f} ms/step wall, {out[f'{name}_device_ms']:.3f} ms device")
        print("\n".join(rows))
    t = time.perf_counter()
    evaluate(model, data["valid"], "valid", amp)
    torch.cuda.synchronize()
    out["eval_valid_s"] = time.perf_counter() - t
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mixers", nargs="+", default=["attention", "based"])
    p.add_argument("--L", type=int, default=256)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--examples", type=int, default=100_000)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--set", nargs="*", default=[], metavar="OVERRIDE",
                   help="Hydra overrides for every model of --mixers (e.g. +model.mixers.mamba.impl=triton)")
    args = p.parse_args()
    results = [profile_model(m, args) for m in args.mixers]
    keys = ["config_s", "data_s", "plain_ms", "plain_device_ms", "pack4_ms", "pack4_device_ms", "pack4_graph_ms",
            "pack4_graph_device_ms", "eval_valid_s"]
    print(f"{'mixer':18s} " + " ".join(f"{k:>14s}" for k in keys))
    for r in results:
        print(f"{r['mixer']:18s} " + " ".join(f"{r[k]:14.3f}" for k in keys))
    print(json.dumps({"L": args.L, "d": args.d, "batch": args.batch, "results": results}))


if __name__ == "__main__":
    main()
