"""Interpreted kernel tests as ordinary pytest items.

Triton runs kernels on CPU tensors only under TRITON_INTERPRET=1, which must be set before the kernels are defined,
so a pytest process that did not start with it cannot run them. The modules in INTERPRETED are collected as usual
(one item per case); in such a process their items are run once, together, in a child pytest with the variable set,
and each item passes or fails with its own case's result and report. Started with TRITON_INTERPRET=1 (e.g.
`TRITON_INTERPRET=1 pytest tests/kernels/test_based_interpreted.py`), they run in place.
"""

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

INTERPRETED = {"test_based_interpreted.py", "test_based_decode_interpreted.py", "test_rwkv4_interpreted.py",
               "test_selective_scan_interpreted.py", "test_packed_kernels_interpreted.py",
               "test_window_decode_interpreted.py", "test_conv_decode_interpreted.py"}
ROOT = Path(__file__).parents[2]
_RESULTS: dict = {}


def _child_results(item) -> dict:
    """{test name: (outcome, report)} of this module's selected items, run in a child process (once per test run)."""
    key = str(item.path)
    if key not in _RESULTS:
        ids = [i.nodeid for i in item.session.items if str(i.path) == key]
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        with tempfile.TemporaryDirectory() as d:
            xml = os.path.join(d, "report.xml")
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
                                   str(ROOT), f"--junitxml={xml}", *ids], env=env, cwd=ROOT, capture_output=True,
                                  text=True, timeout=1800)
            results = {}
            if os.path.exists(xml):
                for case in ET.parse(xml).getroot().iter("testcase"):
                    outcome, text = "passed", ""
                    for tag in ("failure", "error", "skipped"):
                        node = case.find(tag)
                        if node is not None:
                            outcome, text = tag, (node.get("message") or "") + "\n" + (node.text or "")
                    results[case.get("name")] = (outcome, text)
            results["<process>"] = ("failure", proc.stdout[-8000:] + proc.stderr[-4000:])
        _RESULTS[key] = results
    return _RESULTS[key]


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.path.name not in INTERPRETED or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    results = _child_results(pyfuncitem)
    outcome, text = results.get(pyfuncitem.name, results["<process>"])
    if outcome == "passed":
        return True
    if outcome == "skipped":
        pytest.skip(text.strip().splitlines()[0] if text.strip() else "skipped under TRITON_INTERPRET=1")
    raise AssertionError(f"{pyfuncitem.name} under TRITON_INTERPRET=1 ({outcome}):\n{text}")
