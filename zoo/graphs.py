"""One CUDA-graph helper for training steps and decode steps.

A tiny model's step is hundreds of kernel launches that each do little. `StaticGraph` captures a function of
fixed-shape device tensors once and replays it: a call copies the new inputs into the captured (static)
buffers and replays the whole step with one launch.

Capture follows PyTorch's whole-network recipe: `warmup` eager calls on a side stream (allocator and library
handles settle there), then the capture on the graph's own memory pool. A function with side effects (an
optimizer update) passes `snapshot`/`restore`, so the warm-up's effects are undone and the first replay is the
first real step. `eager=True` keeps the same static-buffer calling convention but runs the function without a
graph (the CPU tests' path); `warmup_outputs` holds the first warm-up call's result, the eager twin of a
replay on the example inputs.

The eager check (`check=True`): right after the capture, the graph is replayed once on the example inputs and its
outputs must match the first warm-up call's (`compare_outputs`), else `GraphCheckError`. A function with side
effects is undone around that replay too (`snapshot`/`restore`); one without them must leave the same state when
run twice (as the decode steps do, which move no counter). A function that draws random numbers cannot match.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("zoo.graphs")


class GraphCheckError(RuntimeError):
    """A captured graph's replay disagreed with the same function run eagerly."""


def _leaves(tree: Any, path: str = "") -> list[tuple[str, Any]]:
    """(path, leaf) pairs of nested tuples, lists and dicts, in order (paths name the leaves in errors)."""
    if isinstance(tree, (tuple, list)):
        return [leaf for i, x in enumerate(tree) for leaf in _leaves(x, f"{path}[{i}]")]
    if isinstance(tree, dict):
        return [leaf for k in sorted(tree, key=str) for leaf in _leaves(tree[k], f"{path}[{k!r}]")]
    return [(path or "output", tree)]


def compare_outputs(replayed: Any, eager: Any, rtol: float = 1e-3, atol: float = 1e-5, name: str = "step") -> None:
    """GraphCheckError unless `replayed` matches `eager`: the same structure (tuples, lists, dicts), equal
    non-tensor leaves, and tensors of one shape and dtype whose largest difference is at most
    rtol · max|eager| + atol (a NaN anywhere fails). The same kernels on the same inputs differ only by
    library-level nondeterminism, so the bound is tight."""
    a, b = _leaves(replayed), _leaves(eager)
    if [p for p, _ in a] != [p for p, _ in b]:
        raise GraphCheckError(f"{name}: the replay returns {[p for p, _ in a]}, eager {[p for p, _ in b]}")
    for (path, x), (_, y) in zip(a, b):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            raise GraphCheckError(f"{name}: the replay gives {path} = {type(x).__name__}, eager {y!r}")
        if not isinstance(x, torch.Tensor):
            if x is not y and x != y:
                raise GraphCheckError(f"{name}: the replay gives {path} = {x!r}, eager {y!r}")
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            raise GraphCheckError(f"{name}: the replay gives {path} of shape {tuple(x.shape)} {x.dtype}, "
                                  f"eager {tuple(y.shape)} {y.dtype}")
        if x.numel() == 0:
            continue
        x, y = x.detach().double(), y.detach().double()
        tolerance = rtol * float(y.abs().max()) + atol
        diff = float((x - y).abs().max())
        if not diff <= tolerance:  # also a NaN
            raise GraphCheckError(f"{name}: the replay differs from eager at {path} by {diff:.3g} "
                                  f"(> {tolerance:.3g})")


def _clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, (tuple, list)):
        return type(tree)(_clone(x) for x in tree)
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    return tree


class StaticGraph:
    """`fn(*inputs)` as a CUDA graph over static copies of `example_inputs` (tensors; their shapes are fixed).

    snapshot: called before the warm-up, returns what `restore` needs to undo it (optimizer state, RNG).
    restore: called with that object after the warm-up, before the capture.
    device: where a function without tensor inputs runs (it reads buffers of its own).
    check: replay once on the example inputs right after the capture and compare with the first warm-up call
    (`compare_outputs` with `check_rtol`, `check_atol`); GraphCheckError on a mismatch. Ignored when eager.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        example_inputs: tuple[torch.Tensor, ...],
        *,
        warmup: int = 2,
        eager: bool = False,
        snapshot: Callable[[], Any] | None = None,
        restore: Callable[[Any], None] | None = None,
        before_capture: Callable[[], None] | None = None,
        device: torch.device | None = None,
        capture_error_mode: str = "global",
        name: str = "step",
        check: bool = False,
        check_rtol: float = 1e-3,
        check_atol: float = 1e-5,
    ) -> None:
        if check and warmup < 1:
            raise ValueError("StaticGraph(check=True) needs a warm-up call to compare the replay with")
        self.fn = fn
        self.inputs = tuple(x.clone() for x in example_inputs)
        self.eager = eager
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Any = None
        self.warmup_outputs: Any = None  # what the first warm-up call returned (the eager twin of a replay)
        if eager:
            return
        device = device if device is not None else self.inputs[0].device
        if device.type != "cuda":
            raise ValueError(f"a CUDA graph needs CUDA tensors, got {device}")
        saved = snapshot() if snapshot is not None else None
        rng = torch.cuda.get_rng_state(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for i in range(warmup):
                out = fn(*self.inputs)
                if i == 0:
                    # a clone for the check: later warm-up calls may write into what the first returned
                    self.warmup_outputs = _clone(out) if check else out
        torch.cuda.current_stream(device).wait_stream(side)
        if restore is not None:
            restore(saved)
        saved = None  # freed before the check's snapshot: a decode state may take most of the GPU's memory
        torch.cuda.set_rng_state(rng, device)
        if before_capture is not None:
            before_capture()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode=capture_error_mode):
            self.outputs = fn(*self.inputs)
        log.info("captured %s as a CUDA graph (inputs %s)", name, [tuple(x.shape) for x in self.inputs])
        if check:
            saved = snapshot() if snapshot is not None else None
            rng = torch.cuda.get_rng_state(device)
            try:
                self.graph.replay()
                # before the restore: an output may be a view of the state that it rewrites
                compare_outputs(self.outputs, self.warmup_outputs, check_rtol, check_atol, name)
            finally:
                if restore is not None:
                    restore(saved)
                torch.cuda.set_rng_state(rng, device)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        """Copy `inputs` into the static buffers (unless they are those buffers) and replay; returns the
        captured outputs."""
        for static, x in zip(self.inputs, inputs):
            if static.data_ptr() != x.data_ptr():
                static.copy_(x)
        if self.graph is None:
            return self.fn(*self.inputs)
        self.graph.replay()
        return self.outputs
