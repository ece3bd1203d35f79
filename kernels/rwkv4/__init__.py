"""RWKV-4's WKV: the reference recurrence (naive.py, plain PyTorch) and a Triton form with its backward (wkv.py,
`wkv4`, imported from there so that importing the reference never imports Triton)."""
