"""A cartridge without training: the context's KV compacted by attention matching.

After "Fast KV Compaction via Attention Matching" (Zweiger et al., 2026): for every layer and KV head, keep the p
keys that reference queries attend to most, and fit their values by least squares so that the compacted block's
attention output matches the full block's for those queries. Reference queries come from repeat-prefill: the model
reads the context, is asked to repeat it, and re-reads it as its own answer; the queries of that answer are the
kind of queries that later look things up in the context.

What differs from the paper, and why:
- The paper adds a scalar β_j to each kept key's attention logit, so that the compacted block keeps the full
  block's attention mass against the tokens that follow it. A cartridge is a plain KV prefix (our file format,
  PEFT's CARTRIDGE and every server read it as one), so here the bias rides in the keys: per head, the queries
  have a direction u on which every reference query projects to about 1 (a least-squares fit; how well it holds
  for SmolLM2 is in experiments/LOG.md), and adding β·u/scale to a key adds about β to its logit for every query.
  One β per head (fitted to the mass of the keys left out), not one per key.
- Keys are selected by highest attention (the paper's fast variant), not by orthogonal matching pursuit.
- Queries come from one pass over the full context (not recomputed layer by layer through the compacted layers).

Positions: the kept keys are rotated back by n − p positions (n the context's length), so a query at position p + i
reads key j at the same relative distance, n + i − j, as it does after the whole context in ICL. Each KV head keeps
its own p keys: a cartridge slot need not hold the same token in every head.
"""

from __future__ import annotations

import torch

from cartridges.cache import Cartridge, CartridgeError, CartridgeInfo, ModelSignature
from cartridges.corpus import turn_ids

REPEAT_PROMPT = "Repeat the document above, word for word."


def repeat_prefill_ids(tokenizer, document: str) -> list[int]:
    """The turns that follow the context in the reference pass: a request to repeat the document, and the document
    itself as the assistant's answer."""
    return turn_ids(tokenizer, [{"role": "user", "content": REPEAT_PROMPT}, {"role": "assistant", "content": document}])


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE's rotation in transformers' half-split convention: x [..., T, D], cos/sin [T, D]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _rotary(model):
    inner = getattr(model, "model", model)
    rotary = getattr(inner, "rotary_emb", None)
    layers = getattr(inner, "layers", None)
    if rotary is None or layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise CartridgeError(
            f"attention matching needs a decoder with rotary embeddings and per-layer self_attn modules "
            f"(Llama, Mistral, Qwen); got {type(model).__name__}"
        )
    return rotary, layers


def _cos_sin(rotary, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D] of the pure rotation at `positions` (float), without the embedding's attention scaling."""
    cos, sin = rotary(like, positions[None].to(like.device))
    scaling = float(getattr(rotary, "attention_scaling", 1.0))
    return cos[0].float() / scaling, sin[0].float() / scaling


@torch.no_grad()
def reference_pass(model, context_ids: list[int], reference_ids: list[int]):
    """One forward pass over context + reference tokens. Returns per layer (keys [Hkv, n, D], values [Hkv, n, D],
    queries [H, m, D]) in fp32: the context's post-RoPE KV and the reference tokens' post-RoPE queries."""
    rotary, layers = _rotary(model)
    n, m = len(context_ids), len(reference_ids)
    if n < 1 or m < 1:
        raise CartridgeError(f"attention matching needs a context and reference tokens, got {n} and {m}")
    device = next(model.parameters()).device
    captured: dict[int, torch.Tensor] = {}

    def capture(i):
        def hook(module, args, kwargs):
            h = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs.get("position_embeddings", args[1] if len(args) > 1 else (None, None))
            q = module.q_proj(h[:, n:])  # [1, m, H*D]
            D = module.head_dim
            q = q.view(1, m, -1, D).transpose(1, 2)  # [1, H, m, D]
            if hasattr(module, "q_norm"):
                q = module.q_norm(q)
            captured[i] = rotate(q[0].float(), cos[0, n:].float(), sin[0, n:].float())

        return hook

    handles = [layer.self_attn.register_forward_pre_hook(capture(i), with_kwargs=True) for i, layer in
               enumerate(layers)]
    try:
        ids = torch.tensor([list(context_ids) + list(reference_ids)], device=device)
        out = model(input_ids=ids, use_cache=True)
    finally:
        for handle in handles:
            handle.remove()
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    return [(layer.keys[0, :, :n].float(), layer.values[0, :, :n].float(), captured[i])
            for i, layer in enumerate(cache.layers)]


