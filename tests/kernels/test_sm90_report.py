"""kernels.based.sm90_report compiles the Based forward for sm_90a without a GPU and reads ptxas's report."""

import os

import pytest
import triton

from kernels.based.sm90_report import compile_forward, ptxas_report

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


@pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "ptxas")), reason="Triton ships no ptxas here")
def test_forward_compiles_for_sm90_and_ptxas_reports_registers():
    kernel = compile_forward(mode=3, BV=32, BC=32, warps=4)
    ttgir = kernel.asm["ttgir"]
    assert "ttng.warp_group_dot" in ttgir  # the [pairs, BC] x [BC, BV] state update is a wgmma at M = 128
    report = ptxas_report(kernel.asm["ptx"])
    assert "registers" in report, report
    used = int(report.split("Used ")[1].split(" registers")[0])
    assert 0 < used <= 255
