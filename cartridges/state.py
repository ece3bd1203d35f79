"""StateCartridge: a cartridge for recurrent and hybrid Zoo models (`ZooForCausalLM`) is a trained initial state.

A Based hybrid summarises any prefix in a state of fixed size: Based's kv [H, E, d_v] and k_sum [H, E] (fp32
accumulators), the sliding window's ring buffer of post-rotary keys and values, BaseConv's last k-1 inputs.
So the "cache" of a corpus is that state after reading it, whatever the corpus length, and a cartridge is
that state made trainable: initialise it by prefilling the corpus (`from_prefix`; exact, the same logits as
the corpus in context), then distil it by self-study like a KV cartridge (`cartridges.distill`).

The cartridge holds exactly what `LanguageModel.init_state` holds, one sequence's worth, per layer:
- every floating tensor is an `nn.Parameter` (kept in fp32 by default), so `cartridge.parameters()` is the
  whole recurrent memory and nothing else;
- integer tensors (the positional layers' `pos`) are buffers: bookkeeping, never trained;
- a full-attention layer's KV buffer is stored for its live rows only ([p, H, D], post-rotary keys at positions
  0..p-1): a Zoo attention LM's state cartridge *is* its KV cartridge, and `memory_bytes` counts what it holds.

`num_tokens` is p, the number of tokens the state has read: the position the prompt continues from. It is
what the positional layers' `pos` holds, and what `as_cache` marks as seen, so a prompt after the cartridge
is numbered exactly as it would be after the corpus in context. A model without positional layers ignores
positions, but p still tells how much text the state stands for.

`as_cache(batch_size)` returns a `ZooCache` with one copy of the state per sequence (the model updates states
in place while decoding, so requests never share memory with the cartridge or each other). The copies are
differentiable: under `differentiable(cache)` (distill.py uses it) a loss on the model's outputs puts
gradients into the cartridge's parameters. On disk: the cartridge file format (cartridges/format.py) with
`kind` "state", tensors `layers.{l}.{name}` and a `layout` in the metadata that `load` checks against the model.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cartridges.cache import CartridgeInfo, ModelSignature, cache_kwargs, model_id_of, prefix_ids, weights_sample
from cartridges.format import (
    CartridgeError,
    CartridgeFileError,
    CartridgeMismatchError,
    read_cartridge_file,
    write_cartridge_file,
)

# Mixer options that choose a compute path, not the function computed: a cartridge moves freely between them.
IMPL_OPTIONS = ("impl", "chunk_size")
# Roles of the state entries (saved in the layout): `state` follows the serving dtype, `accumulator` is kept in
# at least fp32 (Based's sums), `bookkeeping` is an integer counter (never trained, not counted as memory).
STATE, ACCUMULATOR, BOOKKEEPING = "state", "accumulator", "bookkeeping"


def zoo_model(model):
    """The `ZooForCausalLM` itself; raises `CartridgeMismatchError` for any other model."""
    from zoo.models.hf import ZooForCausalLM

    if not isinstance(model, ZooForCausalLM):
        raise CartridgeMismatchError(
            f"state cartridges need a ZooForCausalLM, got {type(model).__name__} (use a KV Cartridge for it)"
        )
    return model


def config_hash(config) -> str:
    """sha256 of a ZooConfig's architecture (ModelConfig fields), ignoring mixer options that only pick a kernel."""
    fields = asdict(config.model_config())
    fields["mixers"] = {
        name: {k: v for k, v in opts.items() if k not in IMPL_OPTIONS} for name, opts in fields["mixers"].items()
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def state_signature(model) -> ModelSignature:
    """The ModelSignature of a Zoo model (no KV heads or head dim: those fields stay 0)."""
    model = zoo_model(model)
    return ModelSignature(
        model_id_of(model), config_hash(model.config), model.config.n_layers, 0, 0, weights_sample(model)
    )


def model_layout(model) -> list[dict[str, Any] | None]:
    """Per layer: the mixer, and per state entry its per-sequence shape and role; None for stateless layers.

    A full-attention layer's k/v shapes count rows from 0 (`rows` holds its buffer length, max_seq_len): the
    cartridge stores the live rows only.
    """
    lm = zoo_model(model).model
    # The dtype each entry gets for a bf16 model tells the accumulators (kept fp32) from the rest.
    probe = lm.init_state(1, device="meta", dtype=torch.bfloat16)
    layout = []
    for block, state in zip(lm.blocks, probe):
        if state is None:
            layout.append(None)
            continue
        entries = {}
        for key, t in state.items():
            if not t.is_floating_point():
                role = BOOKKEEPING
            else:
                role = STATE if t.dtype == torch.bfloat16 else ACCUMULATOR
            shape = list(t.shape[1:]) if role != BOOKKEEPING else list(t.shape)
            entries[key] = {"shape": shape, "role": role}
        spec: dict[str, Any] = {"mixer": block.mixer.name, "entries": entries}
        if block.mixer.name == "attention":
            spec["rows"] = entries["k"]["shape"][0]
            for key in ("k", "v"):
                entries[key]["shape"][0] = 0
        layout.append(spec)
    return layout


def _layout_problems(saved: list, current: list) -> list[str]:
    if len(saved) != len(current):
        return [f"{len(saved)} layers != {len(current)}"]
    out = []
    for i, (a, b) in enumerate(zip(saved, current)):
        if (a is None) != (b is None) or (a and (a["mixer"], a["entries"]) != (b["mixer"], b["entries"])):
            out.append(
                f"layer {i}: {a and a['mixer']} state {a and a['entries']} != {b and b['mixer']} {b and b['entries']}"
            )
    return out


class StateCartridge(nn.Module):
    """A trainable initial state of a ZooForCausalLM: every layer's recurrent state for one sequence."""

    KIND = "state"  # the file's `kind` field (`cartridges.format.KINDS`)

    def __init__(
        self, states: list[dict[str, torch.Tensor] | None], layout: list, info: CartridgeInfo, num_tokens: int
    ):
        """states: per layer, the entries of `layout` for one sequence (no batch dim; attention k/v [p, H, D])."""
        super().__init__()
        if len(states) != len(layout):
            raise CartridgeError(f"{len(states)} layer states for a layout of {len(layout)} layers")
        if num_tokens < 1:
            raise CartridgeError(f"a state cartridge must have read at least one token, got num_tokens={num_tokens}")
        self.info = info
        # Entries in name order, as the file's JSON stores them: parameter order (and optimizer state) survives a
        # save/load round trip.
        self.layout = [
            None
            if spec is None
            else {**copy.deepcopy(spec), "entries": dict(sorted(copy.deepcopy(spec["entries"]).items()))}
            for spec in layout
        ]
        layout = self.layout
        self._num_tokens = int(num_tokens)
        for layer, (state, spec) in enumerate(zip(states, layout)):
            if (state is None) != (spec is None):
                raise CartridgeError(f"layer {layer}: state and layout disagree on whether it holds a state")
            if spec is None:
                continue
            if set(state) != set(spec["entries"]):
                raise CartridgeError(f"layer {layer}: state entries {sorted(state)} != {sorted(spec['entries'])}")
            for key, entry in spec["entries"].items():
                t = state[key].detach()
                expected = list(entry["shape"])
                if spec["mixer"] == "attention" and key in ("k", "v"):
                    expected[0] = num_tokens
                if list(t.shape) != expected:
                    raise CartridgeMismatchError(
                        f"layer {layer} ({spec['mixer']}) {key}: shape {list(t.shape)}, the model needs {expected}"
                    )
                if entry["role"] == BOOKKEEPING:
                    self.register_buffer(self._name(layer, key), t.clone())
                else:
                    self.register_parameter(self._name(layer, key), nn.Parameter(t.clone()))
            if "pos" in state and int(state["pos"]) != num_tokens:
                raise CartridgeError(f"layer {layer}: pos {int(state['pos'])} != num_tokens {num_tokens}")

    @staticmethod
    def _name(layer: int, key: str) -> str:
        return f"layer{layer}_{key}"

    def tensor(self, layer: int, key: str) -> torch.Tensor:
        """Entry `key` of layer `layer` (a Parameter, or a buffer for bookkeeping)."""
        return getattr(self, self._name(layer, key))

    def entries(self):
        """(layer, key, spec entry) of every stored tensor, in layer order."""
        for layer, spec in enumerate(self.layout):
            for key, entry in (spec or {"entries": {}})["entries"].items():
                yield layer, key, entry

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_layers(self) -> int:
        return len(self.layout)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def _serving_dtype(self, entry: dict, dtype: torch.dtype | None) -> torch.dtype:
        dtype = dtype or self.dtype
        return torch.promote_types(torch.float32, dtype) if entry["role"] == ACCUMULATOR else dtype

    def memory_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of state per sequence when served in `dtype` (default: the cartridge's own); Based's accumulators
        count at fp32 or wider, as the model keeps them; integer counters are not counted."""
        total = 0
        for layer, key, entry in self.entries():
            if entry["role"] != BOOKKEEPING:
                itemsize = torch.empty((), dtype=self._serving_dtype(entry, dtype)).element_size()
                total += self.tensor(layer, key).numel() * itemsize
        return total

    def extra_repr(self) -> str:
        mixers = [spec["mixer"] if spec else "-" for spec in self.layout]
        return (
            f"model={self.info.model.model_id!r}, tokens={self.num_tokens}, layers={mixers}, "
            f"bytes={self.memory_bytes()}, init={self.info.init_method!r}"
        )

    def check_model(self, model, check_model_id: bool = True) -> None:
        problems = self.info.model.mismatches(state_signature(model), check_model_id=check_model_id)
        problems += _layout_problems(self.layout, model_layout(model))
        if problems:
            raise CartridgeMismatchError("cartridge does not fit this model: " + "; ".join(problems))

    def as_cache(self, batch_size: int = 1, dtype: torch.dtype | None = None, config=None):
        """A `ZooCache` holding a copy of the state for each of `batch_size` sequences, `num_tokens` tokens seen.

        `dtype`: the model's dtype (Based's accumulators stay fp32). `config` (the model's ZooConfig) is checked
        against the cartridge. The copies are differentiable functions of the parameters (see `differentiable`).
        """
        from zoo.models.cache import ZooCache

        if batch_size < 1:
            raise CartridgeError(f"batch_size must be >= 1, got {batch_size}")
        if config is not None and config_hash(config) != self.info.model.config_hash:
            raise CartridgeMismatchError("the model's config is not the one this state cartridge was made for")
        states: list[dict[str, torch.Tensor] | None] = []
        for spec_layer, spec in enumerate(self.layout):
            if spec is None:
                states.append(None)
                continue
            state = {}
            for key, entry in spec["entries"].items():
                t = self.tensor(spec_layer, key)
                if entry["role"] == BOOKKEEPING:
                    state[key] = t.clone()
                    continue
                t = t.to(self._serving_dtype(entry, dtype)).unsqueeze(0).expand(batch_size, *t.shape)  # [B, ...]
                if spec["mixer"] == "attention" and key in ("k", "v"):
                    # The model attends over a preallocated buffer of `rows` positions: the rest stays zero.
                    tail = t.new_zeros(batch_size, spec["rows"] - t.shape[1], *t.shape[2:])
                    state[key] = torch.cat([t, tail], dim=1)  # [B, rows, H, D]
                else:
                    # A copy per sequence: the model writes states in place, never into the cartridge.
                    state[key] = t.clone(memory_format=torch.contiguous_format)
            if "pos" in state:
                state["start"] = torch.zeros(batch_size, dtype=torch.int64, device=state["pos"].device)
            states.append(state)
        return ZooCache.from_states(states, seen_tokens=self.num_tokens)

    @classmethod
    def from_cache(
        cls, model, cache, row: int = 0, dtype: torch.dtype = torch.float32, init_method: str = "cache", **info
    ) -> StateCartridge:
        """Row `row` of a filled ZooCache of `model` as a cartridge (fp32 by default)."""
        layout = model_layout(model)
        states = []
        for spec, state in zip(layout, cache.states):
            if spec is None:
                states.append(None)
                continue
            out = {}
            for key, entry in spec["entries"].items():
                t = state[key]
                if entry["role"] == BOOKKEEPING:
                    out[key] = t.detach().clone()
                    continue
                t = t[row]
                if spec["mixer"] == "attention" and key in ("k", "v"):
                    t = t[: cache.seen_tokens]  # [p, H, D], the live rows
                out[key] = t.detach().to(dtype).clone()
            states.append(out)
        signature = state_signature(model)
        return cls(states, layout, CartridgeInfo(signature, init_method=init_method, **info), cache.seen_tokens)

    @classmethod
    def from_prefix(
        cls,
        model,
        input_ids: torch.Tensor,
        dtype: torch.dtype = torch.float32,
        corpus_hash: str = "",
        init_method: str = "prefix",
    ) -> StateCartridge:
        """The state after the model reads `input_ids` (`[p]` or `[1, p]`): continuing from it equals reading the
        prefix, logits and generations alike."""
        from zoo.models.cache import prefill

        model = zoo_model(model)
        input_ids = prefix_ids(input_ids)
        cache = model.make_cache(1)
        with torch.no_grad():
            ids = input_ids[None].to(model.device)
            prefill(model.model, ids, cache, keep=1, max_tokens=model.config.prefill_chunk_tokens)
        return cls.from_cache(model, cache, dtype=dtype, init_method=init_method, corpus_hash=corpus_hash)

    @classmethod
    def random(cls, model, num_tokens: int = 64, seed: int = 0, dtype: torch.dtype = torch.float32) -> StateCartridge:
        """The state after `num_tokens` uniformly random token ids (seeded): an uninformed start that is still a
        state the model can produce (a Gaussian Based k_sum could make its denominators vanish)."""
        if num_tokens < 1:
            raise CartridgeError(f"num_tokens must be >= 1, got {num_tokens}")
        model = zoo_model(model)
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, model.config.vocab_size, (num_tokens,), generator=gen)
        return cls.from_prefix(model, ids, dtype=dtype, init_method=f"random_tokens(n={num_tokens},seed={seed})")

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {
            f"layers.{layer}.{key}": self.tensor(layer, key).detach().cpu().contiguous()
            for layer, key, _ in self.entries()
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write `path` atomically: tensors + JSON metadata (kind "state", layout, model signature, checksum)."""
        meta = {
            "model": asdict(self.info.model),
            "num_layers": self.num_layers,
            "num_tokens": self.num_tokens,
            "layout": self.layout,
            "dtype": str(self.dtype).removeprefix("torch."),
            "init_method": self.info.init_method,
            "corpus_hash": self.info.corpus_hash,
            "training_config": self.info.training_config,
        }
        return write_cartridge_file(path, self.KIND, self._tensors(), meta)

    @classmethod
    def load(cls, path: str | os.PathLike, model, check_model_id: bool = True, device=None) -> StateCartridge:
        """Read a state cartridge written by `save` and check it against `model`; never unpickles.

        Raises `CartridgeFileError` for a missing, truncated or corrupted file and `CartridgeMismatchError` when
        it was made for another model. The cartridge lands on `device` (default: the model's).
        """
        meta, tensors = read_cartridge_file(path, expected_kind=cls.KIND)
        return cls.from_file(path, meta, tensors, model, check_model_id, device)

    @classmethod
    def from_file(
        cls, path, meta: dict, tensors: dict, model, check_model_id: bool = True, device=None
    ) -> StateCartridge:
        """The state cartridge of an already read and checked file (`read_cartridge_file`); see `load`."""
        signature = ModelSignature(**meta["model"])
        problems = signature.mismatches(state_signature(model), check_model_id=check_model_id)
        problems += _layout_problems(meta["layout"], model_layout(model))
        if problems:
            raise CartridgeMismatchError(f"{path} was made for another model: " + "; ".join(problems))
        device = device if device is not None else model.device
        states = []
        for layer, spec in enumerate(meta["layout"]):
            if spec is None:
                states.append(None)
                continue
            try:
                states.append({key: tensors[f"layers.{layer}.{key}"].to(device) for key in spec["entries"]})
            except KeyError as e:
                raise CartridgeFileError(f"{path}: tensor {e} named in the layout is missing") from None
        info = CartridgeInfo(signature, meta["init_method"], meta["corpus_hash"], meta["training_config"])
        try:
            return cls(states, meta["layout"], info, meta["num_tokens"])
        except CartridgeMismatchError as e:
            raise CartridgeFileError(f"{path}: tensors do not match the metadata ({e})") from None

    @torch.no_grad()
    def generate(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **generate_kwargs):
        """`model.generate` continuing from the state (what `cartridges.generate` calls for this kind).

        input_ids `[B, T]`, left-padded with `attention_mask` for a ragged batch. The prompt is prefixed by
        `num_tokens` placeholder ids that the cache marks as seen (stripped on return). A recurrent state cannot
        skip a pad token once summed in, and every row of a ZooCache shares one position, so a ragged batch runs
        one `generate` per number of pad tokens (rows with equal padding together) and reassembles the rows.
        Returns a tensor `[B, T + new]` (right-padded with the pad id where groups stop at different lengths), or
        generate's output object when the batch is not ragged.
        """
        model = zoo_model(model)
        if input_ids.ndim != 2:
            raise CartridgeError(f"input_ids must be [batch, time], got {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        pads = (T - attention_mask.to(torch.bool).sum(1)).tolist()
        groups: dict[int, list[int]] = {}
        for row, pad in enumerate(pads):
            groups.setdefault(int(pad), []).append(row)
        if len(groups) == 1:
            pad = next(iter(groups))
            out = self._generate_unpadded(model, input_ids[:, pad:], **generate_kwargs)
            sequences = out if isinstance(out, torch.Tensor) else out.sequences
            sequences = torch.cat([input_ids[:, :pad], sequences], dim=1)
            if isinstance(out, torch.Tensor):
                return sequences
            out.sequences = sequences
            return out
        if generate_kwargs.get("return_dict_in_generate"):
            raise CartridgeError(
                "return_dict_in_generate with a ragged batch is not supported for state cartridges: send rows with "
                "the same padding (or one row) per call"
            )
        pad_id = generate_kwargs.get("pad_token_id", model.generation_config.pad_token_id)
        pad_id = 0 if pad_id is None else int(pad_id)
        parts = {}
        for pad, rows in groups.items():
            seq = self._generate_unpadded(model, input_ids[rows, pad:], **generate_kwargs)
            parts[pad] = (rows, torch.cat([input_ids[rows, :pad], seq], dim=1))
        width = max(seq.shape[1] for _, seq in parts.values())
        out = input_ids.new_full((B, width), pad_id)
        for rows, seq in parts.values():
            out[rows, : seq.shape[1]] = seq
        return out

    def _generate_unpadded(self, model, input_ids: torch.Tensor, **generate_kwargs):
        B, p = input_ids.shape[0], self.num_tokens
        cache = self.as_cache(B, dtype=model.dtype, config=model.config)
        placeholder = input_ids.new_zeros(B, p)
        full_ids = torch.cat([placeholder, input_ids], dim=1)
        mask = torch.ones_like(full_ids)
        out = model.generate(input_ids=full_ids, attention_mask=mask, **cache_kwargs(model, cache), **generate_kwargs)
        if isinstance(out, torch.Tensor):
            return out[:, p:]
        out.sequences = out.sequences[:, p:]
        return out


@contextlib.contextmanager
def differentiable(cache):
    """Let backward run through a model forward that continues `cache` (from `StateCartridge.as_cache`).

    The mixers update their states in place after reading them (Based: `kv.copy_(...)`), which autograd rejects
    when the state is a function of parameters: the tensor it saved for backward changed. Inside this context,
    every tensor saved for backward that shares memory with one of the cache's floating states is saved as a
    copy, taken before the update, so gradients reach the cartridge. Other saved tensors are untouched.
    """
    storages = {t.untyped_storage().data_ptr() for t in cache.tensors() if t.is_floating_point()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if t.untyped_storage().data_ptr() in storages else t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield cache

