"""The serving engine: requests checked alone, batched by cartridge set, decoded over one shared copy.

- `requests`: `GenerationRequest`, `Completion`, the checks a request passes before it joins a batch, sampling;
- `store`: the cartridge LRU (files read through `cartridges.format`);
- `attention`: cascade attention over a shared prefix and the batch cache that holds it once;
- `decoders`: chunked prefill and decode steps (CUDA-graph capture on the shared-prefix path);
- `server`: `Server` (the Python API) and `BatchRun` (one batch as a sequence of units);
- `scheduler`: the engine thread that interleaves running batches for the HTTP front (`cartridges.http`).
"""

from cartridges.engine.attention import SharedPrefixCache, cascade_attention, enable_shared_prefix
from cartridges.engine.errors import CartridgeNotFound, ServeError
from cartridges.engine.requests import Completion, GenerationRequest, Prepared
from cartridges.engine.scheduler import Scheduler
from cartridges.engine.server import BatchRun, Server
from cartridges.engine.store import CartridgeStore

__all__ = [
    "BatchRun",
    "CartridgeNotFound",
    "CartridgeStore",
    "Completion",
    "GenerationRequest",
    "Prepared",
    "Scheduler",
    "ServeError",
    "Server",
    "SharedPrefixCache",
    "cascade_attention",
    "enable_shared_prefix",
]
