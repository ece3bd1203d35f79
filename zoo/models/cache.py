"""ZooCache: a LanguageModel's recurrent decode state as a transformers `Cache`, and the prefill that fills it.

The cache holds exactly what `LanguageModel.init_state` preallocates, one entry per layer: Based's kv
[B, H, E, d_v] and k_sum [B, H, E] in fp32 (kv in bf16 with the Based option state_dtype=bf16), the sliding
window's ring buffer of `window` tokens, BaseConv's last kernel_size-1 inputs. Nothing grows with the
generated length, and every update is in place, so the tensors keep their addresses from the first token to
the last (what a CUDA graph of the decode step needs).

Left padding. A padded prompt must not enter the recurrent states, and a Based or BaseConv state has no way
to mask a token once it is summed in. So `prefill` runs each group of rows with the same number of pad
tokens P as its own batch over its real tokens only, starting from a fresh state whose position is set to
P, and scatters the group's state into the batch's. Every row then ends at the same position T, so the
decode step stays one batched call with one shared position. The positional mixers (sliding window,
attention) get a per-row `start` = P that masks the ring slots or cache rows a row never wrote; rotary
angles are relative, so starting a row at P instead of 0 changes nothing else. A batch without padding is
one group: one batched prefill.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

from zoo.graphs import StaticGraph
from zoo.models.lm import LanguageModel


def _batched(key: str, tensor: torch.Tensor) -> bool:
    """State entries with a leading batch dim (all but the shared position `pos`)."""
    return key != "pos"


class ZooLayerState:
    """One layer's state in a ZooCache: the mixer's dict of tensors, or None for a stateless mixer.

    Duck-types the few methods transformers' `Cache` calls on its layers (reset, reordering for beams,
    batch selection); a recurrent state cannot be cropped, so `crop` accepts only 0.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, state: dict[str, torch.Tensor] | None) -> None:
        self.state = state

    def __repr__(self) -> str:
        keys = {} if self.state is None else {k: list(v.shape) for k, v in self.state.items()}
        return f"ZooLayerState({keys})"

    def _map(self, fn) -> None:
        if self.state is not None:
            for key, tensor in list(self.state.items()):
                if _batched(key, tensor):
                    self.state[key] = fn(tensor)

    def reset(self) -> None:
        if self.state is not None:
            for tensor in self.state.values():
                tensor.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices.to(t.device)])

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise RuntimeError("a recurrent ZooCache cannot be cropped: the states do not keep past tokens")

    def get_seq_length(self) -> int:
        raise NotImplementedError("ask the ZooCache, which counts tokens for all layers")

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:
        raise NotImplementedError("ZooCache does not offload: the states are small and fixed")

    prefetch = offload


