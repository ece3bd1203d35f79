"""RWKV-4's WKV: the chunked PyTorch form (`RWKV4(impl="naive")`) against the Triton kernel (`impl="triton"`,
kernels/rwkv4) at the Zoology Fig. 2 shapes, in one run: the WKV alone (`RWKV4._wkv`, what the mixer calls),
forward and forward+backward, and the whole mixer's forward+backward.

    python experiments/bench/rwkv4.py           # CUDA: d ∈ {64, 128, 256, 512} × (L, B) ∈ {(64, 512), (128, 512),
                                                #       (256, 256)}, k, v and the mixer in bf16 (autocast)
    python experiments/bench/rwkv4.py --tiny    # CPU smoke test: tiny shapes, fp32, the kernel interpreted

Prints ms per call (median of --repeats after a warm-up; CUDA events on the GPU), the speed-up, the kernel's
forward+backward DRAM throughput (the bytes it must move: k, v, wkv, the saved states, dwkv, dk, dv) against
--peak-gbs, and the largest relative deviation of the Triton wkv and dk from the PyTorch form's. Last line: JSON.
"""

import argparse
import json
import os

import torch

try:  # run as a script (python experiments/bench/NAME.py) or as a module
    from timing import median_ms
except ImportError:
    from experiments.bench.timing import median_ms

GRID = [(d, L, B) for L, B in ((64, 512), (128, 512), (256, 256)) for d in (64, 128, 256, 512)]
TINY = [(16, 16, 4), (40, 33, 2)]  # (d, L, B)


def rel_dev(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def bench_shape(RWKV4, d: int, L: int, B: int, device: torch.device, dtype: torch.dtype, repeats: int) -> dict:
    torch.manual_seed(0)
    mixers = {impl: RWKV4(d, impl=impl).to(device) for impl in ("naive", "triton")}
    mixers["triton"].load_state_dict(mixers["naive"].state_dict())
    k, v = (torch.randn(B, L, d, device=device).to(dtype) for _ in range(2))
    x, gy = torch.randn(B, L, d, device=device), torch.randn(B, L, d, device=device)
    autocast = dict(device_type=device.type, dtype=dtype, enabled=device.type == "cuda")
    row = {"d_model": d, "L": L, "batch": B}
    outs = {}
    for impl, m in mixers.items():
        def forward(m=m):
            return m._wkv(k.requires_grad_(), v.requires_grad_(), None)

        def forward_backward(m=m):
            k.grad = v.grad = None
            forward(m).backward(gy)
            return k.grad

        def mixer_step(m=m):
            with torch.autocast(**autocast):
                y = m(x)
            y.backward(gy.to(y.dtype))

        outs[impl] = (forward().detach(), forward_backward().clone())
        row[f"{impl}_fwd_ms"] = median_ms(forward, device, repeats)
        row[f"{impl}_fwdbwd_ms"] = median_ms(forward_backward, device, repeats)
        row[f"{impl}_mixer_ms"] = median_ms(mixer_step, device, repeats)
    elt = k.element_size()
    row["triton_fwdbwd_gb"] = B * L * d * (6 * elt + 32) / 1e9  # fwd: k, v, wkv, states; bwd: those, dwkv, dk, dv
    row["triton_fwdbwd_gbs"] = row["triton_fwdbwd_gb"] / (row["triton_fwdbwd_ms"] / 1e3)
    row["rel_dev_wkv"] = rel_dev(outs["triton"][0], outs["naive"][0])
    row["rel_dev_dk"] = rel_dev(outs["triton"][1], outs["naive"][1])
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shapes, the kernel interpreted")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--peak-gbs", type=float, default=4800.0, help="DRAM bandwidth to compare with (H200: 4.8 TB/s)")
    args = p.parse_args()
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels/rwkv4/wkv.py defines its kernels
    elif not torch.cuda.is_available():
        p.error("the full grid needs a CUDA device; use --tiny on the CPU")
    from zoo.models.mixers.rwkv4 import RWKV4

    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    rows = [bench_shape(RWKV4, d, L, B, device, dtype, args.repeats) for d, L, B in (TINY if args.tiny else GRID)]
    print(f"RWKV-4 WKV on {device} (k, v {dtype}); ms, median of {args.repeats}; x = torch / triton")
    print(f"{'d':>5}{'L':>5}{'B':>5} |{'fwd torch':>10}{'triton':>8}{'x':>7} |{'f+b torch':>10}{'triton':>8}{'x':>7}"
          f"{'GB/s':>7}{'%peak':>6} |{'mixer torch':>12}{'triton':>8}{'x':>7} |{'dev wkv':>8}{'dk':>8}")
    for r in rows:
        cols = [f"{r['d_model']:>5}{r['L']:>5}{r['batch']:>5} |"]
        for part, width in (("fwd", 10), ("fwdbwd", 10), ("mixer", 12)):
            torch_ms, triton_ms = r[f"naive_{part}_ms"], r[f"triton_{part}_ms"]
            cols.append(f"{torch_ms:>{width}.2f}{triton_ms:>8.2f}{torch_ms / triton_ms:>7.1f}")
            if part == "fwdbwd":
                cols.append(f"{r['triton_fwdbwd_gbs']:>7.0f}{100 * r['triton_fwdbwd_gbs'] / args.peak_gbs:>6.1f}")
            cols.append(" |")
        cols.append(f"{r['rel_dev_wkv']:>8.1e}{r['rel_dev_dk']:>8.1e}")
        print("".join(cols))
    print(json.dumps({"bench": "rwkv4", "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                      "dtype": str(dtype), "peak_gbs": args.peak_gbs, "rows": rows}))


if __name__ == "__main__":
    main()
