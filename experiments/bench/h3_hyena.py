"""H3 and Hyena mixers (Zoology Fig. 2 presets), forward+backward: the library's forms against their baselines, in
one run, with the outputs and every gradient compared.

    python experiments/bench/h3_hyena.py           # GPU: d in {256, 512}, (L, B) in {(64, 512), (128, 512), (256, 256)}
    python experiments/bench/h3_hyena.py --tiny    # CPU smoke run, a few seconds

Baselines, kept here only (their long convolutions in IEEE fp32, as causal_conv ran them under autocast too):
- H3: SSM inputs laid out [B, T, H·p·p] (one causal_conv channel per (head, i, j), the head's kernel repeated
  p·p times), D·u added elementwise, and the read-out q_hᵀ · Y_h as an einsum, which torch runs as a batched
  matmul of B·T·H products of [1, p] x [p, p] (B·T·H = 16.8M at d = 512, L = 256, B = 256).
- Hyena: the short conv as an einsum over unfolded windows [B, T, 3d, k], a batch of 3d matrix-vector products of
  inner size k, and bias ⊙ z added in a pass of its own.
The library: H3 lays its inputs out [p, p, B, T, H] (one Toeplitz matmul per head, the p·p inputs and the batch
its columns), folds D into the kernel's lag 0 and reads out with p elementwise products; the short conv is a sum
of k shifted products, and Hyena's bias joins its filter's lag 0; under autocast the direct convolutions take
bf16 operands. `lib fp32c` is the library with its convolutions held at IEEE fp32 (autocast off around
causal_conv, patched here), to split the gains.

The forms share the parameters (the baselines are the library's modules with the old forward). Under bf16
autocast, the sweeps' training setting (on the CPU too, where --tiny checks the numbers). Columns: ms (median of
--repeats after a warm-up; CUDA events) and the speed-up over the baseline, the peak MiB each allocates, the
Toeplitz matmuls' TFLOP/s in the library's time (H3: the shift filter's d channels and the SSM's p·d; Hyena: the
long filter's d; 3 products of 2·B·L² per channel forward+backward), the largest difference of y, dx and the
parameter gradients between baseline and library relative to the largest value of each, and each form's error
on y and on the parameter gradients against the library run in fp32 without autocast.

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
from contextlib import ExitStack
from unittest import mock

import torch
from einops import rearrange

try:  # run as a script (python experiments/bench/NAME.py) or as a module
    from timing import fmt, median_ms, peak_mib, rel_diff
except ImportError:
    from experiments.bench.timing import fmt, median_ms, peak_mib, rel_diff

from zoo.models.mixers import _long_conv, h3, hyena
from zoo.models.mixers._common import check_input, compute_dtype
from zoo.models.mixers._long_conv import causal_conv
from zoo.models.mixers.h3 import H3
from zoo.models.mixers.hyena import Hyena


class BaselineH3(H3):
    """H3 with the baseline's per-channel layout and einsum read-out (training forward only, no state)."""

    def forward(self, x: torch.Tensor, state=None) -> torch.Tensor:
        check_input(x, self.d_model, self.name)
        T, p = x.shape[1], self.p
        q, k_shift, v, _ = self._qkv(x, None)
        k_h = rearrange(k_shift, "b t (h i) -> b t h i 1", i=p)
        v_h = rearrange(v, "b t (h j) -> b t h 1 j", j=p)
        u = rearrange(k_h * v_h, "b t h i j -> b t (h i j)")  # [B, T, H·p·p]
        dtype = compute_dtype(x.dtype)
        with torch.autocast(device_type=x.device.type, enabled=False):
            log_a = self._log_a(dtype)  # [H, N]
            lags = torch.arange(T, device=x.device, dtype=dtype)
            powers = torch.exp(lags[:, None, None] * log_a[None])  # [T, H, N]
            kernel = torch.einsum("lhn,hn->lh", powers, self.C.to(dtype) * self.B.to(dtype))  # [T, H]
            u32 = u.to(dtype)
            y = fp32_causal_conv(u32, kernel.repeat_interleave(p * p, dim=1))  # [B, T, H·p·p]
            y = y + self._per_channel(self.D, dtype) * u32
        q_h = rearrange(q, "... (h i) -> ... h i", i=p)
        y_h = rearrange(y.to(q.dtype), "... (h i j) -> ... h i j", i=p, j=p)
        return self.out(rearrange(torch.einsum("...hi,...hij->...hj", q_h, y_h), "... h j -> ... (h j)"))