class ZooCache(Cache):
    """Every layer's fixed-size state for a batch of `batch_size` sequences, plus the tokens seen so far.

    `states` is the list that `LanguageModel.hidden_states`/`step` continue in place. Positional mixers get
    a `start` [B] entry (see the module docstring). `nbytes()` is the memory held, constant during decoding.
    """

    def __init__(
        self,
        model: LanguageModel,
        batch_size: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        states = model.init_state(batch_size, device=device, dtype=dtype)
        for state in states:
            if state is not None and "pos" in state:
                state["start"] = torch.zeros(batch_size, device=state["pos"].device, dtype=torch.int64)
        super().__init__(layers=[ZooLayerState(s) for s in states])
        self.seen_tokens = 0
        self.decode_graph: Any = None  # a DecodeGraph once decoding runs through a CUDA graph

    @classmethod
    def from_states(cls, states: list[dict[str, torch.Tensor] | None], seen_tokens: int) -> ZooCache:
        """A cache over given per-layer states (e.g. a cartridge's copies) that already hold `seen_tokens` tokens.

        The states must have `init_state`'s keys and shapes; positional ones (with `pos`) also need `start` [B].
        """
        cache = cls.__new__(cls)
        Cache.__init__(cache, layers=[ZooLayerState(s) for s in states])
        cache.seen_tokens = seen_tokens
        cache.decode_graph = None
        return cache

    @property
    def states(self) -> list[dict[str, torch.Tensor] | None]:
        return [layer.state for layer in self.layers]

    def tensors(self) -> list[torch.Tensor]:
        return [t for s in self.states if s is not None for t in s.values()]

    def nbytes(self) -> int:
        """Bytes held by the state tensors (the whole batch)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        for tensor in self.tensors():
            if tensor.dim() > 0:
                return tensor.shape[0]
        return -1

    @property
    def is_compileable(self) -> bool:
        # transformers' own compiled decode would build 4D attention masks; the decode graph is ours (DecodeGraph).
        return False

    @property
    def is_linear(self) -> list[bool]:
        # Every layer is a fixed-size state: no layer tracks a key/value sequence length for transformers.
        return [True] * len(self.layers)

    @property
    def is_croppable(self) -> bool:
        return False

    def activate_past_recording(self) -> None:
        raise RuntimeError("a recurrent ZooCache cannot record past states for rollback")

    def reset(self) -> None:
        super().reset()
        self.seen_tokens = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.decode_graph = None  # the tensors moved

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.decode_graph = None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.decode_graph = None


def _left_pad_counts(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] 0/1 mask -> [B] number of leading pad tokens; raises unless each row is zeros then ones."""
    B, T = attention_mask.shape
    mask = attention_mask.to(torch.bool)
    pads = T - mask.sum(1)  # [B]
    expected = torch.arange(T, device=mask.device)[None, :] >= pads[:, None]  # [B, T]
    if not torch.equal(mask, expected):
        raise ValueError("attention_mask must be left-padded (each row: zeros, then ones); pad on the left")
    if int(pads.max()) >= T:
        raise ValueError("attention_mask has a row without any token")
    return pads


def prefill(
    model: LanguageModel,
    input_ids: torch.Tensor,
    cache: ZooCache,
    attention_mask: torch.Tensor | None = None,
    keep: int = 0,
    max_tokens: int = 0,
) -> torch.Tensor:
    """Run input_ids [B, T] into `cache`; return final hidden states [B, T, d_model] ([B, keep, d] if keep > 0).

    On a fresh cache, a left-padded attention_mask [B, T] is honoured as described in the module docstring
    (pad positions get zero hidden states). On a cache that already holds tokens, the new tokens must all be
    real (the mask's last T columns all ones). max_tokens > 0 runs the rows in slices of at most
    max(1, max_tokens // T) rows, so a large batch fits in memory; the result is the same.
    """
    B, T = input_ids.shape
    if attention_mask is not None and attention_mask.shape[1] != cache.seen_tokens + T:
        raise ValueError(
            f"attention_mask covers {attention_mask.shape[1]} tokens; the cache holds {cache.seen_tokens} and "
            f"{T} are new"
        )
    if cache.seen_tokens > 0 or attention_mask is None or bool(attention_mask[:, -T:].all()):
        if attention_mask is not None and not bool(attention_mask[:, -T:].all()):
            raise ValueError("padding after the first forward of a cache is not supported: pad prompts on the left")
        pads = torch.zeros(B, dtype=torch.long, device=input_ids.device)
    else:
        pads = _left_pad_counts(attention_mask)
    max_rows = B if max_tokens <= 0 else max(1, max_tokens // T)
    if max_rows >= B and not bool(pads.any()):
        # One batched call straight into the cache: the common case, and the one without copies.
        h = model.hidden_states(input_ids, cache.states)
        cache.seen_tokens += T
        return h[:, -keep:] if keep else h
    K = min(keep, T) if keep else T
    out = None
    for pad in sorted(set(pads.tolist())):
        for rows in (pads == pad).nonzero()[:, 0].split(max_rows):  # [G] each
            group = _group_state(cache.states, rows, pad, fresh=cache.seen_tokens == 0)
            h = model.hidden_states(input_ids[rows, pad:], group)  # [G, T - pad, d]
            if out is None:
                out = h.new_zeros(B, K, h.shape[-1])
            n = min(K, T - pad)  # kept positions that hold real tokens, right-aligned
            out[rows, K - n :] = h[:, h.shape[1] - n :]
            for full, part in zip(cache.states, group):
                for key, tensor in (full or {}).items():
                    if _batched(key, tensor):
                        tensor[rows] = part[key]
    # The shared position moves once: every row ends T tokens further on (a fresh padded row starts at its pad).
    for state in cache.states:
        if state is not None and "pos" in state:
            state["pos"].add_(T)
    cache.seen_tokens += T
    return out


def _group_state(states: list[Any], rows: torch.Tensor, pad: int, fresh: bool) -> list[Any]:
    """The states of `rows` as separate tensors: copies of the cache's, or, when fresh, zeros with positions
    (and per-row starts) at `pad`."""
    group = []
    for state in states:
        if state is None:
            group.append(None)
            continue
        if not fresh:
            group.append({k: (t[rows] if _batched(k, t) else t.clone()) for k, t in state.items()})
            continue
        part = {k: (torch.zeros_like(t[rows]) if _batched(k, t) else torch.zeros_like(t)) for k, t in state.items()}
        if "pos" in part:
            part["pos"].fill_(pad)
            part["start"].fill_(pad)
        group.append(part)
    return group


class DecodeGraph:
    """One decode step (`LanguageModel.step`) captured in a CUDA graph over a ZooCache's state tensors.

    The graph reads the token ids from a static buffer and updates the state in place; `__call__` copies the
    ids in, replays and returns a copy of the logits [B, vocab]. The capture's warm-up steps and its eager check
    (one replay compared with the first warm-up step, `zoo.graphs.GraphCheckError` on a mismatch) are undone
    (the state is restored from a snapshot), so capturing does not advance the real state.
    """

    def __init__(self, model: LanguageModel, cache: ZooCache) -> None:
        states = cache.states
        device = next(t.device for t in cache.tensors())
        if device.type != "cuda":
            raise ValueError(f"DecodeGraph needs CUDA tensors, got {device}")

        def snapshot() -> list:
            return [None if s is None else {k: t.clone() for k, t in s.items()} for s in states]

        @torch.no_grad()
        def restore(saved: list) -> None:
            for s, old in zip(states, saved):
                if s is not None:
                    for k, t in s.items():
                        t.copy_(old[k])

        ids = torch.zeros(cache.batch_size, dtype=torch.long, device=device)
        self.graph = StaticGraph(lambda ids: model.step(ids, states), (ids,), snapshot=snapshot, restore=restore,
                                 name="the decode step", check=True)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.graph(ids).clone()  # [B, vocab]
