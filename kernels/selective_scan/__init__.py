"""Mamba's selective scan: the reference loop (naive.py) and a Triton form with its backward (scan.py)."""

from kernels.selective_scan.naive import selective_scan_naive
from kernels.selective_scan.scan import CHUNK, selective_scan

__all__ = ["CHUNK", "selective_scan", "selective_scan_naive"]
