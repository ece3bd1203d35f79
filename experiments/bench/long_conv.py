"""Long causal convolutions: the FFT against the direct Toeplitz matmul (zoo/models/mixers/_long_conv.py), at the
Zoology Fig. 2 shapes, and the H3 and Hyena mixers with the FFT forced and through causal_conv, all in one run.

    python experiments/bench/long_conv.py           # GPU: C in {64..1024}, (T, B) in {(64, 512) .. (512, 128)}
    python experiments/bench/long_conv.py --tiny    # CPU smoke run, a few seconds

1. `fft_causal_conv` and `direct_causal_conv` on fp32 u [B, T, C], h [T, C]: forward, and forward+backward (grads
   of u and h). Reports ms (median of --repeats after a warm-up; CUDA events on the GPU), the direct path's matmul
   TFLOP/s (2·B·T²·C per product: one forward, three forward+backward), the FFT path's GB/s under a model of
   ≈ 90 bytes moved per (b, t, c) forward and ≈ 250 forward+backward, the peak memory each path allocates, and the
   direct output's largest difference from the FFT's relative to the largest value. A row says which path
   causal_conv takes (DIRECT_MAX_T). `bf16`: the direct path forward+backward under bf16 autocast (its matmuls on
   bf16 operands), its speed-up over the fp32 FFT and its output's difference from the FFT's.
2. One H3 (Fig. 2 preset: d_state = shift_size = L, head_dim 2) and one Hyena (Fig. 2 preset) mixer at d = 512,
   forward+backward under bf16 autocast at L in {64, 128, 256} (batch 512, 512, 256): `fft`, the mixer's
   convolutions sent to fft_causal_conv by patching the mixer modules' `causal_conv` here in the bench; and
   `causal_conv`, the library as it is. Both share the rest of the library (H3's per-head kernel, its shift filter
   over T positions); sweep_speed.py times the whole training step. H3's kernel build is timed alone too: per SSM
   input ([T, H·p·p, N] exp and sum, written out here) against the library's per head ([T, H, N]).

Prints tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from contextlib import ExitStack
from unittest import mock

import torch

try:  # run as a script (python experiments/bench/NAME.py) or as a module
    from timing import fmt, median_ms, peak_mib, rel_diff
except ImportError:
    from experiments.bench.timing import fmt, median_ms, peak_mib, rel_diff

from zoo.models.mixers import _long_conv, h3, hyena, long_conv
from zoo.models.mixers._long_conv import DIRECT_MAX_T, direct_causal_conv, fft_causal_conv
from zoo.models.mixers.h3 import H3
from zoo.models.mixers.hyena import Hyena

FFT_BYTES = {"fwd": 90, "fwd+bwd": 250}  # the bytes model of DIRECT_MAX_T's comment, per (b, t, c) element
PRODUCTS = {"fwd": 1, "fwd+bwd": 3}  # [T, T] x [T, B] products per channel


def conv_row(T: int, B: int, C: int, device: torch.device, repeats: int) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    u = torch.randn(B, T, C, device=device, generator=g).requires_grad_()
    h = (torch.randn(T, C, device=device, generator=g) / math.sqrt(T)).requires_grad_()
    grad_y = torch.randn(B, T, C, device=device, generator=g)
    with torch.no_grad():
        ref = fft_causal_conv(u, h)
        diff = rel_diff(direct_causal_conv(u, h), ref)
    row = {"T": T, "B": B, "C": C, "dispatch": "direct" if T <= DIRECT_MAX_T else "fft", "rel_diff": diff}
    for mode in ("fwd", "fwd+bwd"):
        for name, conv in (("fft", fft_causal_conv), ("direct", direct_causal_conv)):

            def run(conv=conv, mode=mode):
                if mode == "fwd":
                    with torch.no_grad():
                        return conv(u, h)
                return torch.autograd.grad(conv(u, h), (u, h), grad_y)

            row[f"{name}_{mode}_ms"] = median_ms(run, device, repeats)
            row[f"{name}_{mode}_mib"] = peak_mib(run, device)
        elements = B * T * C
        row[f"direct_{mode}_tflops"] = PRODUCTS[mode] * 2 * elements * T / (row[f"direct_{mode}_ms"] * 1e9)
        row[f"fft_{mode}_gbps"] = FFT_BYTES[mode] * elements / (row[f"fft_{mode}_ms"] * 1e6)
        row[f"{mode}_speedup"] = row[f"fft_{mode}_ms"] / row[f"direct_{mode}_ms"]

    def run_autocast():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return torch.autograd.grad(direct_causal_conv(u, h), (u, h), grad_y)

    row["direct_autocast_fwd+bwd_ms"] = median_ms(run_autocast, device, repeats)
    row["direct_autocast_fwd+bwd_speedup"] = row["fft_fwd+bwd_ms"] / row["direct_autocast_fwd+bwd_ms"]
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        row["direct_autocast_rel_diff"] = rel_diff(direct_causal_conv(u, h), ref)
    return row


def old_h3_kernel(m: H3, T: int, dtype: torch.dtype) -> torch.Tensor:
    """H3's SSM kernel built per SSM input: every head's log a, B, C repeated p·p times before the exp and the sum
    over modes. [T, H·p·p]."""
    q2 = m.p * m.p
    log_a = -(torch.exp(m.log_dt.to(dtype))[:, None] * torch.exp(m.log_A.to(dtype)))  # [H, N]
    log_a = log_a.repeat_interleave(q2, dim=0)  # [H·p·p, N]
    lags = torch.arange(T, device=log_a.device, dtype=dtype)
    powers = torch.exp(lags[:, None, None] * log_a[None])  # [T, H·p·p, N]
    CB = (m.C * m.B).to(dtype).repeat_interleave(q2, dim=0)  # [H·p·p, N]
    return torch.einsum("ldn,dn->ld", powers, CB)


def new_h3_kernel(m: H3, T: int, dtype: torch.dtype) -> torch.Tensor:
    """The library's per-head build (h3.py forward), repeated over the head's inputs: [T, H·p·p]."""
    log_a = m._log_a(dtype)  # [H, N]
    lags = torch.arange(T, device=log_a.device, dtype=dtype)
    powers = torch.exp(lags[:, None, None] * log_a[None])  # [T, H, N]
    kernel = torch.einsum("lhn,hn->lh", powers, (m.C * m.B).to(dtype))  # [T, H]
    return kernel.repeat_interleave(m.p * m.p, dim=1)


FFT_PATCHES = (_long_conv, h3, hyena, long_conv)  # every module that calls causal_conv


def mixer_row(name: str, m: torch.nn.Module, x: torch.Tensor, repeats: int) -> dict:
    """forward+backward of m on x (bf16 autocast on CUDA): with every causal_conv sent to fft_causal_conv, then
    as the library is."""
    device = x.device
    B, L, d = x.shape
    params = list(m.parameters())

    def step():
        xi = x.clone().requires_grad_()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            y = m(xi)
        grads = torch.autograd.grad(y.float().square().mean(), [xi, *params])
        return y.detach().float(), grads[0]

    row = {"mixer": name, "d": d, "L": L, "B": B}
    outputs = {}
    for variant in ("fft", "causal_conv"):
        with ExitStack() as stack:
            if variant == "fft":
                for module in FFT_PATCHES:
                    stack.enter_context(mock.patch.object(module, "causal_conv", fft_causal_conv))
            row[f"{variant}_ms"] = median_ms(step, device, repeats)
            row[f"{variant}_mib"] = peak_mib(step, device)
            outputs[variant] = step()
    (y0, g0), (y1, g1) = outputs["fft"], outputs["causal_conv"]
    row["rel_diff_y"] = rel_diff(y1, y0)
    row["rel_diff_grad_x"] = rel_diff(g1, g0)
    row["speedup"] = row["fft_ms"] / row["causal_conv_ms"]
    return row


def kernel_rows(m: H3, L: int, device: torch.device, repeats: int) -> list[dict]:
    """H3's SSM kernel, forward+backward to its parameters, built per SSM input and per head."""
    rows = []
    for variant, build in (("per_input", old_h3_kernel), ("per_head", new_h3_kernel)):

        def kernel_step(build=build):
            k = build(m, L, torch.float32)
            return torch.autograd.grad(k.square().sum(), [m.log_dt, m.log_A, m.B, m.C])

        rows.append(
            {
                "mixer": f"h3_kernel_{variant}",
                "d": m.d_model,
                "L": L,
                "ms": median_ms(kernel_step, device, repeats),
                "mib": peak_mib(kernel_step, device),
            }
        )
    with torch.no_grad():
        rows[-1]["max_abs_diff"] = (
            (new_h3_kernel(m, L, torch.float32) - old_h3_kernel(m, L, torch.float32)).abs().max().item()
        )
    return rows


