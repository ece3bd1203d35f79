"""One decode step of a zoo LanguageModel, part by part: device time, the bytes it must move, its FLOPs.

Used by experiments/bench/generation.py (`--profile-batch`). The step is run eagerly under torch.profiler with
a `record_function` label around each part, so every kernel (aten or Triton) is charged to the part that
launched it. The parts are the embedding, each mixer kind, the norms, the MLPs and the head (final norm +
vocabulary projection). For each part:
- device time per step (on the CPU: CPU time), and the kernels it launches;
- bytes: a lower bound on its memory traffic, its weights read once plus the recurrent state its layers read and
  write, by `zoo.models.mixers.step_state_nbytes` (the model that experiments/bench/generation.py's GB/s uses
  too): Based's kv and k_sum and the BaseConv tails read and written whole, the sliding window's ring read whole
  and one slot of it (k and v) written. The activations, [B, d] per layer, are small beside both at the batches
  that matter;
- FLOPs: 2 · weight parameters · batch, the matmuls (the mixers' state updates are elementwise and
  memory-bound, so they count as bytes, not FLOPs);
- the fraction of the copy bandwidth and of the dense-GEMM rate, both measured in the same process.
The eager step launches every kernel from Python; the CUDA-graph step that generation runs replays the same
kernels without the launches, so the table also gives the graph replay's time per step for comparison.

Beside the parts, `kernels` lists the step's `TOP_KERNELS` costliest kernels from the profiler's key averages (on
the CPU, where there are none, the costliest ops by self CPU time): name, calls and device time per step, and share
of the device time of all kernels. A kernel that several parts launch (an elementwise aten kernel) is one row.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from zoo.models.mixers import step_state_nbytes

try:  # run as a script's sibling (experiments/bench on sys.path) or as a module
    from timing import median_ms
except ImportError:
    from experiments.bench.timing import median_ms


TOP_KERNELS = 15  # rows of the per-kernel table


def weight_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _labelled_step(lm, ids: torch.Tensor, states: list) -> torch.Tensor:
    """LanguageModel.step with a profiler label around each part (the same calls, in the same order)."""
    with record_function("part:embedding"):
        x = lm._embed(ids[:, None], states)[:, 0]
    for block, state in zip(lm.blocks, states):
        with record_function("part:norm"):
            h = block.mixer_norm(x)
        with record_function(f"part:mixer {block.mixer.name}"):
            y = block.mixer.step(h, state)
        with record_function("part:mlp"):
            x = block._mlp(x + y)
    with record_function("part:head"):
        return lm.logits(lm.norm(x))


def part_budget(lm, batch: int, seq_len: int) -> dict[str, dict[str, float]]:
    """Per part: layers, the bytes it must move at least and its matmul FLOPs (see the module docstring), for a
    step at `batch` sequences whose states hold seq_len tokens."""
    parts: dict[str, dict[str, float]] = defaultdict(lambda: {"layers": 0, "bytes": 0.0, "flops": 0.0})

    def add(name: str, module: torch.nn.Module, state_bytes: int = 0, matmul_params: int | None = None) -> None:
        p = parts[name]
        p["layers"] += 1
        p["bytes"] += weight_bytes(module) + state_bytes
        params = sum(q.numel() for q in module.parameters() if q.dim() >= 2) if matmul_params is None else matmul_params
        p["flops"] += 2 * params * batch

    emb = lm.embedding
    parts["part:embedding"]["layers"] = 1
    parts["part:embedding"]["bytes"] += batch * emb.weight.shape[1] * emb.weight.element_size()  # rows gathered
    for block in lm.blocks:
        add("part:norm", block.mixer_norm, matmul_params=0)
        add(f"part:mixer {block.mixer.name}", block.mixer, batch * sum(step_state_nbytes(block.mixer, seq_len)))
        add("part:mlp", torch.nn.ModuleList([m for m in (block.mlp_norm, block.mlp) if m is not None]))
    add("part:head", torch.nn.ModuleList([lm.norm, lm.head]))  # a tied head reads the embedding matrix whole
    return dict(parts)


def gemm_rate(device: torch.device, dtype: torch.dtype) -> float:
    """Dense matmul FLOP/s at a large square shape (the ceiling a decode step's matmuls can approach)."""
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / (median_ms(lambda: a @ b, device, 10 if device.type == "cuda" else 3) / 1e3)


def profile_decode(lm, states: list, ids: torch.Tensor, copy_bw: float, gemm: float, seq_len: int,
                   steps: int = 3) -> dict:
    """Profile `steps` eager decode steps from `states` (advanced in place; they hold seq_len tokens)
    -> {"parts": [...], totals}."""
    cuda = ids.is_cuda
    batch = ids.shape[0]
    budget = part_budget(lm, batch, seq_len)
    with torch.no_grad():
        expected = lm.step(ids, [None if s is None else {k: t.clone() for k, t in s.items()} for s in states])
        got = _labelled_step(lm, ids, [None if s is None else {k: t.clone() for k, t in s.items()} for s in states])
        if not torch.equal(expected, got):
            raise RuntimeError("the labelled decode step no longer matches LanguageModel.step")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                _labelled_step(lm, ids, states)
            if cuda:
                torch.cuda.synchronize()
    times: dict[str, float] = {}
    kernels: dict[str, int] = {}
    for event in prof.key_averages():
        if event.key.startswith("part:"):
            total = event.device_time_total if cuda else event.cpu_time_total  # µs, children included
            times[event.key] = total / steps / 1e3  # ms per step
    if cuda:
        # kernels per part: the device events that fall inside each part's CPU range are counted by Kineto as
        # that part's children; their count is the number of launches.
        for event in prof.events():
            if event.name.startswith("part:"):
                kernels[event.name] = kernels.get(event.name, 0) + sum(1 for _ in _device_children(event))
    rows = []
    total_ms = sum(times.values())
    # Every kernel of the profile, attributed or not: a part whose kernels the profiler could not tie to its label
    # (a launch outside the op's range) shows up as the difference.
    all_ms = sum(e.self_device_time_total if cuda else 0.0 for e in prof.key_averages()) / steps / 1e3
    for name, b in sorted(budget.items(), key=lambda kv: -times.get(kv[0], 0.0)):
        ms = times.get(name, 0.0)
        seconds = ms / 1e3
        rows.append({
            "part": name.removeprefix("part:"),
            "layers": int(b["layers"]),
            "kernels_per_step": kernels.get(name, 0) / steps if cuda else None,
            "ms": ms,
            "share": ms / total_ms if total_ms else 0.0,
            "MB": b["bytes"] / 1e6,
            "GB_per_s": b["bytes"] / seconds / 1e9 if seconds else None,
            "frac_copy_bw": b["bytes"] / seconds / copy_bw if seconds else None,
            "GFLOP": b["flops"] / 1e9,
            "frac_gemm": b["flops"] / seconds / gemm if seconds else None,
        })
    total_bytes = sum(b["bytes"] for b in budget.values())
    return {
        "batch": batch,
        "parts": rows,
        "kernels": top_kernels(prof.key_averages(), cuda, steps),
        "kernels_are_device": cuda,
        "eager_step_ms": total_ms,
        "unattributed_device_ms": all_ms - total_ms if cuda else None,
        "step_MB": total_bytes / 1e6,
        "eager_frac_copy_bw": total_bytes / (total_ms / 1e3) / copy_bw if total_ms else None,
        "copy_GB_per_s": copy_bw / 1e9,
        "gemm_TFLOP_per_s": gemm / 1e12,
    }


def top_kernels(averages, cuda: bool, steps: int, n: int = TOP_KERNELS) -> list[dict]:
    """The `n` kernels (CPU: ops) with the most self time: name, calls and ms per step, share of all of them."""
    if cuda:
        timed = [(e.key, e.count, e.self_device_time_total) for e in averages if e.device_type == DeviceType.CUDA]
    else:  # self time, so an op's callees are not counted twice; the part labels are not ops
        timed = [(e.key, e.count, e.self_cpu_time_total) for e in averages if not e.key.startswith("part:")]
    total = sum(us for _, _, us in timed)
    timed.sort(key=lambda row: -row[2])
    return [{"name": name, "calls_per_step": count / steps, "ms": us / steps / 1e3,
             "share": us / total if total else 0.0} for name, count, us in timed[:n]]


def _device_children(event):
    stack = list(event.cpu_children)
    yield from (k for k in getattr(event, "kernels", []))
    while stack:
        child = stack.pop()
        yield from getattr(child, "kernels", [])
        stack.extend(child.cpu_children)


def print_profile(result: dict, graph_ms: float | None) -> None:
    print(f"\ndecode step at batch {result['batch']}, part by part (eager, labelled; bytes = weights + state read "
          f"and written; copy {result['copy_GB_per_s']:.0f} GB/s, GEMM {result['gemm_TFLOP_per_s']:.0f} TFLOP/s)")
    print(f"{'part':24s} {'layers':>6s} {'kernels':>7s} {'ms':>8s} {'share':>6s} {'MB':>9s} {'GB/s':>7s} "
          f"{'%copy':>6s} {'GFLOP':>8s} {'%GEMM':>6s}")
    for r in result["parts"]:
        k = "—" if r["kernels_per_step"] is None else f"{r['kernels_per_step']:.0f}"
        gbs = "—" if r["GB_per_s"] is None else f"{r['GB_per_s']:.0f}"
        fc = "—" if r["frac_copy_bw"] is None else f"{100 * r['frac_copy_bw']:.0f}"
        fg = "—" if r["frac_gemm"] is None else f"{100 * r['frac_gemm']:.0f}"
        print(f"{r['part']:24s} {r['layers']:6d} {k:>7s} {r['ms']:8.3f} {100 * r['share']:5.1f}% {r['MB']:9.1f} "
              f"{gbs:>7s} {fc:>6s} {r['GFLOP']:8.1f} {fg:>6s}")
    line = f"eager step {result['eager_step_ms']:.3f} ms for {result['step_MB']:.0f} MB"
    if result["unattributed_device_ms"] is not None:
        line += f" (device time outside every part: {result['unattributed_device_ms']:.3f} ms)"
    if graph_ms is not None:
        line += f"; CUDA-graph step {graph_ms:.3f} ms ({result['step_MB'] / 1e3 / (graph_ms / 1e3):.0f} GB/s)"
    print(line)
    what = "kernels (device time)" if result["kernels_are_device"] else "ops (self CPU time; no device kernels)"
    print(f"\nthe step's {len(result['kernels'])} costliest {what}, per step:")
    print(f"{'calls':>6s} {'ms':>8s} {'share':>6s}  name")
    for k in result["kernels"]:
        name = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
        print(f"{k['calls_per_step']:6.0f} {k['ms']:8.3f} {100 * k['share']:5.1f}%  {name}")
