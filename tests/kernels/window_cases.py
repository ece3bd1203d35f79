"""Cases shared by the interpreted and GPU tests of the sliding-window decoding kernel: a mixer at impl="triton"
and its impl="naive" twin with the same weights, stepped from the same prefilled state."""

from dataclasses import dataclass

import torch

from zoo.models.mixers.sliding_window import SlidingWindowAttention


@dataclass(frozen=True)
class WindowCase:
    d_model: int
    num_heads: int
    window: int
    prefill: int  # tokens before the decoding steps
    steps: int
    start: bool = False  # left-padded rows: a per-row first position
    zoology: bool = False  # Zoology's SlidingAttn: no rotary, biased projections

    @property
    def id(self) -> str:
        return (f"d{self.d_model}-h{self.num_heads}-w{self.window}-prefill{self.prefill}-steps{self.steps}"
                + ("-start" if self.start else "") + ("-zoology" if self.zoology else ""))


CASES = [
    WindowCase(d_model=16, num_heads=2, window=4, prefill=3, steps=6),  # fills, then wraps the ring
    WindowCase(d_model=24, num_heads=2, window=5, prefill=0, steps=7),  # W and D/2 not powers of two, empty ring
    WindowCase(d_model=32, num_heads=1, window=8, prefill=10, steps=3, start=True),
    WindowCase(d_model=64, num_heads=1, window=16, prefill=20, steps=2),  # head dim 64, as based_1b's
    WindowCase(d_model=16, num_heads=1, window=5, prefill=4, steps=5, zoology=True),
]


def twins(case: WindowCase, device, dtype=torch.float32):
    """(naive, triton) mixers with equal weights."""
    torch.manual_seed(0)
    options = dict(window=case.window, num_heads=case.num_heads, rotary=not case.zoology, bias=case.zoology)
    naive = SlidingWindowAttention(case.d_model, **options)
    fast = SlidingWindowAttention(case.d_model, **options, impl="triton")
    fast.load_state_dict(naive.state_dict())
    return naive.to(device, dtype), fast.to(device, dtype)


def run_steps(case: WindowCase, device, dtype=torch.float32):
    """Outputs [steps, B, d] and final states of both twins, from one prefill, B = 3."""
    naive, fast = twins(case, device, dtype)
    g = torch.Generator(device="cpu").manual_seed(1)
    B = 3
    x = torch.randn(B, case.prefill + case.steps, case.d_model, generator=g).to(device, dtype)
    results = []
    for mixer in (naive, fast):
        state = mixer.init_state(B, device=device, dtype=dtype)
        if case.start:
            state["start"] = torch.tensor([0, 2, 5], device=device)
        with torch.no_grad():
            if case.prefill:
                mixer(x[:, : case.prefill], state)
            outs = [mixer.step(x[:, case.prefill + t], state) for t in range(case.steps)]
        results.append((torch.stack(outs), state))
    return results
