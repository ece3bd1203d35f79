"""BaseConv's decoding step as one Triton kernel (decode.py, `conv_decode`); the reference is the PyTorch step of
`zoo.models.mixers.base_conv` (impl="naive"), which the tests hold it against."""
