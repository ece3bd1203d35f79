"""kernels/launch.py: its plain-Python cdiv and next_power_of_2 equal Triton's, and the device checks."""

import pytest
import triton

from kernels.launch import cdiv, next_power_of_2


def test_next_power_of_2_equals_tritons():
    for n in range(0, 70000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n


def test_cdiv_equals_tritons():
    for a in range(0, 700):
        for b in (1, 2, 3, 7, 16, 32, 64, 100, 128, 1024):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_kernels_refuse_tensors_triton_cannot_launch_on(monkeypatch):
    """CPU tensors outside the interpreter, or inputs on two devices: one clear line, before any launch."""
    import pytest
    import torch

    from kernels.based import chunk_based, feature_dim, fused_recurrent_based

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, v = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 64)
    with pytest.raises(ValueError, match="needs CUDA tensors, or TRITON_INTERPRET=1") as e:
        chunk_based(q, q, v)
    assert "\n" not in str(e.value)
    state = (torch.zeros(1, 2, feature_dim(16), 64), torch.zeros(1, 2, feature_dim(16)))
    with pytest.raises(ValueError, match="needs CUDA tensors, or TRITON_INTERPRET=1"):
        fused_recurrent_based(q[:, 0], q[:, 0], v[:, 0], state)
    with pytest.raises(ValueError, match="different devices"):
        chunk_based(q, q.to("meta"), v)


def test_launch_key_separates_what_triton_specializes_on():
    """Arguments Triton compiles different code for get different keys; ones it treats alike share a key."""
    import torch

    from kernels.launch import launch_key

    buf = torch.zeros(64, dtype=torch.bfloat16)
    aligned, other_aligned, misaligned = buf[:8], buf[16:24], buf[1:9]  # bf16: 16 bytes = 8 elements
    assert aligned.data_ptr() % 16 == 0 and misaligned.data_ptr() % 16 != 0

    def key(*args, **kwargs):
        return launch_key(args, kwargs, 0)

    assert key(aligned, 32) == key(other_aligned, 48)  # same dtype, both aligned; both ints divisible by 16
    different = [key(misaligned, 32), key(aligned.float(), 32), key(aligned, 1), key(aligned, 33), key(aligned, 2**40),
                 key(aligned, -16), key(aligned, 32.0), key(None, 32), key(aligned, True), key(aligned, 32, BV=64),
                 key(aligned, 32, num_warps=8)]
    base = key(aligned, 32, BV=32)
    assert len({base, *different}) == len(different) + 1
    assert key(aligned, 32) != launch_key((aligned, 32), {}, 1)  # the device


def test_launch_key_of_tma_descriptors():
    """Gluon's host TMA descriptors (the Gluon forward's stored states) key on what their type says (dtype, block,
    shared layout, rank, padding), not on their address or size, which the launcher reads on every launch."""
    import torch

    hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from triton.experimental.gluon import language as gl

    from kernels.launch import launch_key

    def desc(t, block):
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16)
        return launch_key((hopper.TensorDescriptor.from_tensor(t, block, layout),), {}, 0)

    a, b = torch.zeros(128, 192, dtype=torch.bfloat16), torch.zeros(256, 192, dtype=torch.bfloat16)
    assert desc(a, [64, 64]) == desc(b, [64, 64])
    assert len({desc(a, [64, 64]), desc(a, [64, 32]), desc(a.half(), [64, 64])}) == 3


class _FakeCompiled:
    """A compiled kernel's launcher, recording what it is given."""

    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.calls = []

    def run(self, *a):
        self.calls.append(a)


class _FakeKernel:
    """A JIT kernel: `kernel[grid](...)` records the call and returns one compiled kernel per specialization."""

    def __init__(self):
        self.jit_calls = []
        self.compiled = {}

    @staticmethod
    def fn(x, y, n, A=3, B=4):  # noqa: N803 (the kernel's signature, as a Triton kernel's)
        pass

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            from kernels.launch import launch_key

            self.jit_calls.append((grid, args, kwargs))
            return self.compiled.setdefault(launch_key(args, kwargs, 0), _FakeCompiled())
        return run


def test_launch_reuses_the_compiled_kernel_with_arguments_in_signature_order(monkeypatch):
    """A key's first launch goes through the JIT; later ones straight to its compiled kernel, with every parameter
    (keywords and defaults included) in the kernel's signature order, on the current stream; a new specialization
    (a misaligned tensor) goes through the JIT again."""
    import torch

    from kernels import launch as L

    monkeypatch.setattr(L, "_direct_ok", lambda args: True)
    monkeypatch.setattr(L, "_device", lambda: 0)
    monkeypatch.setattr(L, "_stream", lambda device: "stream")
    kernel = _FakeKernel()
    buf = torch.zeros(64)
    x, y = buf[:4], buf[8:12]
    first = L.launch(kernel, (5, 2), x, y, 32, B=7)
    assert len(kernel.jit_calls) == 1 and first.calls == []
    second = L.launch(kernel, (6,), y, x, 48, B=7)  # same key: aligned fp32 tensors, an int divisible by 16
    assert second is first and len(kernel.jit_calls) == 1
    (call,) = first.calls
    assert call[:7] == (6, 1, 1, "stream", "fn", "meta", None)
    assert call[9] is y and call[10] is x and call[11:] == (48, 3, 7)  # x, y, n, A (its default), B (the keyword)
    L.launch(kernel, (6,), buf[1:5], x, 48, B=7)  # misaligned: a different specialization
    assert len(kernel.jit_calls) == 2
    monkeypatch.setattr(L, "_direct_ok", lambda args: False)  # e.g. under the interpreter: always the JIT
    L.launch(kernel, (6,), y, x, 48, B=7)
    assert len(kernel.jit_calls) == 3


def test_direct_path_only_without_launch_hooks(monkeypatch):
    """Triton's launch hooks (profilers) need its JIT path: a hook in the chain turns the direct path off."""
    from triton import knobs

    from kernels import launch as L

    assert L._unhooked(None) and L._unhooked(knobs.runtime.launch_enter_hook)  # unset: an empty chain
    knobs.runtime.launch_enter_hook.add(print)
    try:
        assert not L._unhooked(knobs.runtime.launch_enter_hook)
    finally:
        knobs.runtime.launch_enter_hook.remove(print)
    assert not L._unhooked(print)  # a bare callable (older Triton)


def test_direct_path_only_on_triton_versions_whose_launcher_takes_every_parameter():
    from kernels.launch import direct_launch_supported

    assert direct_launch_supported("3.6.0") and direct_launch_supported("3.9.0") and direct_launch_supported("4.0.1")
    assert not direct_launch_supported("3.2.0") and not direct_launch_supported("3.5.1")
    assert not direct_launch_supported("nightly")


def test_sm_count_asks_the_driver_once_per_device(monkeypatch):
    """`sm_count`: a CUDA device's SMs from its properties, asked once per device; off CUDA (the interpreter) an
    H100's or H200's 132."""
    import torch

    from kernels import launch as L

    class Props:
        multi_processor_count = 78

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: asked.append(device) or Props)
    L.sm_count.cache_clear()
    try:
        assert L.sm_count(torch.device("cuda", 1)) == 78
        assert L.sm_count(torch.device("cuda", 1)) == 78
        assert asked == [torch.device("cuda", 1)]
        assert L.sm_count(torch.device("cpu")) == L.HOPPER_SMS == 132
    finally:
        L.sm_count.cache_clear()
