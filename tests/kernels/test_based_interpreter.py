"""Runs interpreted_based.py in a fresh process with TRITON_INTERPRET=1 (the Triton kernels on the CPU).

The variable must be set before Triton's first import; in a pytest process that collected other modules, Triton
may already be imported without it, so the interpreted tests get a process of their own. Their report is
shown on failure.
"""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_triton_kernels_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(HERE.parents[1]),
         str(HERE / "interpreted_based.py")],
        env=env, cwd=HERE.parents[1], capture_output=True, text=True, timeout=900)
    report = proc.stdout[-20000:] + proc.stderr[-5000:]
    assert proc.returncode == 0, f"interpreted Based kernel tests failed:\n{report}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.split("\n")[-2], report
