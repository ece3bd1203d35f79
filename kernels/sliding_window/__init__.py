"""Sliding-window attention's decoding step as one Triton kernel (decode.py, `window_decode`); the reference is the
PyTorch step of `zoo.models.mixers.sliding_window` (impl="naive"), which the tests hold it against."""
