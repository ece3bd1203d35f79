"""experiments/bench/generation.py's summary fields, on made-up rows."""

from experiments.bench.generation import prefill_ratio_per_seq


def test_prefill_at_the_best_batches_compares_time_per_sequence():
    based = {"batch": 1024, "prefill_ms": 4096.0}  # 4 ms a sequence
    llama = {"batch": 128, "prefill_ms": 1024.0}  # 8 ms a sequence
    assert prefill_ratio_per_seq(based, llama) == 2.0
    assert prefill_ratio_per_seq(None, llama) is None
