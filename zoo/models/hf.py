"""transformers wrappers: `ZooConfig` and `ZooForCausalLM`, registered with `AutoConfig`/`AutoModelForCausalLM`.

    from transformers import AutoModelForCausalLM
    from zoo.models.hf import ZooConfig          # importing this module registers model_type "zoo"
    model = AutoModelForCausalLM.from_config(ZooConfig())          # a small hybrid: BaseConv, SWA, Based
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=32, do_sample=True, top_p=0.9)
    model.save_pretrained(path)                  # safetensors, tied head stored once, and modeling_zoo.py
    AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)   # in a fresh process, no zoo import

A saved checkpoint carries `auto_map` in its config.json and a two-line `modeling_zoo.py` that imports these
classes from the installed zoo package, so `trust_remote_code=True` loads it in a process that never imported
zoo. zoo must still be installed (the code lives in it, not in the checkpoint); without it, transformers says
which package is missing.

`ZooForCausalLM` wraps a `LanguageModel` (parameters under `model.`) and decodes with a `ZooCache`: the
fixed-size recurrent state of every layer, filled by a prefill that keeps left padding out of the states
(zoo/models/cache.py). On CUDA, with `decode_cuda_graph` set and gradients off, each single-token decode
step replays a CUDA graph captured over the cache's tensors.
"""

from __future__ import annotations

import copy
from dataclasses import field, fields
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from zoo.config import ModelConfig
from zoo.models.cache import DecodeGraph, ZooCache, prefill
from zoo.models.lm import LanguageModel
from zoo.models.lm import _init_weights as _zoo_init_weights

# transformers 5.2x names the cache of model outputs and generation inputs `cache`; earlier 5.x releases (5.17
# on the H200 image) name it `past_key_values`. Accept both, and speak the installed release's name.
CACHE_KEY = "cache" if "cache" in {f.name for f in fields(CausalLMOutputWithPast)} else "past_key_values"

MODEL_TYPE = "zoo"


def _default_pattern() -> list[str]:
    # One block of the released Based pattern: BaseConv, Based, sliding window, BaseConv, BaseConv.
    return ["base_conv", "based", "sliding_window", "base_conv", "base_conv"]


def _default_mixers() -> dict[str, dict[str, Any]]:
    return {"based": {"feature_dim": 8, "num_heads": 2}, "sliding_window": {"window": 16, "num_heads": 2}}


# (ModelConfig field, ZooConfig field): what the wrapper's config carries of the model's, both ways
_FIELDS = (
    ("vocab_size", "vocab_size"), ("d_model", "d_model"), ("n_layers", "n_layers"), ("pattern", "pattern"),
    ("mixers", "mixers"), ("mlp", "mlp"), ("mlp_hidden", "mlp_hidden"), ("norm", "norm"),
    ("final_norm", "final_norm"), ("rms_eps", "rms_eps"), ("tie_embeddings", "tie_word_embeddings"),
    ("embed_dropout", "embed_dropout"),
)


