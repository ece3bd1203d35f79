"""Attention-matching compaction (cartridges/compact.py) on a tiny random Llama."""

import pytest
import torch

from cartridges.cache import Cartridge, CartridgeError, cache_kwargs
from cartridges.compact import _cos_sin, _rotary, attention_matching, compact_head, reference_pass, rotate
from zoo.pretrained import tiny_llama

N, M = 32, 24  # context and reference tokens


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def ids():
    gen = torch.Generator().manual_seed(3)
    return torch.randint(3, 259, (N + M,), generator=gen).tolist()


def logits_after(model, cartridge, tokens):
    cache = cartridge.as_cache(1, config=model.config)
    return model(input_ids=torch.tensor([tokens]), **cache_kwargs(model, cache)).logits[0].float()


def kl(p_logits, q_logits):
    p = p_logits.log_softmax(-1)
    return (p.exp() * (p - q_logits.log_softmax(-1))).sum(-1).mean().item()


def test_keeping_every_token_is_the_context_itself(model, ids):
    context, reference = ids[:N], ids[N:]
    am = attention_matching(model, context, N, reference)
    icl = Cartridge.from_prefix(model, torch.tensor(context))
    torch.testing.assert_close(am.keys(), icl.keys(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(am.values(), icl.values(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits_after(model, am, reference), logits_after(model, icl, reference),
                               rtol=1e-4, atol=1e-4)


def test_rotating_back_equals_the_key_at_the_earlier_position(model, ids):
    """Layer 0's key of a token depends on the token and its position only: rotating the key made at position j
    back by s positions must give the key the model makes at position j - s."""
    context = torch.tensor([ids[:N]])
    shift = 11
    ref = model(input_ids=context, use_cache=True)
    moved = model(input_ids=context, position_ids=torch.arange(N)[None] + 100 - shift, use_cache=True)
    far = model(input_ids=context, position_ids=torch.arange(N)[None] + 100, use_cache=True)
    del ref
    rotary, _ = _rotary(model)
    keys_far = (far["cache"] if "cache" in far else far["past_key_values"]).layers[0].keys[0].float()
    keys_moved = (moved["cache"] if "cache" in moved else moved["past_key_values"]).layers[0].keys[0].float()
    cos, sin = _cos_sin(rotary, torch.tensor([float(-shift)]), keys_far)
    torch.testing.assert_close(rotate(keys_far, cos, sin), keys_moved, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(keys_far, keys_moved, atol=1e-3)


def test_fit_matches_the_block_better_than_its_first_keys(model, ids):
    keys, values, queries = reference_pass(model, ids[:N], ids[N:])[1]
    k, v, q = keys[0], values[0], queries[:2].reshape(-1, keys.shape[-1])
    scale = k.shape[-1] ** -0.5
    target = (q @ k.T * scale).softmax(-1) @ v
    p = 8
    kept, new_keys, fitted = compact_head(k, v, q, p, scale)
    assert kept[0] == 0 and kept.tolist() == sorted(kept.tolist()) and len(set(kept.tolist())) == p
    am = (q @ new_keys.T * scale).softmax(-1) @ fitted
    first = (q @ k[:p].T * scale).softmax(-1) @ v[:p]
    err_am, err_first = (am - target).norm() / target.norm(), (first - target).norm() / target.norm()
    assert err_am < 0.5 * err_first, (err_am, err_first)
    torch.testing.assert_close(fitted[0], v[0])  # the frozen sink keeps its own value


def test_compacted_cartridge_is_closer_to_icl_than_truncation(model, ids):
    context, reference = ids[:N], ids[N:]
    p = N // 4
    full = logits_after(model, Cartridge.from_prefix(model, torch.tensor(context)), reference)
    am = logits_after(model, attention_matching(model, context, p, reference), reference)
    truncated = logits_after(model, Cartridge.from_prefix(model, torch.tensor(context[:p])), reference)
    assert kl(full, am) < kl(full, truncated), (kl(full, am), kl(full, truncated))


@pytest.mark.parametrize("p", [0, N + 1])
def test_sizes_outside_the_context_are_refused(model, ids, p):
    with pytest.raises(CartridgeError, match="num_tokens"):
        attention_matching(model, ids[:N], p, ids[N:])


def test_distill_can_start_from_the_compacted_context(tmp_path):
    from cartridges.compact import repeat_prefill_ids
    from cartridges.config import load_config
    from cartridges.corpus import Corpus, context_ids
    from cartridges.init import init_cartridge
    from zoo.pretrained import load_model

    model, tokenizer = load_model("tiny-llama")
    doc = tmp_path / "doc.md"
    doc.write_text("The ferry Marrow Lark crosses the Pell estuary four times a day since 1904. " * 4)
    cfg, _ = load_config("distill", ["model=tiny-llama", f"corpus.path={doc}", "method=ntp", "num_tokens=12",
                                     "corpus.min_tokens=32", "corpus.max_tokens=64", f"output={tmp_path / 'out'}",
                                     "init=attention_matching"])
    corpus = Corpus.from_path(doc, tokenizer, cfg.corpus.min_tokens, cfg.corpus.max_tokens, cfg.corpus.text_field)
    start = init_cartridge(cfg, model, tokenizer, corpus, torch.device("cpu"))
    text = corpus.full_text()
    expected = attention_matching(model, context_ids(tokenizer, text), 12, repeat_prefill_ids(tokenizer, text))
    assert start.info.init_method == "attention_matching" and start.num_frozen == 1
    assert start.keys().equal(expected.keys()) and start.values().equal(expected.values())


def test_the_shared_bias_restores_the_blocks_attention_mass():
    """Queries that share a direction (as a trained model's do) let the kept keys carry the left-out keys' mass:
    the compacted block's total attention weight per query comes far closer to the whole block's than the same
    keys unbiased, and the frozen sink is untouched."""
    gen = torch.Generator().manual_seed(0)
    D, n, p = 16, 64, 16
    common = torch.randn(D, generator=gen)
    q = 0.5 * common + 0.1 * torch.randn(200, D, generator=gen)
    k, v = torch.randn(n, D, generator=gen), torch.randn(n, D, generator=gen)
    scale = D**-0.5
    kept, new_keys, _ = compact_head(k, v, q, p, scale)
    mass = (q @ k.T * scale).exp().sum(-1)
    plain = (q @ k[kept].T * scale).exp().sum(-1)
    biased = (q @ new_keys.T * scale).exp().sum(-1)
    assert ((biased - mass).abs() / mass).mean() < 0.25 * ((plain - mass).abs() / mass).mean()
    assert new_keys[0].equal(k[0])


def test_queries_after_the_cartridge_read_it_at_icl_distances(model, ids):
    """Layer 0's queries depend on the token and its position only. A reference token read at position p + i after
    the cartridge must score each kept key as the same token at position n + i scores it after the whole context."""
    context, reference = ids[:N], ids[N:]
    p = N // 4
    cartridge = attention_matching(model, context, p, reference)
    rotary, layers = _rotary(model)
    attn = layers[0].self_attn
    h = layers[0].input_layernorm(model.model.embed_tokens(torch.tensor(reference)))  # [M, hidden]
    q = attn.q_proj(h).view(M, -1, attn.head_dim).transpose(0, 1).float()  # [H, M, D]

    def queries_at(start):
        cos, sin = _cos_sin(rotary, torch.arange(start, start + M, dtype=torch.float32), q)
        return rotate(q, cos, sin)

    keys, values, ref_queries = reference_pass(model, context, reference)[0]
    torch.testing.assert_close(queries_at(N), ref_queries, rtol=1e-4, atol=1e-4)
    groups = q.shape[0] // keys.shape[0]
    for g in range(keys.shape[0]):
        qs = ref_queries[g * groups:(g + 1) * groups].reshape(-1, keys.shape[-1])
        _, new_keys, _ = compact_head(keys[g], values[g], qs, p, float(attn.scaling))
        after = queries_at(p)[g * groups:(g + 1) * groups] @ cartridge.keys()[0, g].T
        torch.testing.assert_close(after, queries_at(N)[g * groups:(g + 1) * groups] @ new_keys.T,
                                   rtol=1e-3, atol=1e-3)


def test_distill_can_start_from_the_truncated_context(tmp_path):
    """init=truncated_context: the cartridge is the model's KV of the truncated-context baseline's own ids (a closed
    message of at most p tokens), where first_tokens holds the context's first p ids, cut mid-document."""
    from cartridges.config import load_config
    from cartridges.corpus import Corpus, context_ids
    from cartridges.eval import truncated_context
    from cartridges.init import init_cartridge, init_ids
    from zoo.pretrained import load_model

    model, tokenizer = load_model("tiny-llama")
    doc = tmp_path / "doc.md"
    doc.write_text("The ferry Marrow Lark crosses the Pell estuary four times a day since 1904. " * 4)
    overrides = ["model=tiny-llama", f"corpus.path={doc}", "method=ntp", "num_tokens=80", "corpus.min_tokens=32",
                 "corpus.max_tokens=64", f"output={tmp_path / 'out'}"]
    cfg, _ = load_config("distill", [*overrides, "init=truncated_context"])
    corpus = Corpus.from_path(doc, tokenizer, cfg.corpus.min_tokens, cfg.corpus.max_tokens, cfg.corpus.text_field)
    ids = truncated_context(tokenizer, corpus, 80)
    assert init_ids(cfg, tokenizer, corpus) == ids and len(ids) <= 80
    first, _ = load_config("distill", [*overrides, "init=first_tokens"])
    assert init_ids(first, tokenizer, corpus) == context_ids(tokenizer, corpus.full_text())[:80] != ids
    start = init_cartridge(cfg, model, tokenizer, corpus, torch.device("cpu"))
    assert start.info.init_method == "truncated_context" and start.num_tokens == len(ids)
