"""One CUDA-graph helper for training steps and decode steps.

A tiny model's step is hundreds of kernel launches that each do little. `StaticGraph` captures a function of
fixed-shape device tensors once and replays it: a call copies the new inputs into the captured (static)
buffers and replays the whole step with one launch.

Capture follows PyTorch's whole-network recipe: `warmup` eager calls on a side stream (allocator and library
handles settle there), then the capture on the graph's own memory pool. A function with side effects (an
optimizer update) passes `snapshot`/`restore`, so the warm-up's effects are undone and the first replay is the
first real step. `eager=True` keeps the same static-buffer calling convention but runs the function without a
graph (the CPU tests' path); `warmup_outputs` holds the last warm-up call's result, an eager twin of the first
replay that callers may compare against.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("zoo.graphs")


class StaticGraph:
    """`fn(*inputs)` as a CUDA graph over static copies of `example_inputs` (tensors; their shapes are fixed).

    snapshot: called before the warm-up, returns what `restore` needs to undo it (optimizer state, RNG).
    restore: called with that object after the warm-up, before the capture.
    device: where a function without tensor inputs runs (it reads buffers of its own).
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
    ) -> None:
        self.fn = fn
        self.inputs = tuple(x.clone() for x in example_inputs)
        self.eager = eager
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Any = None
        self.warmup_outputs: Any = None  # what the last warm-up call returned (an eager twin of the first replay)
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
            for _ in range(warmup):
                self.warmup_outputs = fn(*self.inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        if restore is not None:
            restore(saved)
        torch.cuda.set_rng_state(rng, device)
        if before_capture is not None:
            before_capture()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode=capture_error_mode):
            self.outputs = fn(*self.inputs)
        log.info("captured %s as a CUDA graph (inputs %s)", name, [tuple(x.shape) for x in self.inputs])

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
