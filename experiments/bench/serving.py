"""Benchmark: serving throughput and KV memory of a 512-token cartridge against an 8K-token corpus in context.

Next GPU session (one H200, its transformers 5.17; under 5 minutes for the bench, about 1 for the tests):

    .venv/bin/pytest -q tests/cartridges/test_serve.py -k "cuda_graph or greedy or kept"
    .venv/bin/python experiments/bench/serving.py 2>&1 | tee serving_h200.log

The first line checks that the captured decode step gives the eager step's greedy tokens (fp32 and bf16). In
the bench's JSON, `notes.cartridge_graphs` must show captures and no failures (a failed capture logs a warning
on stderr and decodes eagerly, which the ratio would then measure); `ratio_cartridge_vs_icl` is the target and
`ratio_cartridge_vs_shared_prefix` the gain over prefix caching.

    python experiments/bench/serving.py          # H200: SmolLM2-135M's shape, random weights, bf16
    python experiments/bench/serving.py --tiny   # CPU smoke run: a tiny Llama, fp32, seconds

The model is a LlamaForCausalLM built from a LlamaConfig of SmolLM2-135M's shape (30 layers, d 576, 9 heads,
3 KV heads, vocab 49152) with random weights: speed and memory do not depend on the weights. The corpus is
`--corpus` random token ids. Every request has its own random `--prompt`-token question and decodes exactly
`--gen` tokens greedily (EOS ignored). Arms, in this order, each over the batch sizes of `--batches` (jumps, not
doublings, so a few minutes reach the batches where KV size decides throughput):

- `cartridge`: a 512-token cartridge (the KV of the corpus' first 512 tokens stands in for a trained one: only
  its size matters here) through `Server`: one shared copy, cascade attention, the decode step captured as a
  CUDA graph on CUDA (the JSON says whether captures happened or fell back).
- `icl_static`: the corpus KV copied once per sequence into a preallocated `StaticCache` (in-place writes,
  masked SDPA), eager.
- `icl_dynamic`: the corpus in context the way transformers shares a prefix: its KV is computed once and
  handed to every request as a view (`Cartridge.from_prefix(corpus).as_cache`); transformers' `DynamicCache`
  then copies it per sequence at the first step and appends with `torch.cat`. Run through `Server` with
  `shared_prefix=False` (the plain path: the model's own SDPA attention), eager.
- `cartridge_plain`: the cartridge on the plain path (a copy per sequence, eager), to separate the gain of the
  smaller cache from the gain of sharing it and of the graph.
- `icl_shared`: the baseline a user would run today: the corpus as one shared prefix through the same cascade
  path and CUDA graphs as the cartridge (one copy of its KV for the whole batch, what vLLM's and SGLang's prefix
  caching give). Only the cache's size differs from `cartridge`: 8K tokens against 512.

A batch starts only while its arm is within `--budget-s` and the whole sweep within `--total-s`; an
out-of-memory error ends the arm after one try halfway (geometrically) between the last batch that fit and the
one that did not. Every batch size of a graphed arm runs once unmeasured first (the capture happens there).

Throughput = batch·gen / wall time of the whole batch (cache setup, prompt prefill and decode; the corpus'
prefill, done once, is excluded). Peak memory = peak allocated during the batch minus what was allocated
before it (KV plus activations; for a graphed arm, over its unmeasured and measured runs, the capture
included); KV = the bytes the cache tensors hold. The last line is JSON with every row,
each arm's best throughput and largest KV, and two ratios of best throughputs: cartridge / best transformers ICL
arm (`ratio_cartridge_vs_icl`, target >= 10x; the paper reports 26.4x) and cartridge / `icl_shared`
(`ratio_cartridge_vs_shared_prefix`). A ratio is printed only when its baseline finished its batch sweep (every
batch size run, or stopped by running out of memory): a baseline stopped by the time budget or an error may
not have reached its best batch, and a ratio over it would overstate the gain (the JSON then holds null and
`ratio_withheld` says why).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time
import traceback

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from cartridges.cache import Cartridge, cache_kwargs
from cartridges.engine import GenerationRequest, Server


def llama(tiny: bool, max_positions: int) -> LlamaConfig:
    if tiny:
        shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
        shape.update(num_attention_heads=4, num_key_value_heads=2)
    else:  # SmolLM2-135M
        shape = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30)
        shape.update(num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, tie_word_embeddings=True)
    return LlamaConfig(**shape, max_position_embeddings=max_positions, attn_implementation="sdpa")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def kv_bytes_per_token(config: LlamaConfig, dtype: torch.dtype) -> int:
    head_dim = config.hidden_size // config.num_attention_heads
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * itemsize


class StaticICL:
    """The corpus KV copied per sequence into a transformers StaticCache, then greedy decode."""

    def __init__(self, model, corpus_cartridge: Cartridge, length: int):
        self.model, self.length = model, length
        self.keys = corpus_cartridge.keys().to(model.dtype)  # [L, H, C, D]
        self.values = corpus_cartridge.values().to(model.dtype)

    @torch.no_grad()
    def run(self, prompts: torch.Tensor, gen: int) -> int:
        from transformers import StaticCache

        model, batch, corpus = self.model, prompts.shape[0], self.keys.shape[2]
        cache = StaticCache(config=model.config, max_cache_len=self.length)
        positions = torch.arange(corpus, device=prompts.device)
        for layer in range(self.keys.shape[0]):
            k = self.keys[layer].unsqueeze(0).expand(batch, -1, -1, -1)  # [B, H, C, D]
            v = self.values[layer].unsqueeze(0).expand(batch, -1, -1, -1)
            # transformers 5.1x takes the positions in cache_kwargs; 5.2x appends at its own counter
            cache.update(k, v, layer, {"cache_position": positions})
        kw = cache_kwargs(model, cache)
        start = corpus
        pos = torch.arange(start, start + prompts.shape[1], device=prompts.device)[None].expand(batch, -1)
        logits = model(input_ids=prompts, position_ids=pos, use_cache=True, logits_to_keep=1, **kw).logits[:, -1]
        start += prompts.shape[1]
        for step in range(gen - 1):
            token = logits.argmax(-1, keepdim=True)  # [B, 1]
            pos = torch.full((batch, 1), start + step, device=prompts.device)
            logits = model(input_ids=token, position_ids=pos, use_cache=True, logits_to_keep=1, **kw).logits[:, -1]
        logits.argmax(-1).tolist()
        return batch * self.length * kv_bytes_per_token(model.config, model.dtype)


def next_batch_after_oom(good: int | None, failed: int) -> int | None:
    """One more try between the largest batch that fit and the one that ran out of memory (a power of two)."""
    if good is None:
        return None
    mid = 2 ** round((math.log2(good) + math.log2(failed)) / 2)
    return mid if good < mid < failed else None


ICL_ARMS = ("icl_dynamic", "icl_static")  # the corpus in context the ways transformers offers
RATIOS = {"ratio_cartridge_vs_icl": ICL_ARMS, "ratio_cartridge_vs_shared_prefix": ("icl_shared",)}


def ratios(best: dict[str, dict], unfinished: dict[str, str], arms: list[str]):
    """(ratio name -> (value, baseline arm) or None, ratio name -> why it is withheld).

    best: each arm's best row; unfinished: arm -> why its sweep ended early (time budget, error); arms: those run.
    A ratio over baselines that did not all finish would compare against a throughput they might have beaten.
    """
    out, withheld = {}, {}
    for name, baselines in RATIOS.items():
        ran = [a for a in baselines if a in arms]
        why = [f"{a} did not finish its sweep ({unfinished[a]})" for a in ran if a in unfinished]
        if not ran:
            why.append(f"no baseline arm run (one of {list(baselines)})")
        elif not any(a in best for a in ran):
            why.append("no baseline batch measured")
        if "cartridge" not in best:
            why.append("no cartridge batch measured")
        if why:
            out[name], withheld[name] = None, "; ".join(why)
            continue
        base = max((best[a] for a in ran if a in best), key=lambda r: r["tokens_per_s"])
        out[name] = (best["cartridge"]["tokens_per_s"] / base["tokens_per_s"], base["arm"])
    return out, withheld


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU-sized model and lengths (a smoke run)")
    parser.add_argument("--corpus", type=int, default=None, help="corpus tokens (8192; tiny: 256)")
    parser.add_argument("--cartridge", type=int, default=None, help="cartridge tokens (512; tiny: 32)")
    parser.add_argument("--prompt", type=int, default=None, help="question tokens per request (32; tiny: 8)")
    parser.add_argument("--gen", type=int, default=None, help="generated tokens per request (64; tiny: 8)")
    parser.add_argument("--batches", default=None, help="batch sizes (1,16,64,256,1024,4096,16384; tiny: 1,4,16)")
    parser.add_argument("--max-batch", type=int, default=None, help="drop batch sizes above this")
    parser.add_argument("--budget-s", type=float, default=None, help="per arm: start no batch after (50; tiny: 10)")
    parser.add_argument("--total-s", type=float, default=None, help="whole sweep: start no batch after (290; tiny: 50)")
    parser.add_argument("--arms", default="cartridge,icl_static,icl_dynamic,cartridge_plain,icl_shared")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="decode the cartridge arms eagerly")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    tiny = args.tiny
    corpus_len = args.corpus or (256 if tiny else 8192)
    cart_len = args.cartridge or (32 if tiny else 512)
    prompt_len = args.prompt or (8 if tiny else 32)
    gen = args.gen or (8 if tiny else 64)
    batches = [int(b) for b in (args.batches or ("1,4,16" if tiny else "1,16,64,256,1024,4096,16384")).split(",")]
    batches = [b for b in batches if args.max_batch is None or b <= args.max_batch]
    budget = args.budget_s if args.budget_s is not None else (10.0 if tiny else 50.0)
    total = args.total_s if args.total_s is not None else (50.0 if tiny else 290.0)
    arms = args.arms.split(",")
    unknown = set(arms) - {"cartridge", "icl_static", "icl_dynamic", "cartridge_plain", "icl_shared"}
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    graphs = None if not args.no_cuda_graphs else False

    config = llama(tiny, max_positions=corpus_len + prompt_len + gen + 16)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model = model.to(dtype).eval().requires_grad_(False)
    gen_ids = torch.Generator().manual_seed(1)
    corpus = torch.randint(3, config.vocab_size, (1, corpus_len), generator=gen_ids)
    per_token = kv_bytes_per_token(config, dtype)
    max_batch = max(batches)

    workdir = tempfile.TemporaryDirectory()
    icl_dir, cart_dir = f"{workdir.name}/icl", f"{workdir.name}/cart"
    for d in (icl_dir, cart_dir):
        os.makedirs(d)
    # the corpus' KV, computed once: the ICL arms' shared prefix (an exact-prefix cartridge equals the corpus)
    Cartridge.from_prefix(model, corpus.to(device), dtype=dtype).save(f"{icl_dir}/corpus.safetensors")
    Cartridge.from_prefix(model, corpus[:, :cart_len].to(device), dtype=dtype).save(f"{cart_dir}/c.safetensors")
    servers = {
        "icl_dynamic": (Server(model, icl_dir, shared_prefix=False, max_batch_size=max_batch), "corpus"),
        "cartridge": (Server(model, cart_dir, max_batch_size=max_batch, cuda_graphs=graphs), "c"),
        "cartridge_plain": (Server(model, cart_dir, shared_prefix=False, max_batch_size=max_batch), "c"),
        "icl_shared": (Server(model, icl_dir, max_batch_size=max_batch, cuda_graphs=graphs), "corpus"),
    }
    static = StaticICL(model, servers["icl_dynamic"][0].store.get(("corpus",)).cartridge, corpus_len + prompt_len + gen)

    def run_arm(arm: str, prompts: torch.Tensor, steps: int) -> int:
        """One batch; returns the KV bytes its cache held."""
        if arm == "icl_static":
            return static.run(prompts.to(device), steps)
        server, cid = servers[arm]
        requests = [
            GenerationRequest(prompt=p, cartridges=[cid], max_tokens=steps, ignore_eos=True) for p in prompts.tolist()
        ]
        server.generate(requests)
        if server.shared_prefix:
            return server.last_cache.memory_bytes()
        prefix = corpus_len if arm == "icl_dynamic" else cart_len
        return len(requests) * (prefix + prompts.shape[1] + steps) * per_token

    def release(arm: str) -> None:
        if arm in servers:
            servers[arm][0].release()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    header = f"{'arm':16s} {'batch':>6s} {'seconds':>9s} {'tokens/s':>13s} {'KV MiB':>12s} {'peak MiB':>12s}"
    print(header, flush=True)
    rows, errors, notes, unfinished = [], {}, {}, {}
    sweep_start = time.perf_counter()
    for arm in arms:
        arm_start = time.perf_counter()
        graphed = arm in servers and servers[arm][0].cuda_graphs
        try:  # warm-up (allocator, kernels, cartridge loading), excluded
            run_arm(arm, torch.randint(3, config.vocab_size, (2, prompt_len), generator=gen_ids), 2)
        except Exception as e:  # noqa: BLE001 (an arm that cannot run here is reported, not fatal)
            errors[arm] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            unfinished[arm] = "failed in its warm-up"
            traceback.print_exc(file=sys.stderr)
            release(arm)
            continue
        queue, good, last = list(batches), None, None  # last: (batch, seconds) of the latest measured batch
        while queue:
            batch = queue.pop(0)
            now = time.perf_counter()
            # predicted time of this batch: the last one's, scaled by the batch ratio (memory-bound at worst)
            guess = 0.0 if last is None else last[1] * max(1.0, batch / last[0]) * (2 if graphed else 1)
            if now + guess - arm_start > budget or now + guess - sweep_start > total:
                notes[arm] = unfinished[arm] = f"stopped by the time budget before batch {batch}"
                break
            prompts = torch.randint(3, config.vocab_size, (batch, prompt_len), generator=gen_ids)
            failure = None
            try:
                sync(device)
                if device.type == "cuda":
                    # before the unmeasured run of a graphed arm: the decoder it keeps holds the batch's KV
                    torch.cuda.reset_peak_memory_stats(device)
                    before = torch.cuda.memory_allocated(device)
                if graphed:  # the capture for this shape happens here, unmeasured
                    run_arm(arm, prompts, gen)
                    sync(device)
                t0 = time.perf_counter()
                kv = run_arm(arm, prompts, gen)
                sync(device)
                seconds = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001
                if not is_oom(e):
                    errors[arm] = f"batch {batch}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    traceback.print_exc(file=sys.stderr)
                    failure = "error"
                else:
                    failure = "oom"
            if failure is not None:
                release(arm)
                if failure == "error":
                    unfinished[arm] = f"an error at batch {batch}"
                    break
                notes[arm] = f"out of memory at batch {batch}"
                retry = next_batch_after_oom(good, batch)
                queue = [retry] if retry is not None else []
                continue
            peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else 0
            rows.append(
                {
                    "arm": arm,
                    "batch": batch,
                    "seconds": round(seconds, 4),
                    "tokens_per_s": round(batch * gen / seconds, 1),
                    "kv_bytes": kv,
                    "peak_extra_bytes": peak,
                }
            )
            good, last = batch, (batch, seconds)
            r = rows[-1]
            print(
                f"{arm:16s} {batch:6d} {seconds:9.3f} {r['tokens_per_s']:13,.0f} {kv / 2**20:12,.1f} "
                f"{peak / 2**20:12,.1f}",
                flush=True,
            )
        if arm in servers and servers[arm][0].shared_prefix:
            stats = servers[arm][0].stats
            notes[arm + "_graphs"] = {k: stats[k] for k in ("graph_captures", "graph_replays", "graph_failures")}
        release(arm)

    best, largest = {}, {}
    for r in rows:
        if r["tokens_per_s"] > best.get(r["arm"], {}).get("tokens_per_s", 0):
            best[r["arm"]] = r
        if r["kv_bytes"] > largest.get(r["arm"], {}).get("kv_bytes", -1):
            largest[r["arm"]] = r
    found, withheld = ratios(best, unfinished, arms)
    print()
    print(header + "  (best per arm)")
    for arm, r in best.items():
        print(
            f"{arm:16s} {r['batch']:6d} {r['seconds']:9.3f} {r['tokens_per_s']:13,.0f} {r['kv_bytes'] / 2**20:12,.1f} "
            f"{r['peak_extra_bytes'] / 2**20:12,.1f}"
        )
    for arm, r in largest.items():
        print(
            f"{arm}: largest batch {r['batch']}, KV {r['kv_bytes'] / 2**20:,.1f} MiB, "
            f"peak {r['peak_extra_bytes'] / 2**20:,.1f} MiB"
        )
    for arm, err in errors.items():
        print(f"{arm}: error: {err}")
    for arm, note in notes.items():
        print(f"{arm}: {note}")
    labels = {"ratio_cartridge_vs_icl": "corpus in context", "ratio_cartridge_vs_shared_prefix": "shared prefix"}
    for name, value in found.items():
        if value is None:
            print(f"{name}: not printed: {withheld[name]}")
        else:
            target = " (target >= 10x)" if name == "ratio_cartridge_vs_icl" else ""
            print(f"cartridge / {labels[name]} ({value[1]}): {value[0]:.1f}x throughput{target}")
    result = {
        "bench": "serving",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "model": "tiny-llama" if tiny else "smollm2-135m-shape (random weights)",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "corpus_tokens": corpus_len,
        "cartridge_tokens": cart_len,
        "prompt_tokens": prompt_len,
        "gen_tokens": gen,
        "batches": batches,
        "budget_s": budget,
        "total_s": total,
        "kv_bytes_per_token": per_token,
        "rows": rows,
        "best": {
            arm: {k: r[k] for k in ("batch", "tokens_per_s", "kv_bytes", "peak_extra_bytes")} for arm, r in best.items()
        },
        "largest": {
            arm: {k: r[k] for k in ("batch", "tokens_per_s", "kv_bytes", "peak_extra_bytes")}
            for arm, r in largest.items()
        },
        "errors": errors,
        "notes": notes,
        "seconds_total": round(time.perf_counter() - sweep_start, 1),
        "baseline_arm": found["ratio_cartridge_vs_icl"][1] if found["ratio_cartridge_vs_icl"] else None,
        **{name: None if value is None else round(value[0], 2) for name, value in found.items()},
        "ratio_withheld": withheld,
        "unfinished": unfinished,
        "target_ratio": 10.0,
    }
    workdir.cleanup()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
