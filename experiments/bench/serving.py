"""Benchmark: serving throughput and KV memory of a 512-token cartridge against an 8K-token corpus in context.

    python experiments/bench/serving.py          # H200: SmolLM2-135M's shape, random weights, bf16
    python experiments/bench/serving.py --tiny   # CPU smoke run: a tiny Llama, fp32, seconds

The model is a LlamaForCausalLM built from a LlamaConfig of SmolLM2-135M's shape (30 layers, d 576, 9 heads,
3 KV heads, vocab 49152) with random weights: speed and memory do not depend on the weights. The corpus is
`--corpus` random token ids. Every request has its own random `--prompt`-token question and decodes exactly
`--gen` tokens greedily (EOS ignored). Arms, each swept over batch sizes doubling from 1 until it runs out of
memory, `--max-batch` or its `--budget-s`:

- `icl_dynamic`: the corpus in context the way transformers shares a prefix: its KV is computed once and
  handed to every request as a view (`Cartridge.from_prefix(corpus).as_cache`); transformers' `DynamicCache`
  then copies it per sequence at the first step and appends with `torch.cat`. Run through `Server` with
  `shared_prefix=False` (the plain path: the model's own SDPA attention).
- `icl_static`: the same KV copied once per sequence into a preallocated `StaticCache` (in-place writes,
  masked SDPA).
- `cartridge`: a 512-token cartridge (the KV of the corpus' first 512 tokens stands in for a trained one: only
  its size matters here) through `Server`: one shared copy, cascade attention.
- `cartridge_plain`: the same cartridge on the plain path (a copy per sequence), to separate the gain of the
  smaller cache from the gain of sharing it.

Throughput = batch·gen / wall time of the whole batch (cache setup, prompt prefill and decode; the corpus'
prefill, done once, is excluded). Peak memory = peak allocated during the batch minus what was allocated
before it (KV plus activations); KV = the bytes the cache tensors hold. The last line is JSON with every row,
each arm's best throughput and the ratio cartridge / best ICL arm (target >= 10x; the paper reports 26.4x).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cartridges.cache import Cartridge, cache_kwargs
from cartridges.serve import GenerationRequest, Server


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU-sized model and lengths (a smoke run)")
    parser.add_argument("--corpus", type=int, default=None, help="corpus tokens (8192; tiny: 256)")
    parser.add_argument("--cartridge", type=int, default=None, help="cartridge tokens (512; tiny: 32)")
    parser.add_argument("--prompt", type=int, default=None, help="question tokens per request (32; tiny: 8)")
    parser.add_argument("--gen", type=int, default=None, help="generated tokens per request (128; tiny: 8)")
    parser.add_argument("--max-batch", type=int, default=None, help="largest batch tried (4096; tiny: 4)")
    parser.add_argument("--budget-s", type=float, default=None, help="per arm: start no batch after (45; tiny: 10)")
    parser.add_argument("--arms", default="icl_dynamic,icl_static,cartridge,cartridge_plain")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    tiny = args.tiny
    corpus_len = args.corpus or (256 if tiny else 8192)
    cart_len = args.cartridge or (32 if tiny else 512)
    prompt_len = args.prompt or (8 if tiny else 32)
    gen = args.gen or (8 if tiny else 128)
    max_batch = args.max_batch or (4 if tiny else 4096)
    budget = args.budget_s if args.budget_s is not None else (10.0 if tiny else 45.0)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    config = llama(tiny, max_positions=corpus_len + prompt_len + gen + 16)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model = model.to(dtype).eval().requires_grad_(False)
    gen_ids = torch.Generator().manual_seed(1)
    corpus = torch.randint(3, config.vocab_size, (1, corpus_len), generator=gen_ids)
    per_token = kv_bytes_per_token(config, dtype)

    workdir = tempfile.TemporaryDirectory()
    icl_dir, cart_dir = f"{workdir.name}/icl", f"{workdir.name}/cart"
    for d in (icl_dir, cart_dir):
        os.makedirs(d)
    # the corpus' KV, computed once: the ICL arms' shared prefix (an exact-prefix cartridge equals the corpus)
    Cartridge.from_prefix(model, corpus.to(device), dtype=dtype).save(f"{icl_dir}/corpus.safetensors")
    Cartridge.from_prefix(model, corpus[:, :cart_len].to(device), dtype=dtype).save(f"{cart_dir}/c.safetensors")
    servers = {
        "icl_dynamic": (Server(model, icl_dir, shared_prefix=False, max_batch_size=max_batch), "corpus"),
        "cartridge": (Server(model, cart_dir, max_batch_size=max_batch), "c"),
        "cartridge_plain": (Server(model, cart_dir, shared_prefix=False, max_batch_size=max_batch), "c"),
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
        if arm == "cartridge":
            return server.last_cache.memory_bytes()
        prefix = corpus_len if arm == "icl_dynamic" else cart_len
        return len(requests) * (prefix + prompts.shape[1] + steps) * per_token

    header = f"{'arm':16s} {'batch':>6s} {'seconds':>9s} {'tokens/s':>13s} {'KV MiB':>12s} {'peak MiB':>12s}"
    print(header)
    rows, errors = [], {}
    for arm in args.arms.split(","):
        arm_start = time.perf_counter()
        batch = 1
        try:  # warm-up (allocator, kernels, cartridge loading), excluded
            run_arm(arm, torch.randint(3, config.vocab_size, (2, prompt_len), generator=gen_ids), 2)
        except Exception as e:  # noqa: BLE001 (an arm that cannot run on this transformers is reported, not fatal)
            errors[arm] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            continue
        while batch <= max_batch and time.perf_counter() - arm_start < budget:
            prompts = torch.randint(3, config.vocab_size, (batch, prompt_len), generator=gen_ids)
            sync(device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            try:
                t0 = time.perf_counter()
                kv = run_arm(arm, prompts, gen)
                sync(device)
                seconds = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001
                if not is_oom(e):
                    raise
                errors[arm] = f"out of memory at batch {batch}"
                torch.cuda.empty_cache()
                break
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
            r = rows[-1]
            print(
                f"{arm:16s} {batch:6d} {seconds:9.3f} {r['tokens_per_s']:13,.0f} {kv / 2**20:12,.1f} "
                f"{peak / 2**20:12,.1f}",
                flush=True,
            )
            batch *= 2

    best = {}
    for r in rows:
        if r["tokens_per_s"] > best.get(r["arm"], {}).get("tokens_per_s", 0):
            best[r["arm"]] = r
    icl = max(
        (best[a] for a in ("icl_dynamic", "icl_static") if a in best), key=lambda r: r["tokens_per_s"], default=None
    )
    print()
    print(header + "  (best per arm)")
    for arm, r in best.items():
        print(
            f"{arm:16s} {r['batch']:6d} {r['seconds']:9.3f} {r['tokens_per_s']:13,.0f} {r['kv_bytes'] / 2**20:12,.1f} "
            f"{r['peak_extra_bytes'] / 2**20:12,.1f}"
        )
    for arm, err in errors.items():
        print(f"{arm}: {err}")
    ratio = best["cartridge"]["tokens_per_s"] / icl["tokens_per_s"] if icl and "cartridge" in best else None
    if ratio is not None:
        print(f"cartridge / corpus in context ({icl['arm']}): {ratio:.1f}x throughput (target >= 10x)")
    result = {
        "bench": "serving",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "model": "tiny-llama" if tiny else "smollm2-135m-shape (random weights)",
        "corpus_tokens": corpus_len,
        "cartridge_tokens": cart_len,
        "prompt_tokens": prompt_len,
        "gen_tokens": gen,
        "kv_bytes_per_token": per_token,
        "rows": rows,
        "best": {
            arm: {k: r[k] for k in ("batch", "tokens_per_s", "kv_bytes", "peak_extra_bytes")} for arm, r in best.items()
        },
        "errors": errors,
        "baseline_arm": icl["arm"] if icl else None,
        "ratio_cartridge_vs_icl": round(ratio, 2) if ratio is not None else None,
        "target_ratio": 10.0,
    }
    workdir.cleanup()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
