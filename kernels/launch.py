"""Host-side integer helpers for launch shapes and block sizes.

`triton.cdiv` and `triton.next_power_of_2` are Triton constexpr functions: called from Python each one unwraps its
arguments first, a few microseconds per call, and a Based forward+backward computes some forty such values. These
are the same functions in plain Python (equal on every non-negative int; tests/kernels/test_launch.py).
"""


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for ints, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ n (n itself for n ≤ 1, as `triton.next_power_of_2`)."""
    return n if n <= 1 else 1 << (n - 1).bit_length()
