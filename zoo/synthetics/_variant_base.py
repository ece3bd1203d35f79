"""Validation and seeding shared by the MQAR variants (each variant's layout lives in its own file).

Every variant config takes MQAR's fields (so `SegmentConfig.task_config` can build any of them) plus its own
options, which `SegmentConfig.options` fills in. Each draws everything from one PCG64 stream seeded by
`seed`: the same (config, seed) gives the same tensors on any machine.
"""

import math

import numpy as np

from zoo.synthetics.mqar import _check_seed


def check_ints(task: str, cfg, names: tuple[str, ...], minimum: int = 1) -> None:
    for name in names:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{task}.{name} must be an int, got {value!r}")
        if value < minimum:
            raise ValueError(f"{task}.{name} must be >= {minimum}, got {value}")


def check_power_a(task: str, a) -> None:
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not (0 < a < math.inf):
        raise ValueError(f"{task}.power_a must be a finite number > 0, got {a!r}")


def check_single_pass(task: str, cfg) -> None:
    """Variants have one context pass and a zero filler; say so instead of ignoring the fields."""
    if cfg.num_passes != 1:
        raise ValueError(f"{task} supports num_passes=1 only, got {cfg.num_passes}")
    if cfg.random_non_queries is not False:
        raise ValueError(f"{task} supports random_non_queries=false only, got {cfg.random_non_queries!r}")


def rng_for(seed: int) -> np.random.Generator:
    _check_seed(seed)
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed)))