def fp32_causal_conv(u: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """causal_conv with autocast off around it: the direct path's matmuls at IEEE fp32, the result in u's dtype."""
    with torch.autocast(device_type=u.device.type, enabled=False):
        return causal_conv(u, h)


CONV_PATCHES = (_long_conv, h3, hyena)  # modules whose causal_conv the mixers call (_long_conv: explicit_causal_conv)


def baseline_depthwise_causal_conv(u: torch.Tensor, weight: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """The baseline short conv: an einsum over the unfolded windows [B, T, C, k]."""
    u_full = torch.cat([history.to(u.dtype), u], dim=1)  # [B, T + k - 1, C]
    return torch.einsum("btck,ck->btc", u_full.unfold(1, weight.shape[1], 1), weight)


class BaselineHyena(Hyena):
    """Hyena with the baseline's unfolded-window short conv and its bias term as a pass of its own (training
    forward only, no state)."""

    def forward(self, x: torch.Tensor, state=None) -> torch.Tensor:
        check_input(x, self.d_model, self.name)
        B, T, _ = x.shape
        u = self.in_proj(x)  # [B, T, 3d]
        u_conv = baseline_depthwise_causal_conv(u, self.short_weight, u.new_zeros(B, self.k - 1, 3 * self.d_model))
        if self.short_bias is not None:
            u_conv = u_conv + self.short_bias.to(u_conv.dtype)
        x1, x2, v = u_conv.chunk(3, dim=-1)  # [B, T, d] each
        z = x1 * v
        return self.out(x2 * (fp32_causal_conv(z, self.filter(T)) + self.bias * z))


def build(mixer: str, d: int, L: int, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(baseline, library) modules of the Fig. 2 preset at (d, L), with the same parameters."""
    torch.manual_seed(0)
    if mixer == "h3":
        new = H3(d, d_state=L, head_dim=2, shift_size=L)
        old = BaselineH3(d, d_state=L, head_dim=2, shift_size=L)
    else:
        options = dict(max_seq_len=L, filter_hidden=64, num_freqs=0, short_kernel_size=3, decay_min=3.07,
                       decay_max=15.35, filter_depth=2, learn_freq=True, short_bias=True)
        new, old = Hyena(d, **options), BaselineHyena(d, **options)
    old.load_state_dict(new.state_dict())
    return old.to(device), new.to(device)


def toeplitz_flops(mixer: str, d: int, L: int, B: int) -> float:
    """FLOPs of the direct Toeplitz matmuls, forward+backward (3 products of 2·B·L² per channel)."""
    channels = d + 2 * d if mixer == "h3" else d  # h3: shift filter (d) + SSM inputs (p·d, p = 2)
    return 3 * 2 * B * L * L * channels


def row(mixer: str, d: int, L: int, B: int, device: torch.device, repeats: int) -> dict:
    old, new = build(mixer, d, L, device)
    x = torch.randn(B, L, d, device=device, generator=torch.Generator(device=device).manual_seed(1))
    grad_y = torch.randn(B, L, d, device=device, generator=torch.Generator(device=device).manual_seed(2))

    def step(m, autocast: bool = True):
        xi = x.clone().requires_grad_()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            y = m(xi)
        grads = torch.autograd.grad(y, [xi, *m.parameters()], grad_y)
        return y.detach(), grads

    r = {"mixer": mixer, "d": d, "L": L, "B": B}
    results = {}
    for form, m in (("baseline", old), ("library_fp32conv", new), ("library", new)):
        with ExitStack() as stack:
            if form != "library":
                for module in CONV_PATCHES:
                    stack.enter_context(mock.patch.object(module, "causal_conv", fp32_causal_conv))
            r[f"{form}_ms"] = median_ms(lambda m=m: step(m), device, repeats)
            r[f"{form}_mib"] = peak_mib(lambda m=m: step(m), device)
            results[form] = step(m)
    results["fp32"] = step(new, autocast=False)
    r["speedup"] = r["baseline_ms"] / r["library_ms"]
    r["speedup_fp32conv"] = r["baseline_ms"] / r["library_fp32conv_ms"]
    r["toeplitz_tflops"] = toeplitz_flops(mixer, d, L, B) / (r["library_ms"] * 1e9)
    (y0, g0), (y1, g1) = results["baseline"], results["library"]
    r["rel_diff_y"] = rel_diff(y1, y0)
    r["rel_diff_dx"] = rel_diff(g1[0], g0[0])
    r["rel_diff_dparams"] = max(rel_diff(a, b) for a, b in zip(g1[1:], g0[1:]))
    # Each form against the library run in fp32 without autocast.
    y_ref, g_ref = results["fp32"]
    for form in ("baseline", "library_fp32conv", "library"):
        y, g = results[form]
        r[f"{form}_err_y"] = rel_diff(y, y_ref)
        r[f"{form}_err_dparams"] = max(rel_diff(a, b) for a, b in zip(g[1:], g_ref[1:]))
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: small shapes, a few seconds")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    if args.tiny:
        args.device, args.repeats = "cpu", 2
        grid = [(32, 16, 8)]
    else:
        grid = [(d, L, B) for d in (256, 512) for L, B in ((64, 512), (128, 512), (256, 256))]
    device = torch.device(args.device)
    rows = [row(mixer, d, L, B, device, args.repeats) for d, L, B in grid for mixer in ("h3", "hyena")]

    print(f"H3 and Hyena (Zoology Fig. 2 presets) forward+backward under bf16 autocast, {device}: baseline vs library")
    print(
        f"{'mixer':>6} {'d':>4} {'L':>4} {'B':>4} | {'base ms':>8} {'lib fp32c':>9} {'x':>5} {'lib ms':>8} {'x':>5} "
        f"| {'base MiB':>8} {'lib MiB':>8} | {'TFLOP/s':>7} | {'diff y':>8} {'diff dx':>8} {'dparams':>8} | "
        f"{'err y: base':>11} {'fp32c':>8} {'lib':>8} | {'err dparams':>11} {'fp32c':>8} {'lib':>8}"
    )
    for r in rows:
        print(
            f"{r['mixer']:>6} {r['d']:>4} {r['L']:>4} {r['B']:>4} | {r['baseline_ms']:>8.2f} "
            f"{r['library_fp32conv_ms']:>9.2f} {r['speedup_fp32conv']:>5.2f} {r['library_ms']:>8.2f} "
            f"{r['speedup']:>5.2f} | {fmt(r['baseline_mib'], '8.0f')} {fmt(r['library_mib'], '8.0f')} | "
            f"{r['toeplitz_tflops']:>7.1f} | {r['rel_diff_y']:>8.1e} {r['rel_diff_dx']:>8.1e} "
            f"{r['rel_diff_dparams']:>8.1e} | {r['baseline_err_y']:>11.1e} {r['library_fp32conv_err_y']:>8.1e} "
            f"{r['library_err_y']:>8.1e} | {r['baseline_err_dparams']:>11.1e} "
            f"{r['library_fp32conv_err_dparams']:>8.1e} {r['library_err_dparams']:>8.1e}"
        )
    print(
        json.dumps(
            {
                "bench": "h3_hyena",
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "torch": torch.__version__,
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
