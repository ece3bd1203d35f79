"""H3 under bf16 autocast (zoo/models/mixers/h3.py): the SSM convolution runs with autocast on, on bf16 inputs (so
causal_conv's direct path takes bf16 operands), and the mixer's output stays within bf16 rounding of its fp64 step
loop, its gradients of its fp64 forward's. The fp64 protocol (forward == step loop, chunks, state size) is
tests/models/test_mixers.py's."""

from unittest import mock

import pytest
import torch

from zoo.models.mixers import h3
from zoo.models.mixers.h3 import H3

D = 16
CASES = {
    "p1": {"d_state": 8},
    "p2": {"d_state": 8, "head_dim": 2},
    "p2-long-shift": {"d_state": 4, "head_dim": 2, "shift_size": 40},  # the shift filter through causal_conv
}


def build(options) -> H3:
    torch.manual_seed(0)
    return H3(D, **options)


@pytest.mark.parametrize("options", list(CASES.values()), ids=list(CASES))
def test_ssm_convolution_runs_under_autocast_on_bf16(options):
    """h3's causal_conv call (the SSM; the shift filter goes through explicit_causal_conv) sees autocast on and a
    bf16 u."""
    seen = []
    original = h3.causal_conv

    def recording(u, h):
        seen.append((torch.is_autocast_enabled("cpu"), u.dtype))
        return original(u, h)

    mixer = build(options)
    with mock.patch.object(h3, "causal_conv", recording), torch.autocast("cpu", dtype=torch.bfloat16):
        mixer(torch.randn(2, 12, D))
    assert seen == [(True, torch.bfloat16)]


@pytest.mark.parametrize("options", list(CASES.values()), ids=list(CASES))
def test_autocast_within_bf16_rounding_of_fp64(options):
    """Under bf16 autocast: y against the fp64 step loop (the recurrent form), dx and every parameter gradient
    against the fp64 parallel forward, each relative to its largest value, within 2^-5 (bf16's 2^-9 per rounding,
    over a few roundings and the cancelling sums of the parameter gradients; the largest seen is ≈ 2.5e-2)."""
    mixer = build(options)
    x, grad_y = torch.randn(3, 33, D), torch.randn(3, 33, D)
    x_ = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mixer(x_)
    got = [y.detach(), *torch.autograd.grad(y, [x_, *mixer.parameters()], grad_y.to(y.dtype))]
    exact = build(options).double()
    x64 = x.double().requires_grad_()
    with torch.no_grad():
        state = exact.init_state(3)
        steps = torch.stack([exact.step(x64[:, t], state) for t in range(33)], dim=1)
    want = [steps, *torch.autograd.grad(exact(x64), [x64, *exact.parameters()], grad_y.double())]
    names = ["y", "dx", *(name for name, _ in mixer.named_parameters())]
    for name, g, w in zip(names, got, want):
        error = ((g.double() - w).abs().max() / w.abs().max()).item()
        assert error <= 2**-5, f"{name}: relative error {error:.2e}"


def test_zoology_training_forward_has_no_complex_tensors():
    """ssm=zoology's forward without a state (training's) stays real: its kernel from dA's modulus and angle, its
    shift filter a direct correlation. A complex tensor would leave torch.compile one unfused op per use."""
    model = H3(8, d_state=6, head_dim=2, shift_size=6, ssm="zoology")
    complex_nodes = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor) and value.is_complex():
                complex_nodes.append(node.name)
        return gm

    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(2, 6, 8))
    assert not complex_nodes, complex_nodes
