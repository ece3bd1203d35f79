"""Host-side helpers for launching the Triton kernels: where they can run, whether a backward will follow
(`grad_needed`), integers for launch shapes, a device's SM count (`sm_count`), and `launch`, a cheaper way through
Triton's launcher.

`triton.cdiv` and `triton.next_power_of_2` are Triton constexpr functions: called from Python each one unwraps its
arguments first, a few microseconds per call, and a Based forward+backward computes some forty such values. These
are the same functions in plain Python (equal on every non-negative int; tests/kernels/test_launch.py).

`launch(kernel, grid, *args, **kwargs)` does what `kernel[grid](*args, **kwargs)` does, with less host work. Triton's
JIT path binds every argument, works out its specialization and looks the compiled kernel up by a string key on
every call, which costs several times the launch itself for a kernel of a dozen arguments. So `launch` keeps, per
kernel, the compiled kernels it has seen under a key of everything Triton specializes a kernel on, at least as fine
as Triton's own: each argument's dtype and 16-byte alignment (tensors), whether it is 1, divisible by 16 and its
integer width (ints), bools and None by value, every keyword (constexprs, num_warps, ...) by value, and the current
device. A key seen for the first time goes through `kernel[grid]` (which compiles if need be) and keeps the
compiled kernel it returns; later calls with that key launch it directly on the current stream (so CUDA-graph
capture works). The JIT path is taken whenever the direct one could differ: the interpreter (TRITON_INTERPRET=1),
tensors off CUDA, torch.compile tracing (which must see Triton launches), a launch hook set (Triton's profiling;
setting one is also how to send every launch through the JIT path when debugging), or Triton before 3.6
(`direct_launch_supported`).
"""

import functools
import inspect
import os

import torch


def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels launch on tensors of `device`: CUDA, or the CPU under Triton's interpreter
    (TRITON_INTERPRET=1, set before triton is first imported)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def is_capturing(x: torch.Tensor) -> bool:
    """True while a CUDA graph is being captured on x's stream (launches then cost the host nothing, and code that
    reads device values must skip them)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def check_devices(op: str, *tensors: torch.Tensor | None) -> None:
    """One clear error, before any launch, for inputs on several devices or on one Triton cannot launch on."""
    present = [t.device for t in tensors if t is not None]
    if present and present[0].type == "cuda" and all(d == present[0] for d in present):
        return  # the common case, without building the message's strings (this runs on every eager call)
    devices = sorted({str(d) for d in present})
    if len(devices) > 1:
        raise ValueError(f"{op}: inputs are on different devices ({', '.join(devices)})")
    if devices and not triton_runs_on(torch.device(devices[0])):
        raise ValueError(f"{op} runs Triton kernels: it needs CUDA tensors, or TRITON_INTERPRET=1 on the CPU (got "
                         f"{devices[0]} tensors); kernels/based/naive.py has the same functions in PyTorch")


def grad_needed(*tensors: torch.Tensor | None) -> bool:
    """Whether a backward can follow an op on `tensors` (grad mode on, one of them requiring grad), so that its
    forward must keep what the backward reads. Inside torch.func.vmap, ask on the unwrapped tensors of the op's
    vmap rule: a batched tensor's requires_grad reads False."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# SMs assumed off CUDA (the interpreter runs programs one by one): an H100's or H200's, so that the CPU tests plan
# launches, e.g. the fused forward's segments, as those GPUs do
HOPPER_SMS = 132


