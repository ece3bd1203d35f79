"""cartridges: trainable KV caches for frozen causal LMs, distilled by self-study.

Read first: cache.py (the Cartridge), format.py (the file format of every kind), state.py (the
StateCartridge: a trained initial state for recurrent and hybrid Zoo models), models.py (loading without a
hub), self_study.py, distill.py, eval.py; engine/ (serving) and http.py (its OpenAI-compatible front).
`cartridges.load_cartridge(path, model)` loads either kind; `cartridges.generate(model, cartridge, input_ids,
...)` continues generation from either and returns what `model.generate` would.
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
from cartridges.state import StateCartridge

__all__ = [
    "Cartridge",
    "CartridgeError",
    "CartridgeFileError",
    "CartridgeMismatchError",
    "generate",
    "load_cartridge",
    "load_model",
    "StateCartridge",
    "tiny_llama",
]
