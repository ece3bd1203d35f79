"""cartridges: trainable KV caches for frozen causal LMs, distilled by self-study.

Read first: cache.py (the Cartridge), format.py (the file format of every kind), state.py (the
StateCartridge: a trained initial state for recurrent and hybrid Zoo models), zoo/pretrained.py (loading
models without a hub), self_study.py, distill.py, eval.py; engine/ (serving) and http.py (its
OpenAI-compatible front). `cartridges.load_cartridge(path, model)` loads either kind;
`cartridges.generate(model, cartridge, input_ids, ...)` continues generation from either and returns what
`model.generate` would.

The names below are imported on first use, so `import cartridges.cli` (the commands' --help) stays light.
"""

import importlib

_EXPORTS = {
    "Cartridge": "cartridges.cache",
    "CartridgeError": "cartridges.cache",
    "CartridgeFileError": "cartridges.cache",
    "CartridgeMismatchError": "cartridges.cache",
    "generate": "cartridges.cache",
    "load_cartridge": "cartridges.cache",
    "load_model": "zoo.pretrained",
    "StateCartridge": "cartridges.state",
    "tiny_llama": "zoo.pretrained",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cartridges' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
