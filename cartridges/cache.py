"""The Cartridge: p trainable virtual tokens of key/value cache per layer, for a frozen causal LM.

Keys and values are stored post-RoPE, as the model's own cache holds them: token j of the cartridge is a key
rotated for position j, and the queries that read the cartridge start at position p. The first `num_frozen`
tokens (default 1, the attention sink) are buffers; the rest are the only parameters, so
`torch.optim.Adam(cartridge.parameters())` trains exactly the trainable part.

At inference the cartridge is a prefix KV cache: `as_cache(batch_size)` returns a transformers `DynamicCache`
whose layers hold views of the cartridge expanded over the batch (no copy until the model appends to it), and
`generate(model, cartridge, input_ids)` continues from it.

On disk (`save` / `load`): the cartridge file format of `cartridges.format` (its one reader and writer), kind
"kv": tensors `layers.{l}.keys` / `layers.{l}.values`, each `[kv_heads, p, head_dim]`, and the JSON metadata
that `load` checks against the model. `load_cartridge` (from `cartridges.format`) loads any kind.
"""

import hashlib
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cartridges.format import (  # noqa: F401  (re-exported: the names every caller imports from here)
    FORMAT_VERSION,
    METADATA_KEY,
    ROPE_CONVENTION,
    CartridgeError,
    CartridgeFileError,
    CartridgeMismatchError,
    load_cartridge,
    read_cartridge_file,
    tensor_checksum,
    write_cartridge_file,
)


@dataclass
class ModelSignature:
    """What a cartridge must agree with in a model: identity, architecture and a sample of its weights."""

    model_id: str
    config_hash: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # 32 evenly spaced entries of the input embedding: tells apart models that share an architecture.
    weights_sample: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, model) -> "ModelSignature":
        from zoo.pretrained import config_fingerprint

        config = (
            model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        )
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return cls(
            model_id_of(model),
            config_fingerprint(config),
            config.num_hidden_layers,
            num_kv_heads,
            head_dim,
            weights_sample(model),
        )

    def mismatches(self, other: "ModelSignature", check_model_id: bool = True) -> list[str]:
        """Human-readable differences (empty when they agree); `self` is the cartridge's, `other` the model's."""
        out = []
        if check_model_id and self.model_id != other.model_id:
            out.append(f"model id {self.model_id!r} != {other.model_id!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) != getattr(other, name):
                out.append(f"{name} {getattr(self, name)} != {getattr(other, name)}")
        if self.config_hash != other.config_hash:
            out.append(f"config hash {self.config_hash[:12]} != {other.config_hash[:12]}")
        a, b = torch.tensor(self.weights_sample), torch.tensor(other.weights_sample)
        # Loose enough for the same weights loaded in another dtype (bf16/fp16), tight enough for other weights.
        if a.shape != b.shape or not torch.allclose(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().mean()) + 1e-8):
            out.append("the embedding weights differ (another checkpoint of the same architecture)")
        return out


def model_id_of(model) -> str:
    return getattr(model.config, "zoo_model_id", None) or model.config.name_or_path or "unknown"


