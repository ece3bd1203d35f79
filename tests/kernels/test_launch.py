"""kernels/launch.py's plain-Python cdiv and next_power_of_2 equal Triton's."""

import triton

from kernels.launch import cdiv, next_power_of_2


def test_next_power_of_2_equals_tritons():
    for n in range(0, 70000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n


def test_cdiv_equals_tritons():
    for a in range(0, 700):
        for b in (1, 2, 3, 7, 16, 32, 64, 100, 128, 1024):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