class ZooConfig(PretrainedConfig):
    """The fields of `zoo.config.ModelConfig`, as a transformers config (saved as config.json).

    `ZooConfig()` is a CPU-sized hybrid with all three layer kinds of the Based LM (BaseConv, sliding window,
    Based), SwiGLU, RMSNorm and tied embeddings. `tie_word_embeddings` is ModelConfig's `tie_embeddings`.
    `decode_cuda_graph`: decode through a CUDA graph on CUDA devices. `prefill_chunk_tokens` > 0: prefill a
    batch in slices of rows of at most that many tokens (0: the whole batch in one forward).
    """

    model_type = MODEL_TYPE
    attribute_map = {"hidden_size": "d_model", "num_hidden_layers": "n_layers"}

    vocab_size: int = 512
    d_model: int = 64
    n_layers: int = 5
    pattern: list[str] = field(default_factory=_default_pattern)
    mixers: dict[str, dict[str, Any]] = field(default_factory=_default_mixers)
    mlp: str = "swiglu"
    mlp_hidden: int = 0
    norm: str = "rmsnorm"
    final_norm: str = ""
    rms_eps: float | None = None
    tie_word_embeddings: bool = True
    embed_dropout: float = 0.0
    use_cache: bool = True
    decode_cuda_graph: bool = True
    prefill_chunk_tokens: int = 0

    def __post_init__(self, **kwargs) -> None:
        super().__post_init__(**kwargs)
        if self.mixers == _default_mixers():  # a pattern of one's own keeps only the defaults it uses
            self.mixers = {name: options for name, options in self.mixers.items() if name in self.pattern}
        self.model_config()  # an impossible value fails here, with ModelConfig's one-line reason

    def model_config(self) -> ModelConfig:
        """The `ModelConfig` that `LanguageModel` is built from."""
        values = {zoo: copy.deepcopy(getattr(self, hf)) for zoo, hf in _FIELDS}
        return ModelConfig(**values | {"pattern": list(values["pattern"]), "mixers": dict(values["mixers"])})

    @classmethod
    def from_model_config(cls, model_config: ModelConfig, **kwargs) -> ZooConfig:
        """A ZooConfig holding `model_config`'s fields; kwargs set transformers fields (eos_token_id, ...)."""
        if model_config.max_position_embeddings:
            # transformers reads `max_position_embeddings` as a context limit; the MQAR baselines' absolute
            # position table has no place in the wrapper
            raise ValueError("ZooConfig cannot hold model.max_position_embeddings > 0 (absolute position tables)")
        values = {hf: copy.deepcopy(getattr(model_config, zoo)) for zoo, hf in _FIELDS}
        return cls(**values | {"pattern": list(values["pattern"]), "mixers": dict(values["mixers"])}, **kwargs)


class ZooPreTrainedModel(PreTrainedModel):
    config_class = ZooConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    supports_gradient_checkpointing = False

    def _init_weights(self, module: torch.nn.Module) -> None:
        # The LanguageModel's own rule (normal 0.02 linears and embeddings, zero biases); norms to one.
        _zoo_init_weights(module)
        if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            if module.weight is not None:
                torch.nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, torch.nn.Conv1d):
            module.reset_parameters()


# The file a saved checkpoint carries for `trust_remote_code=True`: the classes come from the installed package.
REMOTE_MODULE = "modeling_zoo"
REMOTE_CODE = '''"""Zoo checkpoint code for transformers\' trust_remote_code: the classes live in the zoo package
(pip install zoo); this file only imports them. Written by ZooForCausalLM.save_pretrained (zoo {version})."""

from zoo.models.hf import ZooConfig, ZooForCausalLM

__all__ = ["ZooConfig", "ZooForCausalLM"]
'''
AUTO_MAP = {"AutoConfig": f"{REMOTE_MODULE}.ZooConfig", "AutoModelForCausalLM": f"{REMOTE_MODULE}.ZooForCausalLM"}


