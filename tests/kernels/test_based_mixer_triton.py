"""Based(impl="triton") against Based(impl="naive") with the same weights: forward, prefill with a state, decode.

On the CPU this check runs under the Triton interpreter in interpreted_based.py (launched by
test_based_interpreter.py); here it runs on a CUDA GPU (skipped without one).
"""

import pytest
import torch
from based_cases import check_mixer_triton_vs_naive


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mixer_triton_matches_naive_gpu():
    check_mixer_triton_vs_naive("cuda", torch.float32, T=1000)