def compact_head(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, p: int, scaling: float,
                 num_frozen: int = 1, ridge: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One KV head: keys, values [n, D], queries [N, D] -> (indices [p] of the kept keys in context order, their
    new keys [p, D], their fitted values [p, D]).

    The first `num_frozen` keys are kept as they are. The rest are the keys with the largest root-mean-square
    attention weight over the queries; they share one logit bias β = log w, w ≥ 1 fitted so that the kept keys'
    attention mass matches the whole block's (relative least squares over the queries), carried by the keys as
    β·u/scaling with u the least-squares solution of queries·u = 1. Their values are the ridge least-squares fit of
    the block's attention output under the biased weights (the ridge, relative to the system's scale, pulls
    towards the keys' own values)."""
    n = keys.shape[0]
    if not 0 <= num_frozen <= p <= n:
        raise CartridgeError(f"need 0 <= num_frozen ({num_frozen}) <= p ({p}) <= context tokens ({n})")
    scores = (queries @ keys.T * scaling).double()  # [N, n]
    attn = scores.softmax(-1)
    target = attn @ values.double()  # [N, D]: the block's output
    importance = attn.square().mean(0).sqrt()
    importance[:num_frozen] = float("inf")
    kept = importance.topk(p).indices.sort().values
    new_keys, fitted = keys[kept].clone(), values[kept].clone()
    if p == num_frozen:
        return kept, new_keys, fitted
    top = scores.max(-1, keepdim=True).values  # masses relative to each query's largest logit
    mass = (scores - top).exp().sum(-1)  # [N]: the whole block's
    own = (scores[:, kept[:num_frozen]] - top).exp().sum(-1)  # the frozen keys'
    free = (scores[:, kept[num_frozen:]] - top).exp().sum(-1)  # the other kept keys'
    w = ((free * (mass - own) / mass.square()).sum() / (free.square() / mass.square()).sum()).clamp_min(1.0)
    beta = w.log()
    u = torch.linalg.lstsq(queries.double(), torch.ones(len(queries), 1, dtype=torch.float64)).solution[:, 0]
    new_keys[num_frozen:] += (beta * u / scaling).to(keys.dtype)
    biased = scores[:, kept].clone()
    biased[:, num_frozen:] += beta
    a = biased.softmax(-1)  # [N, p]: attention inside the compacted block
    frozen, rest = a[:, :num_frozen], a[:, num_frozen:]
    rhs = target - frozen @ values[kept[:num_frozen]].double()
    gram = rest.T @ rest  # the normal equations, in fp64
    lam = ridge * gram.diagonal().mean().clamp_min(1e-12)
    eye = torch.eye(p - num_frozen, dtype=gram.dtype, device=gram.device)
    own_values = values[kept[num_frozen:]].double()
    fitted[num_frozen:] = torch.linalg.solve(gram + lam * eye, rest.T @ rhs + lam * own_values).to(values.dtype)
    return kept, new_keys, fitted


@torch.no_grad()
def attention_matching(model, context_ids: list[int], num_tokens: int, reference_ids: list[int], *,
                       num_frozen: int = 1, ridge: float = 1e-3, dtype: torch.dtype = torch.float32,
                       corpus_hash: str = "") -> Cartridge:
    """A `num_tokens`-token cartridge of `context_ids` by attention matching (module docstring), from the queries
    of `reference_ids` read after the context (`repeat_prefill_ids`). With num_tokens = len(context_ids) it is the
    context's own KV: generation from it equals ICL."""
    n, p = len(context_ids), num_tokens
    if not 1 <= p <= n:
        raise CartridgeError(f"num_tokens must be in [1, {n}] (the context's tokens), got {p}")
    rotary, layers = _rotary(model)
    per_layer = reference_pass(model, context_ids, reference_ids)
    like = per_layer[0][0]
    cos, sin = _cos_sin(rotary, torch.tensor([float(p - n)]), like)  # rotate back by n - p positions
    keys_out, values_out = [], []
    for layer, (keys, values, queries) in zip(layers, per_layer):
        attn = layer.self_attn
        groups = queries.shape[0] // keys.shape[0]
        ks, vs = [], []
        for g in range(keys.shape[0]):
            q = queries[g * groups:(g + 1) * groups].reshape(-1, queries.shape[-1])
            _, new_keys, fitted = compact_head(keys[g], values[g], q, p, float(attn.scaling), num_frozen, ridge)
            ks.append(rotate(new_keys, cos, sin))
            vs.append(fitted)
        keys_out.append(torch.stack(ks))
        values_out.append(torch.stack(vs))
    info = CartridgeInfo(ModelSignature.of(model), init_method="attention_matching", corpus_hash=corpus_hash)
    return Cartridge(torch.stack(keys_out).to(dtype), torch.stack(values_out).to(dtype), info,
                     num_frozen=num_frozen)
