"""Benchmark: generation throughput of the Based hybrid LM against a Llama of the same size (transformers).

    python experiments/bench/generation.py                       # H200: 1.3B shapes, bf16, batch sweep
    python experiments/bench/generation.py --tiny                # CPU smoke run: tiny models, fp32, seconds

Next H200 run (≤ 8 min; Llama's batches are few because each new shape recompiles its decode, and 1024+1024
tokens of its KV cache are 0.48 GB per sequence, so its best batch is ≤ 256):
    python experiments/bench/generation.py --based-batches 1,64,256,1024,4096 --llama-batches 1,64,128,256 \
        --budget-s 200

Both models have random weights. Based: `zoo/configs/model/based_1b.yaml` (1.35B parameters, Based impl=triton on
CUDA) as ZooForCausalLM, whose decode steps replay a CUDA graph over the fixed recurrent state. Llama:
`LlamaForCausalLM` with SDPA attention and a static KV cache (transformers compiles its decode step, CUDA
graphs included), its depth chosen so its parameter count is closest to Based's. Both run through
`model.generate` (greedy, exactly `--gen` new tokens) on the same random prompts of `--prompt` tokens.

For each batch size of --batches (by default ×4 from 1), until the model runs out of memory:
- prefill: median time of one forward over the prompt batch that fills the cache (CUDA events);
- decode: generated tokens/s = batch·gen / (generate time − prefill time), after a warm-up generate that
  compiles and captures what it needs (excluded);
- GB/s: the bytes one decode step must read at least (weights + recurrent state or KV cache) over the time
  per step, against the copy bandwidth measured in the same process.
After the Based batches, before the baseline, `--profile-batch` (1,024; tiny: 2) profiles one Based decode step
part by part (experiments/bench/decode_profile.py): time, bytes, FLOPs and their fractions of the copy bandwidth
and of the GEMM rate, beside the CUDA-graph step's time.
The last line is JSON: every row, each model's best decode throughput (`based_tok_s`, `llama_tok_s`), the ratio
`decode_ratio_best` (target ≥ 24×, the Based paper's claim against FlashAttention-2), `decode_frac_copy_bw`
(Based's best decode row's GB/s over the copy bandwidth; target ≥ 0.7), prefill at batch 1 and at the largest
batch both models ran, and the decode profile.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

import zoo  # noqa: F401  (registers the zoo model type)
from zoo.config import ModelConfig
from zoo.models.hf import CACHE_KEY, ZooConfig, ZooForCausalLM

try:  # run as a script (python experiments/bench/generation.py) or as a module
    from decode_profile import gemm_rate, print_profile, profile_decode, weight_bytes
except ImportError:
    from experiments.bench.decode_profile import gemm_rate, print_profile, profile_decode, weight_bytes

REPO = Path(__file__).resolve().parents[2]


def based_model(preset: str, vocab: int, device: torch.device, dtype: torch.dtype, impl: str) -> ZooForCausalLM:
    preset_file = REPO / "zoo/configs/model" / f"{preset}.yaml"
    node = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(preset_file))
    node.vocab_size = vocab
    node.mixers.based.impl = impl
    mc = OmegaConf.to_object(node)
    with torch.device(device):
        model = ZooForCausalLM(ZooConfig.from_model_config(mc))
    return model.to(dtype).eval()


def llama_config(d: int, layers: int, vocab: int, heads: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=int(8 * d / 3 / 64 + 1) * 64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )


def llama_model(target_params: int, d: int, heads: int, vocab: int, device, dtype) -> LlamaForCausalLM:
    """A Llama of width d whose depth brings its parameter count closest to target_params."""
    with torch.device("meta"):
        one, two = (LlamaForCausalLM(llama_config(d, n, vocab, heads)).num_parameters() for n in (1, 2))
    per_layer = two - one
    layers = max(1, round((target_params - (one - per_layer)) / per_layer))
    with torch.device(device):
        model = LlamaForCausalLM(llama_config(d, layers, vocab, heads))
    return model.to(dtype).eval()


class Timer:
    """Wall time with CUDA events on the GPU, perf_counter on the CPU; seconds."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def copy_bandwidth(device: torch.device, timer: Timer) -> float:
    x = torch.randn(2**26 if device.type == "cuda" else 2**22, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    seconds = statistics.median(timer(lambda: y.copy_(x)) for _ in range(10))
    return 2 * x.numel() * 4 / seconds


def decode_state_bytes(kind: str, model, batch: int, length: int) -> int:
    """Bytes of recurrent state (Based: fp32 states, ring buffers, conv) or KV cache read per decode step."""
    if kind == "based":
        lm = model.model
        fp32 = sum(b.state_size(length) for b in lm.blocks if b.mixer.name == "based")
        rest = sum(b.state_size(length) for b in lm.blocks if b.mixer.name != "based")
        return batch * (4 * fp32 + model.dtype.itemsize * rest)
    c = model.config
    return (
        batch
        * 2
        * c.num_hidden_layers
        * length
        * c.num_key_value_heads
        * (c.hidden_size // c.num_attention_heads)
        * (model.dtype.itemsize)
    )


def generate_kwargs(kind: str, gen: int, prompt: int) -> dict:
    kwargs = {"max_new_tokens": gen, "min_new_tokens": gen, "do_sample": False, "pad_token_id": 0}
    if kind == "llama":
        kwargs.update(cache_implementation="static", max_cache_len=prompt + gen)
    return kwargs


def prefill(kind: str, model, ids: torch.Tensor) -> None:
    if kind == "based":
        model(ids, use_cache=True, logits_to_keep=1)
    else:
        from transformers import StaticCache

        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1])
        model(ids, cache=cache, use_cache=True, logits_to_keep=1)


