"""cartridges: trainable KV caches for frozen causal LMs, distilled by self-study.

Read first: cache.py (the Cartridge and its file format), models.py (loading without a hub), self_study.py,
distill.py, eval.py. `cartridges.generate(model, cartridge, input_ids, ...)` continues generation from a
cartridge and returns what `model.generate` would.
"""

from cartridges.cache import (
    Cartridge,
    CartridgeError,
    CartridgeFileError,
    CartridgeMismatchError,
    generate,
    load_cartridge,
)
from cartridges.models import load_model, tiny_llama

__all__ = [
    "Cartridge",
    "CartridgeError",
    "CartridgeFileError",
    "CartridgeMismatchError",
    "generate",
    "load_cartridge",
    "load_model",
    "tiny_llama",
]
