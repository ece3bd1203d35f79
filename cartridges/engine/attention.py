"""Cascade attention over a shared prefix, the batch cache that holds it once, and its registration.

transformers' `DynamicCache` appends with `torch.cat`, which turns a cartridge expanded over the batch into one
copy per sequence at the first decode step. For KV cartridges on Llama-family models the engine keeps instead a
`SharedPrefixCache`: the cartridge's keys and values once per layer (`[H, p, D]`) plus a preallocated
per-request suffix (`[B, H, S, D]`, the prompt and the generated tokens), and runs attention through a function
registered with transformers' `AttentionInterface`. It attends to the prefix with every query of the batch
folded into one matrix (the prefix is read once per step) and to each request's suffix separately, then merges
the two softmaxes with their log-sum-exp (cascade attention).
"""

import sys
from collections.abc import Callable

import torch

from cartridges.engine.errors import ServeError

# Model types whose attention modules call `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]` with the
# current keys and values `[B, H, T, D]` and pass the forward's extra keyword arguments through to it.
SHARED_PREFIX_MODEL_TYPES = ("llama",)
ATTENTION_NAME_PREFIX = "cartridges_cascade_"


def cascade_attention(
    query: torch.Tensor,
    prefix_keys: torch.Tensor | None,
    prefix_values: torch.Tensor | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """softmax(q·[Kp; Ks]ᵀ)·[Vp; Vs] without repeating the shared prefix per request.

    query `[B, Hq, T, D]`; prefix keys/values `[Hkv, p, D]` shared by the batch (None: no prefix); keys/values
    `[B, Hkv, S, D]` of each request; mask `[B, 1, T, S]` bool, True where a query may see a suffix key (every
    query sees the whole prefix). Grouped-query attention: Hq = G·Hkv. Returns `[B, T, Hq, D]`.

    Each part yields unnormalised outputs o, row maxima m and sums l; the merge rescales both to the common
    maximum, which equals one softmax over the concatenated keys. A query that sees nothing gives zeros.
    """
    return _cascade(query, prefix_keys, prefix_values, keys, values, ~mask[:, :, None], scaling)


def _cascade(query, prefix_keys, prefix_values, keys, values, blocked, scaling: float) -> torch.Tensor:
    """`cascade_attention` with the mask already inverted and shaped `[B, 1, 1, T, S]` (done once per step for
    every layer)."""
    batch, q_heads, steps, dim = query.shape
    kv_heads, size = keys.shape[1], keys.shape[2]
    groups = q_heads // kv_heads
    q = query.reshape(batch, kv_heads, groups * steps, dim)  # [B, Hkv, G·T, D]

    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scaling  # [B, Hkv, G·T, S]
    scores = scores.view(batch, kv_heads, groups, steps, size).masked_fill(blocked, float("-inf"))
    m_s = scores.amax(-1, keepdim=True)  # [B, Hkv, G, T, 1]
    # a query that sees no suffix key has m_s = -inf: subtract 0 instead, so its weights are exp(-inf) = 0
    weights = torch.exp(scores - m_s.nan_to_num(neginf=0.0))
    l_s = weights.sum(-1, keepdim=True)
    o_s = torch.matmul(weights.view(batch, kv_heads, groups * steps, size).to(values.dtype), values)
    o_s = o_s.float().view(batch, kv_heads, groups, steps, dim)  # [B, Hkv, G, T, D]

    if prefix_keys is None:
        out = o_s / l_s.clamp_min(torch.finfo(torch.float32).tiny)
    else:
        # The whole batch's queries as rows of one matrix per KV head: the prefix is read once, never expanded.
        rows = q.permute(1, 0, 2, 3).reshape(kv_heads, batch * groups * steps, dim)  # [Hkv, B·G·T, D]
        p_scores = torch.bmm(rows, prefix_keys.transpose(1, 2)).float() * scaling  # [Hkv, B·G·T, p]
        m_p = p_scores.amax(-1, keepdim=True)
        p_weights = torch.exp(p_scores - m_p)
        l_p = p_weights.sum(-1, keepdim=True)
        o_p = torch.bmm(p_weights.to(prefix_values.dtype), prefix_values).float()  # [Hkv, B·G·T, D]

        def unfold(t):  # [Hkv, B·G·T, X] -> [B, Hkv, G, T, X]
            return t.view(kv_heads, batch, groups, steps, -1).permute(1, 0, 2, 3, 4)

        m_p, l_p, o_p = unfold(m_p), unfold(l_p), unfold(o_p)
        m = torch.maximum(m_p, m_s)
        a, b = torch.exp(m_p - m), torch.exp(m_s - m)  # b is 0 where the suffix is fully masked
        out = (o_p * a + o_s * b) / (l_p * a + l_s * b)
    out = out.reshape(batch, q_heads, steps, dim)  # [B, Hq, T, D]
    return out.transpose(1, 2).to(query.dtype)  # [B, T, Hq, D]


class SharedPrefixCache:
    """A batch's KV: the prefix once per layer (shared by every request) and a suffix per request.

    prefix keys/values `[L, H, p, D]` (or None); the suffix buffers are `[L, B, H, capacity, D]`, written in place.
    Column c of a request holds its token c of the left-padded prompt, then its generated tokens; `valid[b, c]`
    is False at padding and at columns not written yet. Every step attends over all `capacity` columns (masked),
    and the next column to write lives on the device (`column`), so a decode step has fixed shapes and reads no
    host state: it can be captured as a CUDA graph and replayed.

    A step: `begin(valid_new)` (writes the new columns' flags, builds the mask; advances nothing), the model's
    forward (each layer calls `attend`), then `advance(T)` outside any captured region.
    """

    def __init__(
        self,
        prefix_keys: torch.Tensor | None,
        prefix_values: torch.Tensor | None,
        batch_size: int,
        capacity: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.prefix_keys, self.prefix_values = prefix_keys, prefix_values
        shape = (num_layers, batch_size, kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        # per-layer views, taken once: indexing the buffers in every layer of every step costs host time
        self._layer_keys, self._layer_values = self.keys.unbind(0), self.values.unbind(0)  # [B, H, capacity, D]
        self._prefix_keys = None if prefix_keys is None else prefix_keys.unbind(0)  # [H, p, D]
        self._prefix_values = None if prefix_values is None else prefix_values.unbind(0)
        self.valid = torch.zeros(batch_size, capacity, dtype=torch.bool, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)  # next column to write, [1]
        self.length = 0  # host copy of `column`, for bounds checks
        self._all_columns = torch.arange(capacity, device=device)
        self._new_columns: torch.Tensor | None = None  # [T] during a step
        self._blocked: torch.Tensor | None = None  # [B, 1, 1, T, capacity] during a step
        self.mask: torch.Tensor | None = None  # [B, 1, T, capacity] during a step

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    @property
    def prefix_length(self) -> int:
        return 0 if self.prefix_keys is None else self.prefix_keys.shape[2]

    def memory_bytes(self) -> int:
        """Bytes of KV held: the prefix once plus every request's suffix buffer."""
        prefix = 0 if self.prefix_keys is None else 2 * self.prefix_keys.numel() * self.prefix_keys.element_size()
        return prefix + 2 * self.keys.numel() * self.keys.element_size()

    def reset(self) -> None:
        """Empty the suffix for a new batch of the same shape (stale keys stay, masked: no memset)."""
        self.valid.zero_()
        self.column.zero_()
        self.length = 0

    def begin(self, valid_new: torch.Tensor) -> torch.Tensor:
        """Open a step of T new columns (`valid_new` `[B, T]`); returns the mask `[B, 1, T, capacity]`."""
        steps = valid_new.shape[1]
        if self.length + steps > self.capacity:
            raise ServeError(f"the batch needs more than its {self.capacity} preallocated positions")
        cols = self.column + torch.arange(steps, device=self.column.device)  # [T]
        self.valid.index_copy_(1, cols, valid_new)
        causal = self._all_columns[None, :] <= cols[:, None]  # [T, capacity]
        self.mask = causal[None, None] & self.valid[:, None, None, :]  # [B, 1, T, capacity]
        self._blocked = ~self.mask[:, :, None]
        self._new_columns = cols
        return self.mask

    def advance(self, steps: int) -> None:
        """Close a step of `steps` columns (not part of a captured step: replays must not move the counter)."""
        self.column += steps
        self.length += steps

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float):
        """Write this step's key/value `[B, H, T, D]` for `layer`, then attend to the prefix and the suffix."""
        keys, values = self._layer_keys[layer], self._layer_values[layer]  # [B, H, capacity, D]
        keys.index_copy_(2, self._new_columns, key)
        values.index_copy_(2, self._new_columns, value)
        prefix_k = None if self._prefix_keys is None else self._prefix_keys[layer]
        prefix_v = None if self._prefix_values is None else self._prefix_values[layer]
        return _cascade(query, prefix_k, prefix_v, keys, values, self._blocked, scaling)


def _attention_function(original: str) -> Callable:
    """The registered attention: cascade attention when the forward carries a `SharedPrefixCache`, else the
    model's original implementation (so the model keeps working for everything else)."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, shared_prefix=None, **kw):
        if shared_prefix is not None:
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return shared_prefix.attend(module.layer_idx, query, key, value, scale), None
        from transformers import AttentionInterface

        interface = AttentionInterface()
        if original in interface:
            fn = interface[original]
        else:  # eager lives in the model's own file
            fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            if fn is None:
                raise ServeError(f"cannot find the {original!r} attention of {type(module).__name__}")
        return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kw)

    return attention


def enable_shared_prefix(model) -> None:
    """Route `model`'s attention through cascade attention when a forward passes `shared_prefix=<cache>`.

    Registers `cartridges_cascade_<original>` with transformers' attention and mask interfaces (the mask
    function stays the original's) and switches the model's config to it. Calls without `shared_prefix` behave
    exactly as before. Idempotent.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    config = model.config
    current = config._attn_implementation or "eager"
    if current.startswith(ATTENTION_NAME_PREFIX):
        return
    if config.model_type not in SHARED_PREFIX_MODEL_TYPES or getattr(config, "sliding_window", None):
        raise ServeError(f"shared-prefix attention supports {SHARED_PREFIX_MODEL_TYPES} without sliding windows")
    name = ATTENTION_NAME_PREFIX + current
    AttentionInterface.register(name, _attention_function(current))
    if current in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
    config._attn_implementation = name


def supports_shared_prefix(model) -> bool:
    config = model.config
    return config.model_type in SHARED_PREFIX_MODEL_TYPES and not getattr(config, "sliding_window", None)
