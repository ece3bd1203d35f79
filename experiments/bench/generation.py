"""Benchmark: generation throughput of the Based hybrid LM against a Llama of the same size (transformers).

    python experiments/bench/generation.py                       # H200: 1.3B shapes, bf16, batch sweep
    python experiments/bench/generation.py --tiny                # CPU smoke run: tiny models, fp32, seconds

Next H200 run (≤ 8 min; Llama's batches are few because each new shape recompiles its decode, and 1024+1024
tokens of its KV cache are 0.48 GB per sequence, so its best batch is ≤ 256):
    python experiments/bench/generation.py --based-batches 1,64,256,1024,4096 --llama-batches 1,64,128,256 \
        --budget-s 200
Based's kv stored in bf16, with its cost against the fp32 state (below):
    python experiments/bench/generation.py --based-batches 1024,4096 --llama-batches 128 --repeats 1 --warmups 1 \
        --based-state-dtype bf16 --profile-batch 0

Both models have random weights. Based: `zoo/configs/model/based_1b.yaml` (1.35B parameters, Based, the
sliding window and BaseConv impl=triton on CUDA) as ZooForCausalLM, whose decode steps replay a CUDA graph over
the fixed recurrent state. Llama: `LlamaForCausalLM` with SDPA attention and a static KV cache (transformers
compiles its decode step, CUDA graphs included), its depth chosen so its parameter count is closest to Based's.
Both run through `model.generate` (greedy, exactly `--gen` new tokens) on the same random prompts of `--prompt` tokens.

For each batch size of --batches (by default ×4 from 1), until the model runs out of memory (a first batch that
does not fit is halved until one does, so a smaller card still gets a row):
- prefill: median time of one forward over the prompt batch that fills the cache (CUDA events);
- decode: generated tokens/s = batch·gen / (generate time − prefill time), after a warm-up generate that
  compiles and captures what it needs (excluded);
- GB/s: the bytes one decode step must move at least over the time per step, against the copy bandwidth measured
  in the same process: the weights read once, plus each sequence's state at the mean length, prompt + gen/2
  (`decode_state_bytes`: Based's kv, k_sum and conv tails read and written, its window rings read whole and one
  slot written, by `LanguageModel.step_state_nbytes`, the decode profile's byte model too; Llama's KV cache read
  and one position written).
After the Based batches, before the baseline, `--profile-batch` (1,024; tiny: 2) profiles one Based decode step
part by part (experiments/bench/decode_profile.py): time, bytes, FLOPs and their fractions of the copy bandwidth
and of the GEMM rate, beside the CUDA-graph step's time (`graph_step_ms`) and the same step with BaseConv's
PyTorch step in place of its kernel (`graph_step_ms_conv_pytorch`).
The last line is JSON: every row, each model's best decode throughput (`based_tok_s`, `llama_tok_s`), the ratio
`decode_ratio_best` (target ≥ 24×, the Based paper's claim against FlashAttention-2), `decode_frac_copy_bw`
(Based's best decode row's GB/s over the copy bandwidth; target ≥ 0.7), the decode profile, and prefill three ways:
- `prefill_ms_batch1`, `prefill_ratio_batch1`: both models at batch 1 (Llama's ms over Based's; > 1: Based is
  faster), the latency of one prompt;
- `prefill_ms_common`, `prefill_ratio_common`: both at `prefill_batch_common`, the largest batch both ran, the same
  work for each;
- `based_prefill_ms_best`, `llama_prefill_ms_best` (at `based_prefill_batch_best`, `llama_prefill_batch_best`):
  each model at its own best decode batch, the prefill that the headline decode rate pays for; their batches
  differ, so `prefill_ratio_best_per_seq` compares time per sequence (Llama's ms / batch over Based's).
`graph_eager_check` (`--graph-check-batch`, 4; CUDA only): after the profile, greedy `--gen` tokens from that many
prompts through the CUDA-graph decode and through the eager one, untimed; `equal`, and the first generated position
where any row differs.

`--based-state-dtype bf16` stores Based's kv in bf16 (the mixer option `state_dtype`; k_sum stays fp32), about
halving a decode step's state traffic, and measures what that costs against the fp32 state. At each Based batch, a
copy of the model with the fp32 state (same weights) generates from the same prompts, untimed, and the row gets:
- `token_agreement`: the fraction of the `--gen` generated tokens equal, position by position, to the fp32 run's,
  per sequence, averaged over the batch; `first_divergence_median`: the median over sequences of the first
  generated position that differs (`--gen` where none does);
- `logit_rel_diff_max`: teacher-forced on the fp32 run's tokens, both models decode the first `LOGIT_STEPS` (64)
  generated tokens for the batch's first `LOGIT_ROWS` (256) sequences; the largest over steps and sequences of
  max |logit_bf16 − logit_fp32| / max |logit_fp32| over the vocabulary (`logit_rel_diff_median`: the median).
The best Based row's values are also top-level (`bf16_state_token_agreement`, `bf16_state_first_divergence_median`,
`bf16_state_logit_rel_diff_max`). With random weights greedy agreement is a weak test: a random model's logits have
small gaps between its top tokens, so a small perturbation flips the argmax (and every later token then differs)
more often than in a trained model, and what it generates means nothing; the teacher-forced logit difference, which
does not compound after a flip, is the steadier measure of what the rounding does.
"""