def weights_sample(model) -> list[float]:
    """32 evenly spaced entries of the model's input embedding, as floats."""
    weight = model.get_input_embeddings().weight.detach().reshape(-1)
    # integer spacing: a float32 linspace rounds past the last index for large embeddings
    idx = (torch.arange(32) * (weight.numel() - 1) // 31).to(weight.device)
    return weight[idx].float().cpu().tolist()


@dataclass
class CartridgeInfo:
    """Provenance stored with a cartridge."""

    model: ModelSignature
    init_method: str = "unknown"
    corpus_hash: str = ""
    training_config: dict[str, Any] = field(default_factory=dict)


class Cartridge(nn.Module):
    """Per-layer keys and values `[num_layers, kv_heads, p, head_dim]`; the first `num_frozen` tokens frozen."""

    KIND = "kv"  # the file's `kind` field (`cartridges.format.KINDS`)

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, info: CartridgeInfo, num_frozen: int = 1):
        super().__init__()
        if keys.ndim != 4 or keys.shape != values.shape:
            raise CartridgeError(
                f"keys and values must both be [layers, kv_heads, p, head_dim], got {tuple(keys.shape)} "
                f"and {tuple(values.shape)}"
            )
        num_tokens = keys.shape[2]
        if num_tokens < 1:
            raise CartridgeError("a cartridge needs at least one token")
        if not 0 <= num_frozen <= num_tokens:
            raise CartridgeError(f"num_frozen must be in [0, {num_tokens}], got {num_frozen}")
        layers, heads, _, head_dim = keys.shape
        if (layers, heads, head_dim) != (info.model.num_layers, info.model.num_kv_heads, info.model.head_dim):
            raise CartridgeMismatchError(
                f"tensor shape {tuple(keys.shape)} does not fit the model (layers {info.model.num_layers}, "
                f"kv heads {info.model.num_kv_heads}, head dim {info.model.head_dim})"
            )
        self.info = info
        self.num_frozen = num_frozen
        self.register_buffer("frozen_keys", keys[:, :, :num_frozen].detach().clone())  # [L, H, f, D]
        self.register_buffer("frozen_values", values[:, :, :num_frozen].detach().clone())
        self.trainable_keys = nn.Parameter(keys[:, :, num_frozen:].detach().clone())  # [L, H, p - f, D]
        self.trainable_values = nn.Parameter(values[:, :, num_frozen:].detach().clone())

    @property
    def num_tokens(self) -> int:
        return self.frozen_keys.shape[2] + self.trainable_keys.shape[2]

    @property
    def num_layers(self) -> int:
        return self.frozen_keys.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.trainable_keys.dtype

    def keys(self) -> torch.Tensor:
        """All keys, `[L, H, p, D]`; differentiable in the trainable part."""
        return torch.cat([self.frozen_keys, self.trainable_keys], dim=2)

    def values(self) -> torch.Tensor:
        return torch.cat([self.frozen_values, self.trainable_values], dim=2)

    def memory_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of KV this cartridge occupies per sequence when served in `dtype` (default: its own)."""
        itemsize = torch.empty((), dtype=dtype or self.dtype).element_size()
        return (
            2 * self.num_layers * self.info.model.num_kv_heads * self.num_tokens * self.info.model.head_dim * itemsize
        )

    def extra_repr(self) -> str:
        m = self.info.model
        return (
            f"model={m.model_id!r}, tokens={self.num_tokens}, frozen={self.num_frozen}, layers={m.num_layers}, "
            f"kv_heads={m.num_kv_heads}, head_dim={m.head_dim}, init={self.info.init_method!r}"
        )

    def check_model(self, model, check_model_id: bool = True) -> None:
        problems = self.info.model.mismatches(ModelSignature.of(model), check_model_id=check_model_id)
        if problems:
            raise CartridgeMismatchError("cartridge does not fit this model: " + "; ".join(problems))

    def as_cache(self, batch_size: int = 1, dtype: torch.dtype | None = None, config=None):
        """A `DynamicCache` holding the cartridge for `batch_size` sequences: `[B, H, p, D]` views, no copies.

        Gradients flow through it into the trainable tokens. `dtype` casts (differentiably) to the model's dtype;
        `config` (the model's) lets transformers pick per-layer cache types.
        """
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        if batch_size < 1:
            raise CartridgeError(f"batch_size must be >= 1, got {batch_size}")
        keys, values = self.keys(), self.values()  # [L, H, p, D]
        if dtype is not None:
            keys, values = keys.to(dtype), values.to(dtype)
        cache = DynamicCache(config=config)
        if config is None:
            cache.layers = [DynamicLayer() for _ in range(self.num_layers)]
        if len(cache.layers) != self.num_layers:
            raise CartridgeMismatchError(
                f"the model's cache has {len(cache.layers)} layers, cartridge {self.num_layers}"
            )
        if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
            raise CartridgeError("models with sliding-window layers are not supported by cartridges yet")
        for layer_idx, layer in enumerate(cache.layers[: self.num_layers]):
            k = keys[layer_idx].unsqueeze(0).expand(batch_size, -1, -1, -1)  # [B, H, p, D]
            v = values[layer_idx].unsqueeze(0).expand(batch_size, -1, -1, -1)
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        return cache

    @classmethod
    def from_prefix(
        cls,
        model,
        input_ids: torch.Tensor,
        num_frozen: int = 1,
        dtype: torch.dtype = torch.float32,
        corpus_hash: str = "",
        init_method: str = "prefix",
    ) -> "Cartridge":
        """The model's own KV of `input_ids` (`[p]` or `[1, p]`): generation from it equals reading the prefix."""
        input_ids = prefix_ids(input_ids)
        device = next(model.parameters()).device
        with torch.no_grad():
            out = model(input_ids=input_ids[None].to(device), use_cache=True)
        # transformers 5 names the returned cache `cache`; earlier versions `past_key_values`
        returned = out["cache"] if "cache" in out else out["past_key_values"]
        layers = returned.layers
        keys = torch.stack([layer.keys[0] for layer in layers]).to(dtype)  # [L, H, p, D]
        values = torch.stack([layer.values[0] for layer in layers]).to(dtype)
        info = CartridgeInfo(ModelSignature.of(model), init_method=init_method, corpus_hash=corpus_hash)
        return cls(keys, values, info, num_frozen=num_frozen)

    @classmethod
    def random(
        cls,
        model,
        num_tokens: int,
        num_frozen: int = 1,
        sink_ids: torch.Tensor | None = None,
        std: float = 1.0,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> "Cartridge":
        """Random N(0, std²) keys and values, except the first `num_frozen` tokens: the model's KV of `sink_ids`
        (default: the BOS token, else token 0, repeated)."""
        if num_tokens < 1:
            raise CartridgeError(f"num_tokens must be >= 1, got {num_tokens}")
        sig = ModelSignature.of(model)
        shape = (sig.num_layers, sig.num_kv_heads, num_tokens, sig.head_dim)
        gen = torch.Generator().manual_seed(seed)
        keys = torch.randn(shape, generator=gen) * std
        values = torch.randn(shape, generator=gen) * std
        if num_frozen:
            if sink_ids is None:
                bos = getattr(model.config, "bos_token_id", None)
                sink_ids = torch.full((num_frozen,), bos if isinstance(bos, int) else 0, dtype=torch.long)
            if sink_ids.numel() != num_frozen:
                raise CartridgeError(f"sink_ids has {sink_ids.numel()} tokens, num_frozen is {num_frozen}")
            sink = cls.from_prefix(model, sink_ids.reshape(-1), num_frozen=num_frozen)
            keys[:, :, :num_frozen] = sink.keys().cpu()
            values[:, :, :num_frozen] = sink.values().cpu()
        info = CartridgeInfo(sig, init_method=f"random(std={std},seed={seed})")
        device = next(model.parameters()).device
        return cls(keys.to(device, dtype), values.to(device, dtype), info, num_frozen=num_frozen)

    @classmethod
    def concat(cls, cartridges: list["Cartridge"]) -> "Cartridge":
        """Compose cartridges by concatenating their tokens, without retraining (as in the paper).

        The result keeps the first cartridge's frozen tokens frozen; every other token (later sinks included)
        becomes trainable. Keys keep the rotation they were trained with.
        """
        if len(cartridges) < 1:
            raise CartridgeError("concat needs at least one cartridge")
        first = cartridges[0]
        for i, c in enumerate(cartridges[1:], start=1):
            problems = c.info.model.mismatches(first.info.model)
            if problems:
                raise CartridgeMismatchError(f"cartridge {i} was made for another model: " + "; ".join(problems))
        dtype, device = first.dtype, first.trainable_keys.device
        keys = torch.cat([c.keys().detach().to(device, dtype) for c in cartridges], dim=2)
        values = torch.cat([c.values().detach().to(device, dtype) for c in cartridges], dim=2)
        info = CartridgeInfo(
            model=first.info.model,
            init_method="concat(" + ", ".join(c.info.init_method for c in cartridges) + ")",
            corpus_hash=hashlib.sha256("|".join(c.info.corpus_hash for c in cartridges).encode()).hexdigest(),
            training_config={"concat": [c.info.training_config for c in cartridges]},
        )
        return cls(keys, values, info, num_frozen=first.num_frozen)

    def to_peft(self, model, adapter_name: str = "default"):
        """A PEFT `PeftModel` around `model` holding this cartridge as its CARTRIDGE adapter (`cartridges.peft`)."""
        from cartridges.peft import to_peft

        return to_peft(self, model, adapter_name)

    @classmethod
    def from_peft(cls, peft_model, adapter_name: str | None = None) -> "Cartridge":
        """The cartridge of a `PeftModel`'s CARTRIDGE adapter (the active one by default), fp32, on the adapter's
        device; its model signature is that of the wrapped base model (`cartridges.peft`)."""
        from cartridges.peft import read_peft_model

        sig = ModelSignature.of(peft_model.get_base_model())
        keys, values, frozen = read_peft_model(peft_model, sig.num_layers, sig.num_kv_heads, sig.head_dim, adapter_name)
        return cls(keys, values, CartridgeInfo(sig, init_method="peft"), num_frozen=frozen)

    @classmethod
    def from_peft_adapter(cls, directory: str | os.PathLike, model, device=None) -> "Cartridge":
        """The cartridge of a PEFT CARTRIDGE adapter directory, for `model` (not wrapped), on `device` (default:
        the model's)."""
        from cartridges.peft import read_adapter

        sig = ModelSignature.of(model)
        keys, values, frozen = read_adapter(directory, sig.num_layers, sig.num_kv_heads, sig.head_dim)
        device = device if device is not None else next(model.parameters()).device
        info = CartridgeInfo(sig, init_method=f"peft({Path(directory).name})")
        return cls(keys.to(device), values.to(device), info, num_frozen=frozen)

    def _tensors(self) -> dict[str, torch.Tensor]:
        keys, values = self.keys().detach().cpu(), self.values().detach().cpu()
        out = {}
        for layer in range(self.num_layers):
            out[f"layers.{layer}.keys"] = keys[layer].contiguous()  # [H, p, D]
            out[f"layers.{layer}.values"] = values[layer].contiguous()
        return out

    def save(self, path: str | os.PathLike) -> Path:
        """Write `path` atomically (temp file + rename): tensors + JSON metadata with a checksum of the data."""
        meta = {
            "model": asdict(self.info.model),
            "num_layers": self.num_layers,
            "num_kv_heads": self.info.model.num_kv_heads,
            "head_dim": self.info.model.head_dim,
            "num_tokens": self.num_tokens,
            "num_frozen": self.num_frozen,
            "dtype": str(self.dtype).removeprefix("torch."),
            "rope_convention": ROPE_CONVENTION,
            "init_method": self.info.init_method,
            "corpus_hash": self.info.corpus_hash,
            "training_config": self.info.training_config,
        }
        return write_cartridge_file(path, self.KIND, self._tensors(), meta)

    @classmethod
    def load(cls, path: str | os.PathLike, model, check_model_id: bool = True, device=None) -> "Cartridge":
        """Read a cartridge written by `save` and check it against `model`; never unpickles.

        Raises `CartridgeFileError` for a missing, truncated or corrupted file and `CartridgeMismatchError` when
        it was made for another model. The cartridge lands on `device` (default: the model's).
        """
        meta, tensors = read_cartridge_file(path, expected_kind=cls.KIND)
        return cls.from_file(path, meta, tensors, model, check_model_id, device)

    @classmethod
    def from_file(cls, path, meta: dict, tensors: dict, model, check_model_id: bool = True, device=None) -> "Cartridge":
        """The cartridge of an already read and checked file (`read_cartridge_file`); see `load`."""
        sig = ModelSignature(**meta["model"])
        num_layers, num_tokens = meta["num_layers"], meta["num_tokens"]
        try:
            keys = torch.stack([tensors[f"layers.{layer}.keys"] for layer in range(num_layers)])
            values = torch.stack([tensors[f"layers.{layer}.values"] for layer in range(num_layers)])
        except (KeyError, RuntimeError) as e:
            raise CartridgeFileError(f"{path}: tensors do not match the metadata ({e})") from None
        expected = (num_layers, meta["num_kv_heads"], num_tokens, meta["head_dim"])
        if tuple(keys.shape) != expected or tuple(values.shape) != expected:
            raise CartridgeFileError(f"{path}: tensor shape {tuple(keys.shape)} != metadata {expected}")
        problems = sig.mismatches(ModelSignature.of(model), check_model_id=check_model_id)
        if problems:
            raise CartridgeMismatchError(f"{path} was made for another model: " + "; ".join(problems))
        info = CartridgeInfo(sig, meta["init_method"], meta["corpus_hash"], meta["training_config"])
        device = device if device is not None else next(model.parameters()).device
        return cls(keys.to(device), values.to(device), info, num_frozen=meta["num_frozen"])


def prefix_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """A `from_prefix` argument, `[p]` or `[1, p]`, as `[p]`; anything else is a CartridgeError."""
    if input_ids.ndim == 2:
        if input_ids.shape[0] != 1:
            raise CartridgeError(f"from_prefix takes one sequence, got a batch of {input_ids.shape[0]}")
        input_ids = input_ids[0]
    if input_ids.ndim != 1 or input_ids.numel() == 0:
        raise CartridgeError(f"input_ids must be a non-empty [p] or [1, p] tensor, got {tuple(input_ids.shape)}")
    return input_ids


def generate(
    model, cartridge: Cartridge, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **generate_kwargs
):
    """`model.generate` continuing from the cartridge: returns what `model.generate(input_ids, ...)` returns.

    input_ids `[B, T]` (left-padded with `attention_mask` for a ragged batch). Internally the prompt is prefixed
    by p placeholder ids that the cache already covers, so positions start at p; they are stripped on return.
    Any kind of cartridge: a kind other than KV brings its own `generate` method (`StateCartridge.generate`).
    """
    if not isinstance(cartridge, Cartridge):
        return cartridge.generate(model, input_ids, attention_mask=attention_mask, **generate_kwargs)
    if input_ids.ndim != 2:
        raise CartridgeError(f"input_ids must be [batch, time], got {tuple(input_ids.shape)}")
    batch, p = input_ids.shape[0], cartridge.num_tokens
    device = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    cache = cartridge.as_cache(batch, dtype=model.dtype, config=model.config)
    placeholder = torch.zeros(batch, p, dtype=input_ids.dtype, device=device)
    full_ids = torch.cat([placeholder, input_ids], dim=1)
    full_mask = torch.cat([torch.ones(batch, p, dtype=attention_mask.dtype, device=device), attention_mask], dim=1)
    out = model.generate(input_ids=full_ids, attention_mask=full_mask, **cache_kwargs(model, cache), **generate_kwargs)
    if isinstance(out, torch.Tensor):
        return out[:, p:]
    out.sequences = out.sequences[:, p:]
    return out


def cache_kwargs(model, cache) -> dict[str, Any]:
    """The keyword that passes a cache to `model(...)` and `model.generate(...)`: `cache` in recent transformers
    (which deprecates `past_key_values`), `past_key_values` before."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}