def measure(kind: str, model, batch: int, args, timer: Timer, device) -> dict:
    g = torch.Generator(device="cpu").manual_seed(batch)
    ids = torch.randint(1, model.config.vocab_size, (batch, args.prompt), generator=g).to(device)
    kwargs = generate_kwargs(kind, args.gen, args.prompt)
    with torch.no_grad():
        for _ in range(args.warmups):  # compile / capture / autotune, excluded
            prefill(kind, model, ids)
            model.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        prefill_s = statistics.median(timer(lambda: prefill(kind, model, ids)) for _ in range(args.repeats))
        out = {}
        total_s = timer(lambda: out.setdefault("seq", model.generate(ids, **kwargs)))
    assert out["seq"].shape == (batch, args.prompt + args.gen), out["seq"].shape
    decode_s = max(total_s - prefill_s, 1e-9)
    step_s = decode_s / args.gen
    step_bytes = weight_bytes(model) + decode_state_bytes(kind, model, batch, args.prompt + args.gen // 2)
    return {
        "model": kind,
        "batch": batch,
        "prefill_ms": 1e3 * prefill_s,
        "decode_tokens_per_s": batch * args.gen / decode_s,
        "ms_per_step": 1e3 * step_s,
        "decode_GB_per_s": step_bytes / step_s / 1e9,
        "peak_mem_GB": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
    }


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


def sweep(kind: str, model, args, timer: Timer, device) -> list[dict]:
    rows = []
    start = time.perf_counter()
    for batch in args.model_batches.get(kind) or args.batches:
        if args.budget_s and time.perf_counter() - start > args.budget_s:
            print(f"{kind}: time budget of {args.budget_s:.0f} s spent; batches from {batch} not run", flush=True)
            break
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            row = measure(kind, model, batch, args, timer, device)
        except (torch.cuda.OutOfMemoryError, RuntimeError) as err:
            if not is_oom(err):
                raise
            print(f"{kind}: batch {batch} does not fit ({type(err).__name__}); the sweep stops here", flush=True)
            break
        rows.append(row)
        print(
            f"{kind:>6} {batch:>6} {row['prefill_ms']:>11.1f} {row['decode_tokens_per_s']:>14,.0f} "
            f"{row['ms_per_step']:>9.2f} {row['decode_GB_per_s']:>8.0f}",
            flush=True,
        )
    return rows


def decode_profile(based, args, timer: Timer, device, dtype, bandwidth: float) -> dict | None:
    """Prefill a batch of `--profile-batch` prompts, time CUDA-graph decode steps, then profile eager ones."""
    batch = args.profile_batch
    g = torch.Generator(device="cpu").manual_seed(batch)
    ids = torch.randint(1, based.config.vocab_size, (batch, args.prompt), generator=g).to(device)
    nxt = torch.randint(1, based.config.vocab_size, (batch, 1), generator=g).to(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        with torch.no_grad():
            cache = getattr(based(ids, use_cache=True, logits_to_keep=1, return_dict=True), CACHE_KEY)
            graph_ms = None
            if device.type == "cuda" and based.config.decode_cuda_graph:
                for _ in range(3):
                    based(nxt, cache=cache, use_cache=True)
                steps = 20
                graph_ms = 1e3 * timer(lambda: [based(nxt, cache=cache, use_cache=True) for _ in range(steps)]) / steps
            result = profile_decode(based.model, cache.states, nxt[:, 0], bandwidth, gemm_rate(device, dtype))
    except (torch.cuda.OutOfMemoryError, RuntimeError) as err:
        if not is_oom(err):
            raise
        print(f"decode profile: batch {batch} does not fit ({type(err).__name__}); no profile", flush=True)
        return None
    result["graph_step_ms"] = graph_ms
    print_profile(result, graph_ms)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU-sized models and lengths (a smoke run)")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (1024; tiny: 32)")
    parser.add_argument("--gen", type=int, default=None, help="generated tokens (1024; tiny: 16)")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (1,4,...,4096; tiny: 1,2)")
    parser.add_argument("--based-batches", default=None, help="Based's batch sizes (default: --batches)")
    parser.add_argument(
        "--llama-batches",
        default=None,
        help="Llama's batch sizes (default: --batches); each new shape recompiles its static-cache decode (~1 min)",
    )
    parser.add_argument("--prefill-chunk-tokens", type=int, default=131072, help="Based prefill row slices (GPU)")
    parser.add_argument("--repeats", type=int, default=3, help="prefill timings per batch (median)")
    parser.add_argument("--warmups", type=int, default=2, help="untimed prefill + short generate rounds per batch")
    parser.add_argument("--budget-s", type=float, default=0.0, help="per model: start no batch after this (0: none)")
    parser.add_argument("--profile-batch", type=int, default=None,
                        help="profile one Based decode step at this batch (1024; tiny: 2; 0: no profile)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.tiny:
        preset, vocab, dtype, impl = "based_tiny", 512, torch.float32, "naive"
        args.prompt, args.gen, batches = args.prompt or 32, args.gen or 16, args.batches or "1,2"
        args.repeats = 1
        args.profile_batch = 2 if args.profile_batch is None else args.profile_batch
    else:
        preset, vocab, impl = "based_1b", 50304, "triton" if device.type == "cuda" else "naive"
        dtype = torch.bfloat16
        args.prompt, args.gen, batches = (
            args.prompt or 1024,
            args.gen or 1024,
            args.batches or "1,4,16,64,256,1024,4096",
        )
        args.profile_batch = 1024 if args.profile_batch is None else args.profile_batch
    args.batches = [int(b) for b in batches.split(",")]
    args.model_batches = {
        kind: [int(b) for b in value.split(",")] if value else None
        for kind, value in (("based", args.based_batches), ("llama", args.llama_batches))
    }
    torch.manual_seed(0)
    timer = Timer(device)
    based = based_model(preset, vocab, device, dtype, impl)
    if device.type == "cuda":
        # A whole batch of long prompts in one forward would need far more activation memory than decoding.
        based.config.prefill_chunk_tokens = args.prefill_chunk_tokens
    d = based.config.d_model
    llama = llama_model(based.num_parameters(), d, max(1, d // 64), vocab, device, dtype)
    bandwidth = copy_bandwidth(device, timer)
    print(
        f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), {dtype}, "
        f"prompt {args.prompt}, generated {args.gen}; copy bandwidth {bandwidth / 1e9:.0f} GB/s"
    )
    print(
        f"based: {based.num_parameters() / 1e6:.1f}M parameters ({preset}, impl={impl}); llama: "
        f"{llama.num_parameters() / 1e6:.1f}M ({llama.config.num_hidden_layers} layers, d={d})"
    )
    print(f"{'model':>6} {'batch':>6} {'prefill ms':>11} {'decode tok/s':>14} {'ms/step':>9} {'GB/s':>8}")
    rows = sweep("based", based, args, timer, device)
    # The profile needs Based only: it runs before the baseline, so a call cut short still has it.
    profile = decode_profile(based, args, timer, device, dtype, bandwidth) if args.profile_batch else None
    rows += sweep("llama", llama, args, timer, device)
    best_row = {k: max((r for r in rows if r["model"] == k), key=lambda r: r["decode_tokens_per_s"], default=None)
                for k in ("based", "llama")}
    best = {k: r["decode_tokens_per_s"] if r else 0.0 for k, r in best_row.items()}
    at_batch1 = {k: next((r["prefill_ms"] for r in rows if r["model"] == k and r["batch"] == 1), None) for k in best}
    ran = {k: {r["batch"] for r in rows if r["model"] == k} for k in best}
    common = sorted(ran["based"] & ran["llama"])
    at_common = None
    if common:
        at_common = {k: next(r["prefill_ms"] for r in rows if r["model"] == k and r["batch"] == common[-1])
                     for k in best}
    result = {
        "device": str(device),
        "dtype": str(dtype),
        "prompt": args.prompt,
        "generated": args.gen,
        "params": {"based": based.num_parameters(), "llama": llama.num_parameters()},
        "copy_GB_per_s": bandwidth / 1e9,
        "rows": rows,
        "based_tok_s": best["based"],
        "llama_tok_s": best["llama"],
        "decode_ratio_best": best["based"] / best["llama"] if best["based"] and best["llama"] else None,
        "decode_frac_copy_bw": best_row["based"]["decode_GB_per_s"] * 1e9 / bandwidth if best_row["based"] else None,
        "prefill_ms_batch1": at_batch1,
        "prefill_ratio_batch1": at_batch1["llama"] / at_batch1["based"] if all(at_batch1.values()) else None,
        "prefill_batch_common": common[-1] if common else None,
        "prefill_ms_common": at_common,
        "prefill_ratio_common": at_common["llama"] / at_common["based"] if at_common else None,
        "target_ratio": 24.0,
    }
    if args.profile_batch:
        result["decode_profile"] = profile
    print(
        f"best decode: based {best['based']:,.0f} tok/s, llama {best['llama']:,.0f} tok/s, "
        f"ratio {result['decode_ratio_best'] or float('nan'):.2f}x (target 24x)"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
