"""Where a cartridge starts training (`DistillConfig.init`).

- `first_tokens`: the model's KV of the first p tokens of the corpus in context (chat header, then the
  document's start). The paper's best initialisation.
- `truncated_context`: the model's KV of the truncated-context baseline itself (`cartridges.eval.truncated_context`):
  the document's start as a closed user message of at most p tokens, where `first_tokens` stops mid-document, so a
  trained cartridge starts exactly at the baseline it is compared with.
- `corpus_tokens`: the same chat header, then p tokens drawn at random places of the whole corpus (kept in
  corpus order): real corpus KV that is not concentrated on the document's start.
- `random`: N(0, 1) keys and values, the sink (first `num_frozen` tokens) the model's KV of the BOS token.
- `peft`: a PEFT CARTRIDGE adapter directory (`peft_adapter`), e.g. one trained with PEFT's own example.
- `attention_matching`: the whole context's KV compacted to p tokens without training (`cartridges.compact`):
  per KV head the keys repeat-prefill queries attend to most, their values fitted to the context's attention
  output.

A Zoo model (recurrent or hybrid) gets a `StateCartridge`: the state after the same tokens, or random.
"""

import random

import torch

from cartridges.cache import Cartridge
from cartridges.config import ConfigError, DistillConfig
from cartridges.corpus import Corpus, context_ids
from cartridges.state import StateCartridge


def is_state_model(model) -> bool:
    """Zoo models (recurrent and hybrid) get state cartridges; every other causal LM a KV cartridge."""
    from zoo.models.hf import ZooForCausalLM

    return isinstance(model, ZooForCausalLM)


def header_length(tokenizer) -> int:
    """Tokens of the chat template before the document starts: the common prefix of two rendered contexts."""
    a, b = context_ids(tokenizer, "a"), context_ids(tokenizer, "b")
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def corpus_context(cfg: DistillConfig, tokenizer, corpus: Corpus) -> list[int]:
    """The corpus in context (what ICL reads), checked to hold at least the cartridge's p tokens."""
    ctx = context_ids(tokenizer, corpus.full_text())
    if len(ctx) < cfg.num_tokens:
        raise ConfigError(f"num_tokens={cfg.num_tokens} exceeds the corpus in context ({len(ctx)} tokens)")
    return ctx


def init_ids(cfg: DistillConfig, tokenizer, corpus: Corpus) -> list[int]:
    """The token ids whose KV starts a `first_tokens`, `truncated_context` (at most p of them) or `corpus_tokens`
    cartridge."""
    ctx = corpus_context(cfg, tokenizer, corpus)
    if cfg.init == "first_tokens":
        return ctx[: cfg.num_tokens]
    if cfg.init == "truncated_context":
        from cartridges.eval import truncated_context

        return truncated_context(tokenizer, corpus, cfg.num_tokens)
    head = ctx[: min(header_length(tokenizer), cfg.num_tokens)]
    pool = [t for doc in corpus.tokens for t in doc]
    rng = random.Random(f"{cfg.seed}:corpus_tokens")
    places = sorted(rng.sample(range(len(pool)), cfg.num_tokens - len(head)))
    return head + [pool[i] for i in places]


def init_cartridge(cfg: DistillConfig, model, tokenizer, corpus: Corpus, device) -> Cartridge | StateCartridge:
    """A KV cartridge of `num_tokens` tokens, or for a Zoo model the state after `num_tokens` tokens (`num_frozen`
    does not apply to states)."""
    state = is_state_model(model)
    if cfg.init == "peft":
        if state:
            raise ConfigError("init=peft starts a KV cartridge; Zoo models train state cartridges")
        c = Cartridge.from_peft_adapter(cfg.peft_adapter, model, device=device)
        if c.num_tokens != cfg.num_tokens or c.num_frozen != cfg.num_frozen:
            raise ConfigError(
                f"peft_adapter={cfg.peft_adapter} holds {c.num_tokens} tokens ({c.num_frozen} frozen); set "
                f"num_tokens={c.num_tokens} num_frozen={c.num_frozen}"
            )
        c.info.corpus_hash = corpus.hash
        return c
    if cfg.init == "attention_matching":
        if state:
            raise ConfigError("init=attention_matching compacts a KV cache; Zoo models train state cartridges")
        from cartridges.compact import attention_matching, repeat_prefill_ids

        reference = repeat_prefill_ids(tokenizer, corpus.full_text())
        return attention_matching(model, corpus_context(cfg, tokenizer, corpus), cfg.num_tokens, reference,
                                  num_frozen=cfg.num_frozen, corpus_hash=corpus.hash).to(device)
    if cfg.init == "random":
        if state:
            c = StateCartridge.random(model, cfg.num_tokens, seed=cfg.seed)
        else:
            c = Cartridge.random(model, cfg.num_tokens, num_frozen=cfg.num_frozen, seed=cfg.seed)
        c.info.corpus_hash = corpus.hash
        return c.to(device)
    prefix = torch.tensor(init_ids(cfg, tokenizer, corpus))
    if state:
        return StateCartridge.from_prefix(model, prefix, corpus_hash=corpus.hash, init_method=cfg.init).to(device)
    return Cartridge.from_prefix(
        model, prefix, num_frozen=cfg.num_frozen, corpus_hash=corpus.hash, init_method=cfg.init
    ).to(device)