from __future__ import annotations

import argparse
import gc
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
from zoo.models.mixers.base_conv import BaseConv

try:  # run as a script (python experiments/bench/generation.py) or as a module
    from decode_profile import gemm_rate, print_profile, profile_decode, weight_bytes
except ImportError:
    from experiments.bench.decode_profile import gemm_rate, print_profile, profile_decode, weight_bytes

REPO = Path(__file__).resolve().parents[2]
LOGIT_STEPS = 64  # decode steps whose logits the bf16-state check compares
LOGIT_ROWS = 256  # sequences it compares them for (two caches of a large batch would not fit beside each other)


def based_model(preset: str, vocab: int, device: torch.device, dtype: torch.dtype, impl: str,
                state_dtype: str = "fp32", prefill_chunk_tokens: int = 0) -> ZooForCausalLM:
    preset_file = REPO / "zoo/configs/model" / f"{preset}.yaml"
    node = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(preset_file))
    node.vocab_size = vocab
    node.mixers.based.impl = impl
    node.mixers.based.state_dtype = state_dtype
    for name in ("sliding_window", "base_conv"):  # their decoding steps as one kernel each, as Based's
        if name in node.mixers:
            node.mixers[name].impl = impl
    mc = OmegaConf.to_object(node)
    with torch.device(device):
        model = ZooForCausalLM(ZooConfig.from_model_config(mc))
    if prefill_chunk_tokens:
        model.config.prefill_chunk_tokens = prefill_chunk_tokens
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
    """Bytes of recurrent state or KV cache that one decode step moves at least, once each of `batch` sequences
    holds `length` tokens. Based: `LanguageModel.step_state_nbytes`, the decode profile's model too (its kv and
    k_sum as stored and the conv tails read and written, the window rings read whole and one slot written).
    Llama: its KV cache read at `length` positions and written at one."""
    if kind == "based":
        return batch * sum(model.model.step_state_nbytes(length).values())
    c = model.config
    per_position = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    return batch * per_position * (length + 1) * model.dtype.itemsize


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


def state_dtype_cost(model, reference, ids: torch.Tensor, seq: torch.Tensor, args) -> dict:
    """What the bf16 state costs: `model`'s greedy tokens seq [B, P + gen] against `reference`'s (the fp32 state,
    same weights) from the same prompts ids [B, P], and teacher-forced logits (the module docstring defines them)."""
    P = ids.shape[1]
    ref = reference.generate(ids, **generate_kwargs("based", args.gen, P))
    same = seq[:, P:] == ref[:, P:]  # [B, gen]
    first = torch.where(same.all(1), args.gen, (~same).int().argmax(1))  # [B]: the first position that differs
    rows, steps = min(LOGIT_ROWS, ids.shape[0]), min(LOGIT_STEPS, args.gen - 1)
    caches = [getattr(m(ids[:rows], use_cache=True, logits_to_keep=1, return_dict=True), CACHE_KEY)
              for m in (model, reference)]
    rel = [torch.zeros(rows, device=ids.device)]
    for t in range(steps):  # both fed the fp32 run's generated tokens
        token = ref[:rows, P + t : P + t + 1]
        a, b = (m(token, cache=c, use_cache=True, return_dict=True).logits[:, -1]
                for m, c in zip((model, reference), caches))
        rel.append((a - b).abs().amax(-1) / b.abs().amax(-1))  # [rows]
    rel = torch.stack(rel[1:] or rel)  # [steps, rows]
    return {
        "token_agreement": same.float().mean(1).mean().item(),
        "first_divergence_median": first.float().quantile(0.5).item(),
        "logit_rel_diff_max": rel.max().item(),
        "logit_rel_diff_median": rel.median().item(),
    }


def measure(kind: str, model, batch: int, args, timer: Timer, device, reference=None) -> dict:
    """One batch's prefill and decode timings; with `reference` (Based with the fp32 state, when `model`'s is bf16)
    also `state_dtype_cost`, untimed."""
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
    row = {
        "model": kind,
        "batch": batch,
        "prefill_ms": 1e3 * prefill_s,
        "decode_tokens_per_s": batch * args.gen / decode_s,
        "ms_per_step": 1e3 * step_s,
        "decode_GB_per_s": step_bytes / step_s / 1e9,
        "peak_mem_GB": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
    }
    if reference is not None:
        with torch.no_grad():
            row.update(state_dtype_cost(model, reference, ids, out.pop("seq"), args))
    return row


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