def mixer_rows(d: int, panels, device: torch.device, repeats: int) -> list[dict]:
    rows = []
    for L, B in panels:
        torch.manual_seed(0)
        m_h3 = H3(d, d_state=L, head_dim=2, shift_size=L).to(device)
        m_hyena = Hyena(
            d,
            max_seq_len=L,
            filter_hidden=64,
            num_freqs=0,
            short_kernel_size=3,
            decay_min=3.07,
            decay_max=15.35,
            filter_depth=2,
            learn_freq=True,
            short_bias=True,
        ).to(device)
        x = torch.randn(B, L, d, device=device)
        rows += [mixer_row("h3", m_h3, x, repeats), mixer_row("hyena", m_hyena, x, repeats)]
        rows += kernel_rows(m_h3, L, device, repeats)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: small shapes, a few seconds")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--skip-mixers", action="store_true")
    args = p.parse_args()
    if args.tiny:
        args.device, args.repeats = "cpu", 2
        shapes, channels, d, panels = [(16, 4), (40, 2)], [4, 8], 32, [(16, 4)]
    else:
        shapes, channels, d = [(64, 512), (128, 512), (256, 256), (512, 128)], [64, 128, 256, 512, 1024], 512
        panels = [(64, 512), (128, 512), (256, 256)]
    device = torch.device(args.device)

    conv = [conv_row(T, B, C, device, args.repeats) for T, B in shapes for C in channels]
    print(
        f"causal convolution, fp32, {device} (ms; direct TFLOP/s of its matmuls; FFT GB/s under the bytes model; "
        f"peak MiB; causal_conv takes direct for T <= {DIRECT_MAX_T})"
    )
    print(
        f"{'T':>4} {'B':>4} {'C':>5} | {'fwd fft':>8} {'direct':>8} {'x':>5} | {'f+b fft':>8} {'direct':>8} "
        f"{'x':>5} | {'bf16':>7} {'x':>5} | {'TFLOP/s':>7} {'GB/s':>6} | {'MiB fft':>8} {'direct':>8} | "
        f"{'rel diff':>8} {'bf16':>8} {'takes':>6}"
    )
    for r in conv:
        print(
            f"{r['T']:>4} {r['B']:>4} {r['C']:>5} | {r['fft_fwd_ms']:>8.3f} {r['direct_fwd_ms']:>8.3f} "
            f"{r['fwd_speedup']:>5.2f} | {r['fft_fwd+bwd_ms']:>8.3f} {r['direct_fwd+bwd_ms']:>8.3f} "
            f"{r['fwd+bwd_speedup']:>5.2f} | {r['direct_autocast_fwd+bwd_ms']:>7.3f} "
            f"{r['direct_autocast_fwd+bwd_speedup']:>5.2f} | {r['direct_fwd+bwd_tflops']:>7.1f} "
            f"{r['fft_fwd+bwd_gbps']:>6.0f} | {fmt(r['fft_fwd+bwd_mib'], '8.0f')} "
            f"{fmt(r['direct_fwd+bwd_mib'], '8.0f')} | "
            f"{r['rel_diff']:>8.1e} {r['direct_autocast_rel_diff']:>8.1e} {r['dispatch']:>6}"
        )
    by_T = {}
    for r in conv:
        by_T.setdefault(r["T"], []).append(r["fwd+bwd_speedup"])
    geomean = {T: math.exp(statistics.fmean(math.log(s) for s in v)) for T, v in by_T.items()}
    print(
        "fwd+bwd speed-up of direct over FFT, geometric mean over C: "
        + ", ".join(f"T={T}: {s:.2f}x" for T, s in geomean.items())
    )

    mixers = [] if args.skip_mixers else mixer_rows(d, panels, device, args.repeats)
    if mixers:
        print(f"\nmixers at d={d}, forward+backward{' under bf16 autocast' if device.type == 'cuda' else ''} (ms)")
        print(
            f"{'mixer':>22} {'L':>4} {'B':>4} | {'fft':>8} {'causal_conv':>11} {'x':>5} | {'MiB fft':>8} "
            f"{'now':>8} | {'diff y':>8} {'diff dx':>8}"
        )
        for r in mixers:
            if "speedup" in r:
                print(
                    f"{r['mixer']:>22} {r['L']:>4} {r['B']:>4} | {r['fft_ms']:>8.2f} {r['causal_conv_ms']:>11.2f} "
                    f"{r['speedup']:>5.2f} | {fmt(r['fft_mib'], '8.0f')} {fmt(r['causal_conv_mib'], '8.0f')} | "
                    f"{r['rel_diff_y']:>8.1e} {r['rel_diff_grad_x']:>8.1e}"
                )
            else:
                print(
                    f"{r['mixer']:>22} {r['L']:>4} {'':>4} | {r['ms']:>8.3f} ms fwd+bwd, "
                    f"{fmt(r['mib'], '.0f')} MiB"
                    + (f", max diff {r['max_abs_diff']:.1e}" if "max_abs_diff" in r else "")
                )
    print(
        json.dumps(
            {
                "bench": "long_conv",
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "torch": torch.__version__,
                "direct_max_t": DIRECT_MAX_T,
                "fwd_bwd_speedup_geomean_by_T": geomean,
                "conv": conv,
                "mixers": mixers,
            }
        )
    )


if __name__ == "__main__":
    main()
