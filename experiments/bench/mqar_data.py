"""Benchmark: MQAR data generation, vectorised generator against the per-example reference.

    python experiments/bench/mqar_data.py            # 100k examples at L=256, n=16, V=8192

Times `generate_mqar` on the full count and `generate_mqar_reference` on a tenth of it, scaled linearly
(the reference is a per-example loop, so its time is linear in the count). Medians of several repeats after a
warm-up. The floor is allocating and filling the two int64 output tensors, which any generator has to do.
Prints a table, then one JSON line with the figures.
"""

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from zoo.synthetics import MQARConfig, generate_mqar, generate_mqar_reference

TARGET_S = 0.2
TARGET_SPEEDUP = 75.0


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-examples", type=int, default=100_000)
    ap.add_argument("--reference-examples", type=int, default=10_000)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--num-kv-pairs", type=int, default=16)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--reference-repeats", type=int, default=3)
    args = ap.parse_args(argv)

    def cfg(num_examples: int, **kw) -> MQARConfig:
        return MQARConfig(args.vocab_size, args.seq_len, args.num_kv_pairs, num_examples, **kw)

    load_start = os.getloadavg()[0]
    N, R = args.num_examples, args.reference_examples
    out_bytes = 2 * N * args.seq_len * 8

    def floor():
        # Both outputs, allocated the way the generator allocates them and filled with all cores.
        for fill in (0, -100):
            torch.from_numpy(np.empty((N, args.seq_len), dtype=np.int64)).fill_(fill)

    seeds = iter(range(10**6))
    threads = torch.get_num_threads()
    generate_mqar(cfg(N), next(seeds))  # warm-up
    fast_s = median_time(lambda: generate_mqar(cfg(N), next(seeds)), args.repeats)
    torch.set_num_threads(1)
    fast_1t_s = median_time(lambda: generate_mqar(cfg(N), next(seeds)), args.repeats)
    torch.set_num_threads(threads)
    generate_mqar(cfg(N, random_non_queries=True), next(seeds))
    noise_s = median_time(lambda: generate_mqar(cfg(N, random_non_queries=True), next(seeds)), args.repeats)
    floor()
    floor_s = median_time(floor, args.repeats)
    generate_mqar_reference(cfg(min(R, 200)), 0)  # warm-up
    ref_measured = median_time(lambda: generate_mqar_reference(cfg(R), next(seeds)), args.reference_repeats)
    reference_s = ref_measured * N / R
    load_end = os.getloadavg()[0]

    speedup = reference_s / fast_s
    rows = [
        ("floor: allocate + fill outputs", N, floor_s, floor_s),
        (f"generate_mqar ({threads} threads)", N, fast_s, fast_s),
        ("generate_mqar (1 thread)", N, fast_1t_s, fast_1t_s),
        ("generate_mqar, random filler", N, noise_s, noise_s),
        (f"generate_mqar_reference (x{N / R:g})", R, ref_measured, reference_s),
    ]
    print(
        f"MQAR generation, L={args.seq_len} n={args.num_kv_pairs} V={args.vocab_size}, {N:,} examples, "
        f"torch threads={threads}, cpus={os.cpu_count()}, load avg {load_start:.2f}->{load_end:.2f}"
    )
    print(f"{'generator':40s} {'timed N':>8s} {'median s':>9s} {f's / {N:,}':>11s} {'GB/s out':>9s} {'vs ref':>8s}")
    for name, timed_n, measured, per_n in rows:
        print(
            f"{name:40s} {timed_n:8,d} {measured:9.3f} {per_n:11.3f} {out_bytes / per_n / 1e9:9.2f} "
            f"{reference_s / per_n:7.0f}x"
        )
    print(
        f"reference timed on {R:,} examples and scaled linearly to {N:,}; medians of {args.repeats} "
        f"(reference {args.reference_repeats}) repeats after a warm-up"
    )
    result = {
        "num_examples": N,
        "seq_len": args.seq_len,
        "num_kv_pairs": args.num_kv_pairs,
        "vocab_size": args.vocab_size,
        "fast_s": round(fast_s, 4),
        "fast_1thread_s": round(fast_1t_s, 4),
        "fast_random_filler_s": round(noise_s, 4),
        "floor_s": round(floor_s, 4),
        "reference_s": round(reference_s, 3),
        "reference_timed_examples": R,
        "speedup": round(speedup, 1),
        "fast_over_floor": round(fast_s / floor_s, 2),
        "target_s": TARGET_S,
        "target_speedup": TARGET_SPEEDUP,
        "target_met": bool(fast_s <= TARGET_S and speedup >= TARGET_SPEEDUP),
        "load_avg": [round(load_start, 2), round(load_end, 2)],
        "threads": threads,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
