"""Models: sequence mixers (`MIXERS`), the residual `Block` and the `LanguageModel`."""

from zoo.models.block import Block
from zoo.models.lm import LanguageModel
from zoo.models.mixers import MIXERS

__all__ = ["MIXERS", "Block", "LanguageModel"]
