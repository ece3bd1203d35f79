"""Cases shared by the interpreted and GPU tests of BaseConv's decoding kernel: a mixer at impl="triton" and its
impl="naive" twin with the same weights, stepped from the same prefilled state."""

from dataclasses import dataclass

import torch

from zoo.models.mixers.base_conv import BaseConv


@dataclass(frozen=True)
class ConvCase:
    d_model: int
    kernel_size: int
    expand: int
    prefill: int  # tokens before the decoding steps
    steps: int

    @property
    def id(self) -> str:
        return f"d{self.d_model}-k{self.kernel_size}-x{self.expand}-prefill{self.prefill}-steps{self.steps}"


CASES = [
    ConvCase(d_model=16, kernel_size=3, expand=2, prefill=2, steps=5),  # Based's k and expand
    ConvCase(d_model=24, kernel_size=4, expand=1, prefill=0, steps=6),  # channels not a power of two, empty history
    ConvCase(d_model=8, kernel_size=2, expand=2, prefill=3, steps=3),  # one history slot: no shift
    ConvCase(d_model=8, kernel_size=1, expand=2, prefill=1, steps=2),  # no history at all
    ConvCase(d_model=600, kernel_size=3, expand=2, prefill=1, steps=3),  # 1,200 channels: two blocks, the last partial
]


def twins(case: ConvCase, device, dtype=torch.float32):
    """(naive, triton) mixers with equal weights (a random bias: the init's zeros would hide its handling)."""
    torch.manual_seed(0)
    naive = BaseConv(case.d_model, kernel_size=case.kernel_size, expand=case.expand)
    with torch.no_grad():
        naive.conv.bias.normal_()
    fast = BaseConv(case.d_model, kernel_size=case.kernel_size, expand=case.expand, impl="triton")
    fast.load_state_dict(naive.state_dict())
    return naive.to(device, dtype), fast.to(device, dtype)


def run_steps(case: ConvCase, device, dtype=torch.float32, batch: int = 3):
    """Outputs [steps, B, d] and final conv histories of both twins, from one prefill."""
    naive, fast = twins(case, device, dtype)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(batch, case.prefill + case.steps, case.d_model, generator=g).to(device, dtype)
    results = []
    for mixer in (naive, fast):
        state = mixer.init_state(batch, device=device, dtype=dtype)
        with torch.no_grad():
            if case.prefill:
                mixer(x[:, : case.prefill], state)
            outs = [mixer.step(x[:, case.prefill + t], state) for t in range(case.steps)]
        results.append((torch.stack(outs), state["conv"]))
    return results