class ZooForCausalLM(ZooPreTrainedModel, GenerationMixin):
    """A `LanguageModel` as a transformers causal LM: forward (loss, logits, cache) and `generate`."""

    _tied_weights_keys = {"model.head.weight": "model.embedding.weight"}

    def __init__(self, config: ZooConfig) -> None:
        super().__init__(config)
        self.model = LanguageModel(config.model_config())
        self.post_init()

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save_pretrained, plus `auto_map` and modeling_zoo.py for `trust_remote_code=True`."""
        from pathlib import Path

        from zoo import __version__

        self.config.auto_map = dict(AUTO_MAP)
        out = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            (Path(save_directory) / f"{REMOTE_MODULE}.py").write_text(REMOTE_CODE.format(version=__version__))
        return out

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # The model makes its own ZooCache in forward; transformers must not hand it a DynamicCache.
        return False

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embedding

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.model.embedding = value

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.head

    def set_output_embeddings(self, value: torch.nn.Module) -> None:
        self.model.head = value

    def make_cache(self, batch_size: int) -> ZooCache:
        """An empty ZooCache on the model's device and dtype."""
        return ZooCache(self.model, batch_size, device=self.device, dtype=self.dtype)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: ZooCache | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        return_dict: bool | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        """input_ids [B, T] -> logits [B, T, vocab] (the last `logits_to_keep` positions when > 0), fp32.

        attention_mask [B, T(+cached)]: 1 for tokens, 0 for left padding, which never enters a state.
        cache: a ZooCache to continue (in place); with `use_cache` and no cache, a new one is returned.
        labels [B, T]: next-token cross-entropy, -100 ignored (shifted inside, as in transformers).
        """
        if cache is None:
            cache = kwargs.pop("past_key_values", None)  # the name before transformers 5.2x
        if inputs_embeds is not None:
            raise ValueError("ZooForCausalLM takes input_ids only (the mixers' states start from token embeddings)")
        if input_ids is None:
            raise ValueError("input_ids is required")
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if cache is None and use_cache:
            cache = self.make_cache(input_ids.shape[0])
        B, T = input_ids.shape
        chunk = self.config.prefill_chunk_tokens
        if cache is None:
            if attention_mask is not None and not bool(attention_mask.all()):
                # Padding needs the per-group prefill; a throwaway cache runs it.
                h = prefill(self.model, input_ids, self.make_cache(B), attention_mask, logits_to_keep, chunk)
            else:
                h = self.model.hidden_states(input_ids)
                h = h[:, -logits_to_keep:] if logits_to_keep else h
        elif cache.seen_tokens > 0 and T == 1:
            h = None
            logits = self._decode_step(input_ids[:, 0], cache)[:, None]  # [B, 1, vocab]
        else:
            h = prefill(self.model, input_ids, cache, attention_mask, logits_to_keep, chunk)
        if h is not None:
            logits = self.model.logits(h)
        logits = logits.float()

        loss = None
        if labels is not None:
            if logits.shape[1] != T:
                raise ValueError("labels need logits at every position: pass logits_to_keep=0")
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        out = CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_KEY: cache if use_cache else None})
        return out if return_dict else out.to_tuple()

    def _decode_step(self, ids: torch.Tensor, cache: ZooCache) -> torch.Tensor:
        """ids [B] -> logits [B, vocab]: one recurrent step, through a CUDA graph when enabled and possible."""
        use_graph = self.config.decode_cuda_graph and ids.is_cuda and not torch.is_grad_enabled()
        if use_graph:
            if cache.decode_graph is None:
                cache.decode_graph = DecodeGraph(self.model, cache)
            logits = cache.decode_graph(ids)
        else:
            logits = self.model.step(ids, cache.states)
        cache.seen_tokens += 1
        return logits

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        next_sequence_length: int | None = None,
        cache: ZooCache | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> dict[str, Any]:
        """The tokens the cache has not seen, with the full attention mask (prefill reads its padding)."""
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        if cache is not None and cache.seen_tokens > 0:
            input_ids = input_ids[:, cache.seen_tokens :]
        inputs = {"input_ids": input_ids.contiguous(), CACHE_KEY: cache, "attention_mask": attention_mask}
        for key in ("use_cache", "logits_to_keep"):
            if key in kwargs:
                inputs[key] = kwargs[key]
        return inputs


def register() -> None:
    """Register ZooConfig/ZooForCausalLM with AutoConfig and AutoModelForCausalLM (idempotent)."""
    AutoConfig.register(MODEL_TYPE, ZooConfig, exist_ok=True)
    AutoModelForCausalLM.register(ZooConfig, ZooForCausalLM, exist_ok=True)


register()


__all__ = ["ZooCache", "ZooConfig", "ZooForCausalLM", "register"]
