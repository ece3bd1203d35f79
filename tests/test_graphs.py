"""zoo.graphs: the eager check of StaticGraph. Its comparison (`compare_outputs`) is tested on CPU case by case;
the check of a real capture needs CUDA."""

import pytest
import torch

from zoo.graphs import GraphCheckError, StaticGraph, compare_outputs

X = torch.tensor([1.0, -2.0, 4.0])

AGREE = {
    "equal": (X.clone(), X),
    "within-tolerance": (X + 1e-3 * 4.0 * 0.5, X),  # half of rtol * max|eager|
    "tuple": ((X, torch.tensor(3)), (X.clone(), torch.tensor(3))),
    "dict-and-none": ({"logits": X, "state": None}, {"state": None, "logits": X.clone()}),
    "non-tensor-leaf": ((X, 5), (X, 5)),
    "empty": (torch.empty(0, 3), torch.empty(0, 3)),
}

DISAGREE = {
    "beyond-tolerance": ((X + 1e-2), X, "the step: the replay differs from eager at output by"),
    "nan": (torch.tensor([1.0, float("nan"), 4.0]), X, "differs from eager"),
    "shape": (X[:2], X, r"of shape \(2,\)"),
    "dtype": (X.double(), X, "torch.float64"),
    "tuple-length": ((X,), (X, X), "returns"),
    "dict-keys": ({"a": X}, {"b": X}, "returns"),
    "tensor-vs-number": ((X, X), (X, 1.0), "= Tensor, eager 1.0"),
    "non-tensor-leaf": ((X, 5), (X, 6), "= 5, eager 6"),
    "deep-leaf": ({"s": [X, X + 1]}, {"s": [X, X]}, r"\['s'\]\[1\]"),
}


@pytest.mark.parametrize("replayed,eager", AGREE.values(), ids=AGREE.keys())
def test_matching_outputs_pass(replayed, eager):
    compare_outputs(replayed, eager, name="the step")


@pytest.mark.parametrize("replayed,eager,message", DISAGREE.values(), ids=DISAGREE.keys())
def test_mismatching_outputs_raise(replayed, eager, message):
    with pytest.raises(GraphCheckError, match=message):
        compare_outputs(replayed, eager, name="the step")


def test_the_tolerance_is_relative_to_the_eager_magnitude():
    compare_outputs(torch.tensor([1000.5]), torch.tensor([1000.0]))  # 0.5 <= 1e-3 * 1000 + 1e-5
    with pytest.raises(GraphCheckError):
        compare_outputs(torch.tensor([1.5]), torch.tensor([1.0]))


def test_a_check_without_warm_up_is_refused():
    with pytest.raises(ValueError, match="needs a warm-up"):
        StaticGraph(lambda x: x, (X,), warmup=0, check=True, eager=True)


def test_the_eager_path_runs_the_function_on_the_static_inputs():
    graph = StaticGraph(lambda x: x * 2, (X,), eager=True, check=True)
    torch.testing.assert_close(graph(X + 1), (X + 1) * 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("warmup", [1, 2])
def test_a_faithful_capture_passes_and_its_check_is_undone(warmup):
    w = torch.randn(64, 64, device="cuda")
    state = torch.zeros(64, device="cuda")

    def step(x):
        state.add_(1.0)  # a side effect that the warm-up and the check must not leave behind
        return {"y": x @ w + state, "sum": (x @ w).sum()}

    saved = []
    graph = StaticGraph(step, (torch.randn(8, 64, device="cuda"),), warmup=warmup, check=True,
                        snapshot=lambda: saved.append(state.clone()) or state.clone(), restore=state.copy_)
    assert len(saved) == 2  # the warm-up's and the check's
    assert float(state.sum()) == 0.0
    x = torch.randn(8, 64, device="cuda")
    out = graph(x)
    torch.testing.assert_close(out["y"], x @ w + 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_capture_that_differs_from_eager_raises():
    def step(x):
        # what capture records is not what the eager warm-up ran
        return x * 2 if torch.cuda.is_current_stream_capturing() else x

    with pytest.raises(GraphCheckError, match="the doubling step: the replay differs from eager"):
        StaticGraph(step, (torch.ones(4, device="cuda"),), check=True, name="the doubling step")
    StaticGraph(step, (torch.ones(4, device="cuda"),), name="the doubling step")  # unchecked: no error