def sweep(kind: str, model, args, timer: Timer, device, reference=None) -> list[dict]:
    """One row per batch of the model's list, in order, until one does not fit. If the first batch tried does not
    fit, half of it is tried next (down to 1), so a card with less memory still gives the model its largest batch
    up to the first asked."""
    rows = []
    start = time.perf_counter()
    batches = list(args.model_batches.get(kind) or args.batches)
    while batches:
        batch = batches.pop(0)
        if args.budget_s and time.perf_counter() - start > args.budget_s:
            print(f"{kind}: time budget of {args.budget_s:.0f} s spent; batches from {batch} not run", flush=True)
            break
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            row = measure(kind, model, batch, args, timer, device, reference)
        except (torch.cuda.OutOfMemoryError, RuntimeError) as err:
            if not is_oom(err):
                raise
            if rows or batch == 1:
                print(f"{kind}: batch {batch} does not fit ({type(err).__name__}); the sweep stops here", flush=True)
                break
            print(f"{kind}: batch {batch} does not fit ({type(err).__name__}); trying {batch // 2}", flush=True)
            batches = [batch // 2]
            continue
        rows.append(row)
        cost = ""
        if "token_agreement" in row:
            cost = (f" {row['token_agreement']:>7.3f} {row['first_divergence_median']:>9.0f} "
                    f"{row['logit_rel_diff_max']:>11.2e}")
        print(
            f"{kind:>6} {batch:>6} {row['prefill_ms']:>11.1f} {row['decode_tokens_per_s']:>14,.0f} "
            f"{row['ms_per_step']:>9.2f} {row['decode_GB_per_s']:>8.0f}{cost}",
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
            graph_ms = conv_ms = None
            if device.type == "cuda" and based.config.decode_cuda_graph:
                def graph_step_ms(steps: int = 20) -> float:
                    for _ in range(3):  # the capture, then warm replays
                        based(nxt, cache=cache, use_cache=True)
                    return 1e3 * timer(lambda: [based(nxt, cache=cache, use_cache=True) for _ in range(steps)]) / steps

                graph_ms = graph_step_ms()
                # the same step with BaseConv's PyTorch step in place of its kernel: the kernel's gain in this run
                convs = [m for m in based.modules() if isinstance(m, BaseConv) and m.impl == "triton"]
                for m in convs:
                    m.impl = "naive"
                cache.decode_graph = None  # captured again, with the PyTorch step
                try:
                    conv_ms = graph_step_ms() if convs else None
                finally:
                    for m in convs:
                        m.impl = "triton"
                    cache.decode_graph = None
            result = profile_decode(based.model, cache.states, nxt[:, 0], bandwidth, gemm_rate(device, dtype),
                                    seq_len=args.prompt)
    except (torch.cuda.OutOfMemoryError, RuntimeError) as err:
        if not is_oom(err):
            raise
        print(f"decode profile: batch {batch} does not fit ({type(err).__name__}); no profile", flush=True)
        return None
    result["graph_step_ms"] = graph_ms
    result["graph_step_ms_conv_pytorch"] = conv_ms
    print_profile(result, graph_ms)
    if conv_ms is not None:
        print(f"CUDA-graph step with BaseConv's PyTorch step in place of its kernel: {conv_ms:.3f} ms against "
              f"{graph_ms:.3f} ms", flush=True)
    return result


def prefill_ratio_per_seq(based: dict | None, llama: dict | None) -> float | None:
    """Llama's prefill time per sequence over Based's, each row at its own batch (> 1: Based prefills faster)."""
    if not based or not llama:
        return None
    return (llama["prefill_ms"] / llama["batch"]) / (based["prefill_ms"] / based["batch"])


def graph_eager_check(based, args, device) -> dict | None:
    """Greedy `--gen` tokens for `--graph-check-batch` random prompts through the CUDA-graph decode and through the
    eager one (untimed): do they agree token for token? None on the CPU (no graph) or with the check off."""
    batch = args.graph_check_batch
    if not batch or device.type != "cuda" or not based.config.decode_cuda_graph:
        return None
    g = torch.Generator(device="cpu").manual_seed(batch + 1)
    ids = torch.randint(1, based.config.vocab_size, (batch, args.prompt), generator=g).to(device)
    kwargs = generate_kwargs("based", args.gen, args.prompt)
    start = time.perf_counter()
    with torch.no_grad():
        graph = based.generate(ids, **kwargs)[:, args.prompt:]  # [B, gen]
        based.config.decode_cuda_graph = False
        try:
            eager = based.generate(ids, **kwargs)[:, args.prompt:]  # [B, gen]
        finally:
            based.config.decode_cuda_graph = True
    same = graph == eager  # [B, gen]
    first = None if bool(same.all()) else int((~same).any(0).int().argmax())
    result = {"batch": batch, "generated": args.gen, "equal": first is None, "first_divergence": first,
              "seconds": time.perf_counter() - start}
    print(f"graph vs eager decode, batch {batch}, {args.gen} greedy tokens: "
          + ("equal" if first is None else f"differ from generated position {first}")
          + f" ({result['seconds']:.0f} s)", flush=True)
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
    parser.add_argument("--graph-check-batch", type=int, default=4,
                        help="compare greedy tokens of the CUDA-graph and eager Based decode at this batch (0: off)")
    parser.add_argument("--based-state-dtype", choices=("fp32", "bf16"), default="fp32",
                        help="Based's decode-state kv storage; bf16 also measures its cost against fp32 (see above)")
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
    # On the GPU a whole batch of long prompts in one forward would need far more activation memory than decoding.
    chunk = args.prefill_chunk_tokens if device.type == "cuda" else 0
    based = based_model(preset, vocab, device, dtype, impl, args.based_state_dtype, chunk)
    reference = None  # the same weights with the fp32 state, which the bf16 state is measured against
    if args.based_state_dtype != "fp32":
        reference = based_model(preset, vocab, device, dtype, impl, "fp32", chunk)
        reference.load_state_dict(based.state_dict())
    d = based.config.d_model
    llama = llama_model(based.num_parameters(), d, max(1, d // 64), vocab, device, dtype)
    bandwidth = copy_bandwidth(device, timer)
    print(
        f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), {dtype}, "
        f"prompt {args.prompt}, generated {args.gen}; copy bandwidth {bandwidth / 1e9:.0f} GB/s"
    )
    print(
        f"based: {based.num_parameters() / 1e6:.1f}M parameters ({preset}, impl={impl}, state "
        f"{args.based_state_dtype}); llama: "
        f"{llama.num_parameters() / 1e6:.1f}M ({llama.config.num_hidden_layers} layers, d={d})"
    )
    cost_head = f" {'agree':>7} {'diverge@':>9} {'logit Δ max':>11}" if reference is not None else ""
    print(f"{'model':>6} {'batch':>6} {'prefill ms':>11} {'decode tok/s':>14} {'ms/step':>9} {'GB/s':>8}{cost_head}")
    rows = sweep("based", based, args, timer, device, reference)
    del reference
    # The profile needs Based only: it runs before the baseline, so a call cut short still has it.
    profile = decode_profile(based, args, timer, device, dtype, bandwidth) if args.profile_batch else None
    graph_check = graph_eager_check(based, args, device)
    # Based is done: its weights, and whatever its graphs' memory pools still hold, leave the GPU to the baseline,
    # whose largest batches fill it
    based_params = based.num_parameters()
    del based
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
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
        "params": {"based": based_params, "llama": llama.num_parameters()},
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
        "based_prefill_batch_best": best_row["based"]["batch"] if best_row["based"] else None,
        "based_prefill_ms_best": best_row["based"]["prefill_ms"] if best_row["based"] else None,
        "llama_prefill_batch_best": best_row["llama"]["batch"] if best_row["llama"] else None,
        "llama_prefill_ms_best": best_row["llama"]["prefill_ms"] if best_row["llama"] else None,
        "prefill_ratio_best_per_seq": prefill_ratio_per_seq(best_row["based"], best_row["llama"]),
        "graph_eager_check": graph_check,
        "target_ratio": 24.0,
        "based_state_dtype": args.based_state_dtype,
    }
    if args.based_state_dtype != "fp32":
        row = best_row["based"] or {}
        for key in ("token_agreement", "first_divergence_median", "logit_rel_diff_max"):
            result[f"bf16_state_{key}"] = row.get(key)
    if args.profile_batch:
        result["decode_profile"] = profile
    print(
        f"best decode: based {best['based']:,.0f} tok/s, llama {best['llama']:,.0f} tok/s, "
        f"ratio {result['decode_ratio_best'] or float('nan'):.2f}x (target 24x)"
    )
    if result["prefill_ratio_best_per_seq"] is not None:
        print(
            f"prefill at each model's best decode batch: based {result['based_prefill_ms_best']:,.1f} ms at "
            f"{result['based_prefill_batch_best']}, llama {result['llama_prefill_ms_best']:,.1f} ms at "
            f"{result['llama_prefill_batch_best']}; per sequence, llama / based = "
            f"{result['prefill_ratio_best_per_seq']:.2f}"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
