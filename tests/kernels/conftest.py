"""Interpreted kernel tests as ordinary pytest items.

Triton runs kernels on CPU tensors only under TRITON_INTERPRET=1, which must be set before the kernels are defined,
so a pytest process that did not start with it cannot run them. The modules in INTERPRETED are collected as usual
(one item per case); in such a process their items are run once, together, in a child pytest with the variable set,
and each item passes or fails with its own case's result and report. Under pytest-xdist (make test) the worker
that first needs a module's results runs its child and leaves them in a file the other workers read, so each
module's child runs once per test run, not once per worker. Started with TRITON_INTERPRET=1 (e.g.
`TRITON_INTERPRET=1 pytest tests/kernels/test_based_interpreted.py`), they run in place.
"""

import fcntl
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from zoo.atomic import atomic_write_text

INTERPRETED = {"test_based_interpreted.py", "test_based_decode_interpreted.py", "test_rwkv4_interpreted.py",
               "test_selective_scan_interpreted.py", "test_packed_kernels_interpreted.py",
               "test_window_decode_interpreted.py", "test_conv_decode_interpreted.py"}
ROOT = Path(__file__).parents[2]
_RESULTS: dict = {}


def _child_results(item) -> dict:
    """{test name: (outcome, report)} of this module's selected items, run in a child process (once per test run:
    pytest-xdist workers share one child's results through a file, under a lock)."""
    key = str(item.path)
    if key not in _RESULTS:
        run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
        if run_id is None:
            _RESULTS[key] = _run_child(item, key)
        else:
            # beside the workers' own base temp dirs (<run's basetemp>/popen-gwN), which pytest rotates away
            shared = item.config._tmp_path_factory.getbasetemp().parent / f"interpreted-{run_id}"
            shared.mkdir(exist_ok=True)
            with open(shared / f"{item.path.name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # the other workers wait for the one running the child
                done = shared / f"{item.path.name}.json"
                if done.exists():
                    _RESULTS[key] = json.loads(done.read_text())
                else:
                    _RESULTS[key] = _run_child(item, key)
                    atomic_write_text(done, json.dumps(_RESULTS[key]))
    return _RESULTS[key]


def _run_child(item, key: str) -> dict:
    """The module's selected items run in a child pytest under TRITON_INTERPRET=1, read from its JUnit report."""
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
    return results


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
