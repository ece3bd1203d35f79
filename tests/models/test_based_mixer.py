"""Based mixer: naive path against a plain quadratic reference, state dtype, impl="triton" wiring (with stand-in
kernels), and impl="fla" against naive under the Triton interpreter in a subprocess."""

import importlib.util
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kernels.based
from kernels.based.naive import taylor_feature_map
from zoo.models.mixers import MIXERS

D_MODEL, H, F_DIM = 16, 2, 4
REPO = Path(__file__).resolve().parents[2]


def based(**options) -> torch.nn.Module:
    torch.manual_seed(0)
    options = {"feature_dim": F_DIM, "num_heads": H, **options}
    return MIXERS["based"](D_MODEL, **options).double()


def quadratic_reference(mixer, x: torch.Tensor) -> torch.Tensor:
    """y_i = Σ_{j≤i} κ(q_i,k_j) v_j / (Σ_{j≤i} κ(q_i,k_j) + eps), κ = 1 + s + s²/2, s = q·k/√f; full T×T matrix."""
    B, T, _ = x.shape
    q = (x @ mixer.q_proj.weight.T).reshape(B, T, H, F_DIM)
    k = (x @ mixer.k_proj.weight.T).reshape(B, T, H, F_DIM)
    v = (x @ mixer.v_proj.weight.T).reshape(B, T, H, -1)
    s = torch.einsum("bihf,bjhf->bhij", q, k) / math.sqrt(F_DIM)
    kernel = (1 + s + s**2 / 2) * torch.ones(T, T, dtype=x.dtype).tril()
    num = torch.einsum("bhij,bjhd->bihd", kernel, v)
    den = kernel.sum(-1).transpose(1, 2)[..., None] + mixer.config.eps
    return (num / den).reshape(B, T, -1) @ mixer.out.weight.T