@functools.cache
def sm_count(device: torch.device) -> int:
    """The number of SMs of `device`, asked of the driver once per device; HOPPER_SMS off CUDA."""
    if device.type != "cuda":
        return HOPPER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for ints, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ n (n itself for n ≤ 1, as `triton.next_power_of_2`)."""
    return n if n <= 1 else 1 << (n - 1).bit_length()


_INT32 = (-(2**31), 2**31)
_launchers: dict = {}  # kernel -> {key: (compiled kernel, plan)}, or None where the direct path is not available


def _arg_key(x):
    """What Triton's specialization can depend on for one runtime argument (at least as fine as Triton's)."""
    if isinstance(x, torch.Tensor):
        return x.dtype, x.data_ptr() % 16 == 0
    if isinstance(x, bool) or x is None:
        return x
    if isinstance(x, int):
        return int, x == 1, x % 16 == 0, _INT32[0] <= x < _INT32[1], 0 <= x < 2**63
    if isinstance(x, float):
        return float
    if hasattr(x, "base") and hasattr(x, "block_shape") and hasattr(x, "layout"):  # a host TMA descriptor (Gluon)
        # its shared layout by repr: Triton 3.6's NVMMASharedLayout holds a list, so it does not hash
        return "tensordesc", x.base.dtype, tuple(x.block_shape), _layout_repr(x.layout), len(x.shape), x.padding
    return type(x), x  # anything else by value (hashable, or the lookup raises and the JIT path is taken)


_REPRS: dict = {}  # id(layout) -> (layout, repr): kernels pass the same few layout objects on every call


def _layout_repr(layout) -> str:
    hit = _REPRS.get(id(layout))
    if hit is None or hit[0] is not layout:
        hit = _REPRS[id(layout)] = (layout, repr(layout))
    return hit[1]


def launch_key(args: tuple, kwargs: dict, device: int) -> tuple:
    """The cache key of one launch: the current device, every positional argument's `_arg_key`, every keyword by
    value."""
    return device, tuple([_arg_key(a) for a in args]), tuple(kwargs.items())


def _plan(kernel, args: tuple, kwargs: dict) -> list:
    """Where each of the kernel's parameters comes from, in its signature's order (what Triton's launcher takes, the
    constexprs included): (0, i) the i-th positional argument, (1, name) a keyword, (2, value) the default."""
    plan = []
    for i, (name, param) in enumerate(inspect.signature(kernel.fn).parameters.items()):
        if i < len(args):
            plan.append((0, i))
        elif name in kwargs:
            plan.append((1, name))
        else:
            plan.append((2, param.default))
    return plan


def _direct_ok(args: tuple) -> bool:
    """Whether this launch may skip Triton's JIT path (see the module docstring; torch.compile is checked first).
    The interpreter (TRITON_INTERPRET=1) runs on CPU tensors, so the first argument being on CUDA rules it out."""
    if not (args and isinstance(args[0], torch.Tensor) and args[0].is_cuda):
        return False
    triton = _triton()
    if not direct_launch_supported(triton.__version__):
        return False
    runtime = triton.knobs.runtime
    return _unhooked(runtime.launch_enter_hook) and _unhooked(runtime.launch_exit_hook)


@functools.lru_cache
def direct_launch_supported(version: str) -> bool:
    """Triton versions whose compiled-kernel launcher takes every parameter, constexprs included, in signature order
    (as their JIT path passes them): 3.6 was checked on the GPU and 3.9 reads the same. Triton ≤ 3.2
    passed only the non-constexpr ones, so older versions keep the JIT path."""
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (3, 6)


@functools.cache
def _triton():
    """The triton module (imported on first use: this module is also imported where Triton is not needed)."""
    import triton
    import triton.runtime.driver  # noqa: F401 (triton.runtime.driver.active)

    return triton


def _unhooked(hook) -> bool:
    """No launch hook: None, or an empty chain (Triton 3.6 on keeps a `HookChain` and calls what it holds)."""
    return hook is None or getattr(hook, "calls", None) == []


def _device() -> int:
    return _triton().runtime.driver.active.get_current_device()


def _stream(device: int):
    return _triton().runtime.driver.active.get_current_stream(device)


def launch(kernel, grid: tuple, *args, **kwargs):
    """`kernel[grid](*args, **kwargs)`, through the compiled kernel's launcher once this key has been seen (see the
    module docstring). grid: a tuple of 1 to 3 ints. Returns the compiled kernel."""
    if torch.compiler.is_compiling() or _launchers.get(kernel, {}) is None or not _direct_ok(args):
        return kernel[grid](*args, **kwargs)
    device = _device()
    key = launch_key(args, kwargs, device)
    cache = _launchers.setdefault(kernel, {})
    try:
        hit = cache.get(key)
    except TypeError:  # an unhashable argument: nothing to key on
        return kernel[grid](*args, **kwargs)
    if hit is None:
        compiled = kernel[grid](*args, **kwargs)
        if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            _launchers[kernel] = None  # a Triton without the launcher this relies on: the JIT path from now on
        else:
            cache[key] = (compiled, _plan(kernel, args, kwargs))
        return compiled
    compiled, plan = hit
    values = [args[x] if src == 0 else kwargs[x] if src == 1 else x for src, x in plan]
    g = (tuple(grid) + (1, 1))[:3]
    compiled.run(g[0], g[1], g[2], _stream(device), compiled.function, compiled.packed_metadata, None, None, None,
                 *values)
    return compiled
