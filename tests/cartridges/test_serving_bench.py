"""experiments/bench/serving.py prints a throughput ratio only over baselines that finished their batch sweep."""

import json

import pytest

from experiments.bench import serving


def best_rows(**tokens_per_s):
    return {arm: {"arm": arm, "tokens_per_s": value} for arm, value in tokens_per_s.items()}


ARMS = ["cartridge", "icl_static", "icl_dynamic", "icl_shared"]
CASES = {
    "all-finished": ({}, {"ratio_cartridge_vs_icl": 10.0, "ratio_cartridge_vs_shared_prefix": 2.0}),
    "icl-static-stopped-by-the-budget": (
        {"icl_static": "stopped by the time budget before batch 64"},
        {"ratio_cartridge_vs_icl": None, "ratio_cartridge_vs_shared_prefix": 2.0},
    ),
    "shared-prefix-failed": (
        {"icl_shared": "an error at batch 16"},
        {"ratio_cartridge_vs_icl": 10.0, "ratio_cartridge_vs_shared_prefix": None},
    ),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_a_ratio_needs_every_baseline_of_it_finished(case):
    unfinished, expected = CASES[case]
    found, withheld = serving.ratios(
        best_rows(cartridge=1000.0, icl_static=100.0, icl_dynamic=50.0, icl_shared=500.0), unfinished, ARMS
    )
    assert {k: None if v is None else round(v[0], 6) for k, v in found.items()} == expected
    for name, value in expected.items():
        assert (name in withheld) == (value is None)
        if value is None:
            assert next(iter(unfinished)) in withheld[name] and "did not finish" in withheld[name]


def test_the_bench_prints_no_ratio_over_an_unfinished_sweep(capsys):
    """A CPU run whose time budget ends every sweep before its first batch: no ratio line, null ratios."""
    serving.main(["--tiny", "--device", "cpu", "--batches", "1", "--budget-s", "0"])
    out = capsys.readouterr().out
    assert "x throughput" not in out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["ratio_cartridge_vs_icl"] is None and result["ratio_cartridge_vs_shared_prefix"] is None
    assert "icl_static did not finish its sweep" in result["ratio_withheld"]["ratio_cartridge_vs_icl"]
    assert "icl_shared did not finish its sweep" in result["ratio_withheld"]["ratio_cartridge_vs_shared_prefix"]