@pytest.mark.parametrize("chunk_size", [1, 5, 64], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("T", [1, 7, 33], ids=lambda T: f"T{T}")
def test_naive_equals_quadratic_reference(T, chunk_size):
    mixer = based(chunk_size=chunk_size)
    x = torch.randn(2, T, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(mixer(x), quadratic_reference(mixer, x), rtol=1e-10, atol=1e-12)


def test_state_holds_the_feature_sums():
    mixer = based(chunk_size=4)
    x = torch.randn(2, 11, D_MODEL, dtype=torch.float64)
    state = mixer.init_state(2)
    with torch.no_grad():
        mixer(x, state)
        phi_k = taylor_feature_map((x @ mixer.k_proj.weight.T).reshape(2, 11, H, F_DIM))
        v = (x @ mixer.v_proj.weight.T).reshape(2, 11, H, -1)
    torch.testing.assert_close(state["kv"], torch.einsum("bthe,bthd->bhed", phi_k, v))
    torch.testing.assert_close(state["k_sum"], phi_k.sum(1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_state_is_fp32_for_low_precision_models(dtype):
    mixer = based().to(dtype)
    state = mixer.init_state(2)
    assert state["kv"].dtype == torch.float32 and state["k_sum"].dtype == torch.float32
    x = torch.randn(2, 6, D_MODEL, dtype=dtype)
    with torch.no_grad():
        y = mixer(x, state)
        y_t = mixer.step(x[:, 0], state)
    assert y.dtype == dtype and y_t.dtype == dtype
    assert state["kv"].dtype == torch.float32


def test_fp32_state_under_autocast_matches_fp32_run():
    mixer = based().float()
    x = torch.randn(2, 9, D_MODEL)
    state32, state_ac = mixer.init_state(2), mixer.init_state(2)
    with torch.no_grad():
        mixer(x, state32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixer(x, state_ac)
    assert state_ac["kv"].dtype == torch.float32
    # bf16 projections, fp32 sums: close to the fp32 run at bf16 input precision.
    torch.testing.assert_close(state_ac["kv"], state32["kv"], rtol=3e-2, atol=3e-2)


def _recurrent_kernel_stand_ins(calls: list):
    """Stand-ins for kernels.based.{chunk_based, fused_recurrent_based} with the agreed signatures: a plain
    token-by-token recurrence in fp64, written here, so the test checks the mixer's wiring, not the kernels."""

    def recurrence(q, k, v, kv, k_sum):  # q, k: [B, T, H, f], v: [B, T, H, dv]; kv, k_sum updated in place
        outs = []
        for t in range(q.shape[1]):
            phi_q, phi_k = taylor_feature_map(q[:, t].double()), taylor_feature_map(k[:, t].double())
            kv += torch.einsum("bhe,bhd->bhed", phi_k, v[:, t].double()).to(kv.dtype)
            k_sum += phi_k.to(k_sum.dtype)
            num = torch.einsum("bhe,bhed->bhd", phi_q, kv.double())
            outs.append(num / (torch.einsum("bhe,bhe->bh", phi_q, k_sum.double())[..., None] + 1e-6))
        return torch.stack(outs, dim=1)

    def chunk_based(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True):
        calls.append(("chunk_based", initial_state is not None, output_final_state))
        assert scale is None and normalize
        B, _, Hh, f = q.shape
        E = 1 + f + f * (f + 1) // 2
        if initial_state is None:
            kv, k_sum = q.new_zeros(B, Hh, E, v.shape[-1]), q.new_zeros(B, Hh, E)
        else:
            kv, k_sum = initial_state[0].clone(), initial_state[1].clone()
        o = recurrence(q, k, v, kv, k_sum).to(q.dtype)
        return o, ((kv, k_sum) if output_final_state else None)

    def fused_recurrent_based(q, k, v, state):
        calls.append(("fused_recurrent_based",))
        return recurrence(q[:, None], k[:, None], v[:, None], *state)[:, 0].to(q.dtype)

    return chunk_based, fused_recurrent_based


def test_triton_impl_wiring(monkeypatch):
    calls = []
    chunk_based, fused_recurrent_based = _recurrent_kernel_stand_ins(calls)
    monkeypatch.setattr(kernels.based, "chunk_based", chunk_based, raising=False)
    monkeypatch.setattr(kernels.based, "fused_recurrent_based", fused_recurrent_based, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    naive, fast = based(), based(impl="triton")
    x = torch.randn(2, 13, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        expected = naive(x)
        torch.testing.assert_close(fast(x), expected)
        state = fast.init_state(2)
        prefill = fast(x[:, :8], state)
        decoded = torch.stack([fast.step(x[:, t], state) for t in range(8, 13)], dim=1)
        torch.testing.assert_close(torch.cat([prefill, decoded], dim=1), expected)
        naive_state = naive.init_state(2)
        naive(x, naive_state)
    for key in ("kv", "k_sum"):
        torch.testing.assert_close(state[key], naive_state[key])
    assert calls[:2] == [("chunk_based", False, False), ("chunk_based", True, True)]
    assert calls[2:] == [("fused_recurrent_based",)] * 5


def test_triton_impl_without_kernels_raises(monkeypatch):
    monkeypatch.delattr(kernels.based, "chunk_based", raising=False)
    with pytest.raises(ImportError, match=r"kernels\.based\.chunk_based"):
        MIXERS["based"](D_MODEL, impl="triton")


def test_triton_impl_on_cpu_without_interpreter_raises(monkeypatch):
    chunk_based, fused_recurrent_based = _recurrent_kernel_stand_ins([])
    monkeypatch.setattr(kernels.based, "chunk_based", chunk_based, raising=False)
    monkeypatch.setattr(kernels.based, "fused_recurrent_based", fused_recurrent_based, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    mixer = MIXERS["based"](D_MODEL, impl="triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        mixer(torch.randn(1, 3, D_MODEL))


# Runs in a fresh interpreter: TRITON_INTERPRET must be set before triton is imported, and must not leak
# into the other tests of this process. IMPL is filled in per test.
INTERPRETED_SCRIPT = textwrap.dedent(
    """
    import os
    import torch
    from triton.runtime.autotuner import Autotuner
    from zoo.models.mixers import MIXERS

    # The interpreter cannot time kernels, so autotuned ops take their first config.
    Autotuner.prune_configs = lambda self, kwargs: self.configs[:1]

    torch.manual_seed(0)
    options = dict(feature_dim=4, num_heads=2, chunk_size=8)
    naive = MIXERS["based"](16, **options)
    fast = MIXERS["based"](16, impl=IMPL, **options)
    fast.load_state_dict(naive.state_dict())
    x = torch.randn(2, 33, 16)
    tol = dict(rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        expected = naive(x)
        torch.testing.assert_close(fast(x), expected, **tol)
        state, naive_state = fast.init_state(2), naive.init_state(2)
        naive(x, naive_state)
        parts = [fast(x[:, :20], state), fast(x[:, 20:30], state)]
        parts += [fast.step(x[:, t], state)[:, None] for t in range(30, 33)]
        torch.testing.assert_close(torch.cat(parts, dim=1), expected, **tol)
        for key in ("kv", "k_sum"):
            torch.testing.assert_close(state[key], naive_state[key], **tol)
        del os.environ["TRITON_INTERPRET"]
        try:
            fast(x)
        except RuntimeError as err:
            assert "TRITON_INTERPRET=1" in str(err), err
        else:
            raise AssertionError("a Triton impl on CPU without the interpreter did not raise")
    print("INTERPRETED-OK")
    """
)


@pytest.mark.parametrize("impl", ["fla", "triton"])
def test_fast_impl_matches_naive_under_triton_interpreter(impl):
    """Forward without state, chunked prefill + decode with state, and final states: fast impl == naive."""
    if impl == "fla" and importlib.util.find_spec("fla") is None:
        pytest.skip("flash-linear-attention is not installed")
    if impl == "triton" and not hasattr(kernels.based, "fused_recurrent_based"):
        pytest.skip("kernels.based has no chunk_based / fused_recurrent_based yet")
    script = f"IMPL = {impl!r}\n" + INTERPRETED_SCRIPT
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "INTERPRETED-OK" in result.stdout, result.stderr[-4000:]
