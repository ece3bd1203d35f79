"""Generation backends for self-study: token ids in, token ids (+ top-k log-probs) out.

- `TransformersClient`: in-process `model.generate`, batched with left padding. The default.
- `OpenAIClient`: an OpenAI-compatible `/completions` endpoint (vLLM, SGLang) that takes token-id prompts and
  returns log-probs. Token ids come back through vLLM's `return_tokens_as_token_ids` ("token_id:123").

Both return, per prompt, the generated ids (up to and including an end-of-sequence token) and, when asked, the
top-k ids and log-probs of the model's full next-token distribution at each generated position (temperature 1,
before sampling), which is what distillation matches.
"""

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch

from cartridges.corpus import left_pad

log = logging.getLogger(__name__)


class ClientError(RuntimeError):
    """A backend failed or answered something that cannot be used."""


@dataclass
class Completion:
    token_ids: list[int]
    top_ids: list[list[int]] = field(default_factory=list)  # [len(token_ids), k]
    top_logprobs: list[list[float]] = field(default_factory=list)


class Client(Protocol):
    def complete(
        self, prompts: list[list[int]], max_tokens: int, temperature: float, top_logprobs: int = 0, seed: int = 0
    ) -> list[Completion]: ...


def stop_ids(tokenizer, model=None) -> set[int]:
    """The token ids that end a generation: every EOS id of the tokenizer, the model's generation config and the
    model's config (the one definition, shared by the clients and the server)."""
    ids = set()
    for source in (tokenizer, getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return ids


class TransformersClient:
    """Batched generation with the in-process model (frozen, eval mode)."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.stop = stop_ids(tokenizer, model)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.stop, default=0)

    @torch.no_grad()
    def complete(self, prompts, max_tokens, temperature, top_logprobs=0, seed=0):
        device = next(self.model.parameters()).device
        ids, mask = left_pad(prompts, self.pad_id)
        width = ids.shape[1]
        sample = temperature > 0
        if sample:
            kwargs = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        else:
            kwargs = {"do_sample": False}
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_tokens,
                pad_token_id=self.pad_id,
                eos_token_id=sorted(self.stop) or None,
                return_dict_in_generate=True,
                output_logits=top_logprobs > 0,
                **kwargs,
            )
        new = out.sequences[:, width:].cpu()  # [B, steps]
        if top_logprobs > 0:
            # step by step ([B, V] each): stacking first would hold [B, steps, V] twice more (the stack and its
            # log-softmax), 16 GB each in fp32 for 512 answers of 160 tokens over a 49K vocabulary
            tops = [step.float().log_softmax(-1).topk(top_logprobs, dim=-1) for step in out.logits]
            top_vals = torch.stack([t.values for t in tops], dim=1).cpu()  # [B, steps, k]
            top_idx = torch.stack([t.indices for t in tops], dim=1).cpu()
        completions = []
        for i in range(len(prompts)):
            toks = new[i].tolist()
            n = next((j + 1 for j, t in enumerate(toks) if t in self.stop), len(toks))
            c = Completion(toks[:n])
            if top_logprobs > 0:
                c.top_ids = top_idx[i, :n].tolist()
                c.top_logprobs = top_vals[i, :n].tolist()
            completions.append(c)
        return completions


class OpenAIClient:
    """A vLLM/SGLang server's OpenAI-compatible completions API, prompts sent as token ids."""

    def __init__(self, base_url: str, model: str, api_key: str = "EMPTY", timeout: float = 600.0, transport=None):
        import httpx

        self.model = model
        self.http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=timeout,
            transport=transport,
        )

    def complete(self, prompts, max_tokens, temperature, top_logprobs=0, seed=0):
        import httpx

        body = {
            "model": self.model,
            "prompt": prompts,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "seed": seed,
            "skip_special_tokens": False,
            "return_tokens_as_token_ids": True,
        }
        if top_logprobs:
            body["logprobs"] = top_logprobs
        try:
            response = self.http.post("/completions", json=body)
            response.raise_for_status()
            choices = response.json()["choices"]
        except httpx.HTTPError as e:
            raise ClientError(f"completions request to {self.http.base_url} failed: {e}") from None
        except (KeyError, ValueError) as e:
            raise ClientError(f"completions response without choices: {e}") from None
        if len(choices) != len(prompts):
            raise ClientError(f"asked {len(prompts)} completions, got {len(choices)}")
        out = [None] * len(prompts)
        for choice in choices:
            out[choice.get("index", 0)] = self._parse(choice, top_logprobs)
        return out

    @staticmethod
    def _parse(choice: dict, k: int) -> Completion:
        lp = choice.get("logprobs") or {}
        tokens = lp.get("tokens")
        if tokens is None:
            raise ClientError("the server returned no logprobs.tokens; start vLLM/SGLang with logprobs enabled")
        ids = [_token_id(t) for t in tokens]
        c = Completion(ids)
        if k:
            for pos in lp.get("top_logprobs") or []:
                ranked = sorted(((float(v), _token_id(t)) for t, v in pos.items()), reverse=True)[:k]
                if len(ranked) < k:
                    raise ClientError(f"the server returned {len(ranked)} top logprobs, asked {k}")
                c.top_ids.append([t for _, t in ranked])
                c.top_logprobs.append([v for v, _ in ranked])
            if len(c.top_ids) != len(ids):
                raise ClientError("top_logprobs and tokens differ in length")
        return c


def _token_id(token: str) -> int:
    if not token.startswith("token_id:"):
        raise ClientError(f"token {token!r} is not 'token_id:N'; the server must support return_tokens_as_token_ids")
    return int(token.removeprefix("token_id:"))
