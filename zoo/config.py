"""Typed config schemas (Hydra structured configs). YAML presets in configs/ only fill these in.

Merge order: dataclass defaults -> YAML preset -> command line. Unknown keys fail in Hydra's merge;
impossible values fail in `__post_init__`, which runs when the merged config is turned into these objects
(`OmegaConf.to_object`). Both happen before any work starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    """A LanguageModel: embeddings, `n_layers` pre-norm blocks, tied head.

    The layer pattern is data: `pattern` lists mixer names (keys of `zoo.models.mixers.MIXERS`) and is
    repeated to fill `n_layers`. `mixers` holds the options of each mixer, keyed by the same names, e.g.
    `{"based": {"feature_dim": 8, "num_heads": 2}}`; options not given take the mixer's defaults.
    """

    vocab_size: int = 8192
    d_model: int = 128
    n_layers: int = 2
    pattern: list[str] = field(default_factory=lambda: ["base_conv", "based"])
    mixers: dict[str, dict[str, Any]] = field(default_factory=dict)
    mlp: str = "none"  # none | swiglu | gelu
    mlp_hidden: int = 0  # 0: 2·d_model for swiglu, 4·d_model for gelu
    norm: str = "layernorm"  # layernorm | rmsnorm
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.vocab_size < 2:
            raise ValueError(f"model.vocab_size must be >= 2, got {self.vocab_size}")
        if self.d_model < 1 or self.n_layers < 1:
            raise ValueError(f"model.d_model and model.n_layers must be >= 1, got {self.d_model}, {self.n_layers}")
        if not self.pattern:
            raise ValueError("model.pattern must list at least one mixer")
        if self.mlp not in ("none", "swiglu", "gelu"):
            raise ValueError(f"model.mlp must be one of none|swiglu|gelu, got {self.mlp!r}")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"model.norm must be one of layernorm|rmsnorm, got {self.norm!r}")
        if self.mlp_hidden < 0:
            raise ValueError(f"model.mlp_hidden must be >= 0, got {self.mlp_hidden}")
        from zoo.models.mixers import check_mixer_options

        for name in self.pattern:
            check_mixer_options(name, self.d_model, dict(self.mixers.get(name, {})))
        unused = sorted(set(self.mixers) - set(self.pattern))
        if unused:
            raise ValueError(f"model.mixers has options for {unused}, which model.pattern {self.pattern} never uses")

    def layers(self) -> list[str]:
        """The mixer name of every layer: `pattern` repeated to `n_layers`."""
        return [self.pattern[i % len(self.pattern)] for i in range(self.n_layers)]
