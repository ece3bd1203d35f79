"""FLA-backed mixers (gla, deltanet, gated_deltanet, rwkv): impl="fla" against impl="naive" under the Triton
interpreter, in a subprocess (TRITON_INTERPRET must be set before triton is imported)."""

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zoo.models.mixers import MIXERS

REPO = Path(__file__).resolve().parents[2]
FLA_MIXERS = ["gla", "deltanet", "gated_deltanet", "rwkv"]

SCRIPT = textwrap.dedent(
    """
    import torch
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.errors import InterpreterError
    from zoo.models.mixers import MIXERS

    # The interpreter cannot time kernels, so autotuned ops take their first config.
    Autotuner.prune_configs = lambda self, kwargs: self.configs[:1]

    tol = dict(rtol=1e-4, atol=1e-5)
    for name in NAMES:
        torch.manual_seed(0)
        naive = MIXERS[name](32, num_heads=2)
        fast = MIXERS[name](32, num_heads=2, impl="fla")
        fast.load_state_dict(naive.state_dict())
        x = torch.randn(2, 9, 32)
        with torch.no_grad():
            expected = naive(x)
            naive_state = naive.init_state(2)
            naive(x, naive_state)
            # Decode: FLA's fused recurrent op, one token per call, state in and out.
            state = fast.init_state(2)
            steps = torch.stack([fast.step(x[:, t], state) for t in range(9)], dim=1)
            torch.testing.assert_close(steps, expected, **tol)
            for key in naive_state:
                torch.testing.assert_close(state[key], naive_state[key], **tol)
            print(f"{name} STEP-OK")
            # Prefill: FLA's chunk op.
            try:
                full = fast(x)
            except (InterpreterError, AssertionError) as err:
                print(f"{name} CHUNK-SKIP", str(err).splitlines()[-1][:200])
            else:
                torch.testing.assert_close(full, expected, **tol)
                print(f"{name} CHUNK-OK")
    """
)


@pytest.fixture(scope="module")
def interpreted():
    """stdout lines of one subprocess that checks every FLA mixer (imports dominate its time)."""
    if importlib.util.find_spec("fla") is None:
        pytest.skip("flash-linear-attention is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", f"NAMES = {FLA_MIXERS!r}\n" + SCRIPT],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return result.returncode, result.stdout.splitlines(), result.stderr[-4000:]


@pytest.mark.parametrize("name", FLA_MIXERS)
def test_fla_fused_recurrent_matches_naive_under_triton_interpreter(name, interpreted):
    """Token-by-token decode through FLA's fused recurrent op: outputs and final state equal the naive loop."""
    _, lines, stderr = interpreted
    assert f"{name} STEP-OK" in lines, stderr


@pytest.mark.parametrize("name", FLA_MIXERS)
def test_fla_chunk_matches_naive_under_triton_interpreter(name, interpreted):
    """Parallel forward through FLA's chunk op; skipped where the op cannot run in the interpreter."""
    _, lines, stderr = interpreted
    if f"{name} CHUNK-OK" in lines:
        return
    skipped = [line for line in lines if line.startswith(f"{name} CHUNK-SKIP")]
    assert skipped, stderr
    pytest.skip(f"FLA's chunk op cannot run under TRITON_INTERPRET on CPU (check on the GPU): {skipped[0]}")


@pytest.mark.parametrize("name", FLA_MIXERS)
def test_fla_impl_on_cpu_without_interpreter_raises(name, monkeypatch):
    if importlib.util.find_spec("fla") is None:
        pytest.skip("flash-linear-attention is not installed")
    import torch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    mixer = MIXERS[name](16, impl="fla")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        mixer(torch.randn(1, 3, 16))
