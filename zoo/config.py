"""Typed config schemas (Hydra structured configs). YAML presets in zoo/configs/ only fill these in.

Merge order: dataclass defaults -> YAML preset -> command line. Unknown keys fail in Hydra's merge;
impossible values fail in `__post_init__`, which runs when the merged config is turned into these objects
(`OmegaConf.to_object`). Both happen before any work starts.
"""

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class ModelConfig:
    """A LanguageModel: embeddings, `n_layers` pre-norm blocks, tied head.

    The layer pattern is data: `pattern` lists mixer names (keys of `zoo.models.mixers.MIXERS`) and is
    repeated to fill `n_layers`. `mixers` holds the options of each mixer, keyed by the same names, e.g.
    `{"based": {"feature_dim": 8, "num_heads": 2}}`; options not given take the mixer's defaults.
    `max_position_embeddings` > 0 adds a learned absolute position table of that many rows to the token
    embeddings, and `embed_dropout` drops embedding elements while training (both Zoology's; off by default).
    `init`: "default" draws linear and embedding weights from normal(0, 0.02) with zero biases, convolutions'
    biases included; "zoology" is Zoology's init for its TransformerBlock models exactly: convolutions keep
    PyTorch's default init, bias too, the output projections Zoology names `out_proj` (attention, Hyena,
    sliding window) are drawn at 0.02/√(2·n_layers), and mixers with more of Zoology's init to add (`zoology_init`:
    RWKV-4's per-layer decays and mixes, Hyena's short conv and H3's shift at PyTorch's Conv1d init) get it.
    """

    vocab_size: int = 8192
    d_model: int = 128
    n_layers: int = 2
    pattern: list[str] = field(default_factory=lambda: ["base_conv", "based"])
    mixers: dict[str, dict[str, Any]] = field(default_factory=dict)
    # none | swiglu | gelu | tanh (Zoology's 2023 hard-wired MLP) | identity (its state_mixer=Identity: x + norm(x))
    mlp: str = "none"
    mlp_hidden: int = 0  # 0: 2·d_model for swiglu, 4·d_model for gelu and tanh
    norm: str = "layernorm"  # layernorm | rmsnorm
    final_norm: str = ""  # the norm before the head: "" (the blocks' `norm`) | layernorm | rmsnorm
    rms_eps: float | None = None  # the RMSNorms' eps; None: torch's default, the dtype's machine epsilon
    tie_embeddings: bool = True
    max_position_embeddings: int = 0  # rows of a learned absolute position table added to the embeddings; 0: none
    embed_dropout: float = 0.0  # dropout on the embeddings while training
    init: str = "default"  # default | zoology

    def __post_init__(self) -> None:
        if self.vocab_size < 2:
            raise ValueError(f"model.vocab_size must be >= 2, got {self.vocab_size}")
        if self.d_model < 1 or self.n_layers < 1:
            raise ValueError(f"model.d_model and model.n_layers must be >= 1, got {self.d_model}, {self.n_layers}")
        if not self.pattern:
            raise ValueError("model.pattern must list at least one mixer")
        if self.mlp not in ("none", "swiglu", "gelu", "tanh", "identity"):
            raise ValueError(f"model.mlp must be one of none|swiglu|gelu|tanh|identity, got {self.mlp!r}")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"model.norm must be one of layernorm|rmsnorm, got {self.norm!r}")
        if self.rms_eps is not None and not self.rms_eps > 0:
            raise ValueError(f"model.rms_eps must be > 0 or null, got {self.rms_eps}")
        if self.final_norm not in ("", "layernorm", "rmsnorm"):
            raise ValueError(f"model.final_norm must be empty (as model.norm) or one of layernorm|rmsnorm, "
                             f"got {self.final_norm!r}")
        if self.mlp_hidden < 0:
            raise ValueError(f"model.mlp_hidden must be >= 0, got {self.mlp_hidden}")
        if self.max_position_embeddings < 0:
            raise ValueError(f"model.max_position_embeddings must be >= 0, got {self.max_position_embeddings}")
        if not 0 <= self.embed_dropout < 1:
            raise ValueError(f"model.embed_dropout must be in [0, 1), got {self.embed_dropout}")
        if self.init not in ("default", "zoology"):
            raise ValueError(f"model.init must be one of default|zoology, got {self.init!r}")
        from zoo.models.mixers import check_mixer_options

        for name in self.pattern:
            check_mixer_options(name, self.d_model, dict(self.mixers.get(name, {})))
        unused = sorted(set(self.mixers) - set(self.pattern))
        if unused:
            raise ValueError(f"model.mixers has options for {unused}, which model.pattern {self.pattern} never uses "
                             f"(a typo? add them to the pattern or drop them: ~model.mixers.{unused[0]})")

    def layers(self) -> list[str]:
        """The mixer name of every layer: `pattern` repeated to `n_layers`."""
        return [self.pattern[i % len(self.pattern)] for i in range(self.n_layers)]


@dataclass
class SegmentConfig:
    """One slice of synthetic data: a task config plus how to batch it. A batch never mixes segments."""

    task: str = "mqar"
    seq_len: int = 64
    num_kv_pairs: int = 4
    num_examples: int = 1000
    power_a: float = 0.01
    random_non_queries: bool = False
    num_passes: int = 1
    batch_size: int = 64
    options: dict[str, Any] = field(default_factory=dict)  # task-specific fields, e.g. {num_updates: 4}

    def task_config(self, vocab_size: int):
        """The task's own config (e.g. `MQARConfig`) for this segment."""
        from zoo.synthetics import TASKS

        if self.task not in TASKS:
            raise ValueError(f"data segment task {self.task!r} is unknown (tasks: {sorted(TASKS)})")
        config_cls, _ = TASKS[self.task]
        return config_cls(
            vocab_size=vocab_size,
            seq_len=self.seq_len,
            num_kv_pairs=self.num_kv_pairs,
            num_examples=self.num_examples,
            power_a=self.power_a,
            random_non_queries=self.random_non_queries,
            num_passes=self.num_passes,
            **dict(self.options),
        )


SPLITS = ("train", "valid", "test")
# Segment i of split s is drawn with seed `seed * SEED_STRIDE + s * SPLIT_STRIDE + i`: disjoint across splits,
# segments and base seeds as long as a split holds fewer than SPLIT_STRIDE segments.
SEED_STRIDE = 10_000
SPLIT_STRIDE = 1_000


@dataclass
class DataConfig:
    """Train, validation and test segments, each drawn from its own seed."""

    vocab_size: int = 8192
    seed: int = 0
    train: list[SegmentConfig] = field(default_factory=lambda: [SegmentConfig(num_examples=10_000)])
    valid: list[SegmentConfig] = field(default_factory=lambda: [SegmentConfig(num_examples=500)])
    test: list[SegmentConfig] = field(default_factory=lambda: [SegmentConfig(num_examples=1000)])
    cache: bool = True
    cache_dir: str | None = None  # None: $ZOO_CACHE_DIR or ~/.cache/zoo/synthetics

    def __post_init__(self) -> None:
        for split in SPLITS:
            segments = getattr(self, split)
            if not segments:
                raise ValueError(f"data.{split} must list at least one segment")
            if len(segments) >= SPLIT_STRIDE:
                raise ValueError(f"data.{split} lists {len(segments)} segments; at most {SPLIT_STRIDE - 1}")
            for i, seg in enumerate(segments):
                if seg.batch_size < 1:
                    raise ValueError(f"data.{split}[{i}].batch_size must be >= 1, got {seg.batch_size}")
                try:
                    seg.task_config(self.vocab_size).validate()
                except ValueError as e:
                    raise ValueError(f"data.{split}[{i}]: {e}") from None

    def segment_seed(self, split: str, index: int) -> int:
        return self.seed * SEED_STRIDE + SPLITS.index(split) * SPLIT_STRIDE + index

    def max_seq_len(self) -> int:
        return max(seg.seq_len for split in SPLITS for seg in getattr(self, split))


SCHEDULES = ("cosine", "cosine_epoch")
DECAYS = ("matrices", "all")


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay to `min_lr_ratio`·lr.

    `schedule`: "cosine" decays every step after `warmup_frac` of them; "cosine_epoch" is Zoology's trainer
    (torch's CosineAnnealingLR stepped after each epoch, no warmup): the lr of epoch e is held for the whole epoch.
    `decay`: "matrices" decays weights of two or more dims only; "all" decays every parameter, biases and norms
    included, as Zoology's `AdamW(model.parameters())` does."""

    lr: float = 1e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-8
    warmup_frac: float = 0.02  # fraction of all steps
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0  # 0 disables
    schedule: str = "cosine"  # cosine | cosine_epoch
    decay: str = "matrices"  # matrices | all

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"optim.schedule must be one of {'|'.join(SCHEDULES)}, got {self.schedule!r}")
        if self.decay not in DECAYS:
            raise ValueError(f"optim.decay must be one of {'|'.join(DECAYS)}, got {self.decay!r}")
        if self.schedule == "cosine_epoch" and self.warmup_frac:
            raise ValueError(f"optim.schedule=cosine_epoch has no warmup; set optim.warmup_frac=0 "
                             f"(got {self.warmup_frac})")
        if not 0 <= self.warmup_frac < 1:
            raise ValueError(f"optim.warmup_frac must be in [0, 1), got {self.warmup_frac}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("optim.weight_decay and optim.grad_clip must be >= 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"optim.beta1/beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")


def _check_execution(train) -> None:
    """Checks shared by the `train` sections of zoo-train and zoo-pretrain: device, precision, resume."""
    if train.precision not in ("auto", "fp32", "bf16"):
        raise ValueError(f"train.precision must be auto|fp32|bf16, got {train.precision!r}")
    if not (train.device in ("auto", "cpu", "cuda") or train.device.startswith("cuda:")):
        raise ValueError(f"train.device must be auto|cpu|cuda|cuda:N, got {train.device!r}")
    if train.threads < 0:
        raise ValueError(f"train.threads must be >= 0 (0: the cores available), got {train.threads}")
    if train.resume and train.overwrite:
        raise ValueError("train.resume and train.overwrite exclude each other")
    if train.compile_mode not in COMPILE_MODES:
        raise ValueError(f"train.compile_mode must be {'|'.join(COMPILE_MODES)}, got {train.compile_mode!r}")
    if train.compile_mode != "default" and not train.compile:
        raise ValueError(f"train.compile_mode={train.compile_mode} needs train.compile=true")


# torch.compile's modes. "reduce-overhead" replays each compiled step from CUDA graphs: the step's launches cost the
# host nothing, which is what the Triton kernels need at short T (kernels/based/README.md: an eager Based
# forward+backward at B·H = 128, T ≤ 2048 waits on the host).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class TrainConfig:
    epochs: int = 64
    early_stop: float | None = 0.99  # stop once valid/accuracy reaches this; None never stops early
    eval_every: int = 1  # epochs between evaluations (and checkpoints)
    log_every: int = 50  # steps between training-loss log lines
    # The largest share of the training wall that checkpoints after evaluations may take. An evaluation is followed
    # by a checkpoint once the time since the last one is at least that checkpoint's cost / checkpoint_share: a
    # d=512 pack of 4 writes 227 MB (about 1 s), which at 0.05 checkpoints every 20 s instead of every 3 s epoch;
    # a small run still checkpoints after every evaluation. 1: after every evaluation. A stopped run (stop_at,
    # SIGTERM) checkpoints where it stops whatever this says.
    checkpoint_share: float = 0.05
    seed: int = 0
    # The batches of an epoch. shuffle: every epoch its own seeded order, examples and segments mixed (a batch
    # still holds one segment). fixed: Zoology's DataLoader (shuffle=False), every epoch the same, the segments in
    # config order and each one's batches in example order.
    batch_order: str = "shuffle"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | fp32 | bf16
    compile: bool = False
    compile_mode: str = "default"  # torch.compile's mode (COMPILE_MODES); reduce-overhead: CUDA graphs
    # On CUDA: capture the whole training step (forward, backward, AdamW) as a CUDA graph per batch shape and
    # replay it, so a tiny model's step costs a few launches instead of hundreds (zoo/steps.py: a single run is
    # a graphed pack of one, with any impl). Ignored with a warning on CPU.
    cuda_graph: bool = False
    resume: bool = False  # continue the run in run_dir from its last checkpoint
    overwrite: bool = False  # start over in a run_dir that already holds a run
    progress: bool = True
    # torch CPU threads. 0: the cores available to the process, set by zoo-train at start; inside a zoo-sweep
    # worker, the worker's share of the cores.
    threads: int = 0
    # Non-empty: train one run per learning rate here (optim.lr is replaced), packed into one vmapped model
    # in this process (zoo/steps.py). Each run lands in the run dir its unpacked config would use.
    pack_lrs: list[float] = field(default_factory=list)
    # Non-empty: one run per seed (train.seed is replaced), packed the same way; with pack_lrs, one run per (seed,
    # lr), seed by seed. Each member starts from its own seed's init and sees its seed's batch order (one training
    # segment: zoo/steps.py).
    pack_seeds: list[int] = field(default_factory=list)
    # How a pack's members stop at early_stop. each: every member on its own, the others train on. first: once one
    # member reaches it, the whole pack stops there, each other member finalised where it stands (its summary says
    # `stopped_by_pack`). For grids that report each point's best lr: a member at early_stop already settles that
    # point's best, and its siblings' further epochs cannot change it by more than 1 - early_stop.
    pack_stop: str = "each"
    # Unix time (s) at which to stop: the run checkpoints where it is, mid-epoch included, and exits as
    # interrupted, to resume exactly there (train.resume=true). 0: no limit. SIGTERM stops a run the same way.
    # `zoo-sweep --time-limit` sets it for a time-limited allocation.
    stop_at: float = 0.0

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.eval_every < 1 or self.log_every < 1:
            raise ValueError("train.epochs, train.eval_every and train.log_every must be >= 1")
        if self.batch_order not in ("shuffle", "fixed"):
            raise ValueError(f"train.batch_order must be shuffle|fixed, got {self.batch_order!r}")
        if self.pack_stop not in ("each", "first"):
            raise ValueError(f"train.pack_stop must be each|first, got {self.pack_stop!r}")
        if not 0 < self.checkpoint_share <= 1:
            raise ValueError(f"train.checkpoint_share must be in (0, 1], got {self.checkpoint_share}")
        if any(not lr > 0 for lr in self.pack_lrs) or len(set(self.pack_lrs)) != len(self.pack_lrs):
            raise ValueError(f"train.pack_lrs must hold distinct learning rates > 0, got {list(self.pack_lrs)}")
        if any(seed < 0 for seed in self.pack_seeds) or len(set(self.pack_seeds)) != len(self.pack_seeds):
            raise ValueError(f"train.pack_seeds must hold distinct seeds >= 0, got {list(self.pack_seeds)}")
        if self.early_stop is not None and not 0 < self.early_stop <= 1:
            raise ValueError(f"train.early_stop must be in (0, 1] or null, got {self.early_stop}")
        _check_execution(self)


@dataclass
class LoggerConfig:
    """The local run dir is always written; wandb only mirrors it."""

    backend: str = "none"  # none | wandb
    project: str = "zoo"
    mode: str = "offline"  # offline | online | disabled (wandb modes)

    def __post_init__(self) -> None:
        if self.backend not in ("none", "wandb"):
            raise ValueError(f"logger.backend must be none|wandb, got {self.backend!r}")
        if self.mode not in ("offline", "online", "disabled"):
            raise ValueError(f"logger.mode must be offline|online|disabled, got {self.mode!r}")


@dataclass
class Config:
    """The root of `zoo-train`'s config tree (zoo/configs/train.yaml fills it in)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    experiment_name: str = "default"  # runs go to <runs_root>/<experiment_name>/<run>
    run: str = ""  # empty: a name derived from the model, lr and a hash of the config
    runs_root: str = "runs"

    def __post_init__(self) -> None:
        if self.model.vocab_size < self.data.vocab_size:
            raise ValueError(
                f"model.vocab_size ({self.model.vocab_size}) is smaller than data.vocab_size ({self.data.vocab_size})"
            )
        for name, value in (("experiment_name", self.experiment_name), ("run", self.run)):
            if "/" in value or value in (".", ".."):
                raise ValueError(f"{name} must be a plain name, got {value!r}")


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    # Only root schemas: the presets merge into their typed nodes. A schema stored under a group name
    # ("model", ...) would turn a plain field of the same name in another command's config into a group.
    cs.store(name="train_schema", node=Config)


@dataclass
class LMDataConfig:
    """Text for causal-LM pretraining (`zoo-pretrain`); see zoo/lm_data.py for sources and tokenizers."""

    source: str = "embedded"  # embedded | a text file, directory or glob | a `datasets` dataset saved to disk
    text_field: str = "text"  # column of a saved dataset
    tokenizer: str = "bpe"  # bpe (trained on the corpus, cached) | smollm2 | path to tokenizer.json or a dir
    bpe_vocab_size: int = 4096
    seq_len: int = 256
    valid_frac: float = 0.05  # the stream's last fraction is the validation split
    cache_dir: str | None = None  # None: $ZOO_CACHE_DIR/lm_data or ~/.cache/zoo/lm_data

    def __post_init__(self) -> None:
        if not self.source:
            raise ValueError("data.source is empty: give a text file, directory, glob, saved dataset or 'embedded'")
        if self.seq_len < 1 or self.bpe_vocab_size < 260:
            raise ValueError("data.seq_len must be >= 1 and data.bpe_vocab_size >= 260 (bytes + specials)")
        if not 0 < self.valid_frac < 1:
            raise ValueError(f"data.valid_frac must be in (0, 1), got {self.valid_frac}")


@dataclass
class PretrainTrainConfig:
    """The pretraining loop: steps of a global batch of world_size·batch_size·grad_accum windows."""

    steps: int = 600
    batch_size: int = 16  # windows per process per micro-step
    grad_accum: int = 1
    log_every: int = 10
    eval_every: int = 100  # steps between validation losses (and checkpoints)
    eval_windows: int = 64  # validation windows (the first ones of the split)
    ckpt_every: int = 0  # 0: checkpoint at each evaluation
    parallel: str = "ddp"  # ddp | fsdp (FSDP2 fully_shard): used under torchrun with more than one process
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N (under torchrun: cuda:LOCAL_RANK)
    precision: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | fp32 | bf16
    compile: bool = False
    compile_mode: str = "default"  # torch.compile's mode (COMPILE_MODES); reduce-overhead: CUDA graphs
    peak_tflops: float = 0.0  # for MFU; 0: looked up from the GPU name (none on CPU)
    sample_tokens: int = 48  # a greedy sample from the trained model at the end (0: none)
    export_hf: bool = True  # write <run>/hf/: ZooForCausalLM.save_pretrained + tokenizer
    stop_after: int = 0  # stop this invocation after this many steps, as if killed (0: never); resume continues
    resume: bool = False
    overwrite: bool = False
    progress: bool = True
    threads: int = 0  # torch CPU threads; 0: the cores available to this process (zoo.device.set_threads)

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "log_every", "eval_every", "eval_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if min(self.ckpt_every, self.sample_tokens, self.peak_tflops, self.stop_after) < 0:
            raise ValueError("train.ckpt_every, sample_tokens, peak_tflops and stop_after must be >= 0")
        if self.parallel not in ("ddp", "fsdp"):
            raise ValueError(f"train.parallel must be ddp|fsdp, got {self.parallel!r}")
        _check_execution(self)


@dataclass
class PretrainConfig:
    """The root of `zoo-pretrain`'s config tree (zoo/configs/pretrain.yaml fills it in)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: LMDataConfig = field(default_factory=LMDataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: PretrainTrainConfig = field(default_factory=PretrainTrainConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    vocab_from_tokenizer: bool = True  # model.vocab_size := len(tokenizer) rounded up to a multiple of 64
    experiment_name: str = "pretrain"
    run: str = ""  # empty: a name derived from the model and a hash of the config
    runs_root: str = "runs"

    def __post_init__(self) -> None:
        for name, value in (("experiment_name", self.experiment_name), ("run", self.run)):
            if "/" in value or value in (".", ".."):
                raise ValueError(f"{name} must be a plain name, got {value!r}")


def register_pretrain_configs() -> None:
    """Register zoo-pretrain's schemas in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    register_configs()
    cs = ConfigStore.instance()
    cs.store(name="pretrain_schema", node=PretrainConfig)
    cs.store(group="lm_data", name="lm_data_schema", node=LMDataConfig)


class ConfigError(ValueError):
    """A config that cannot run; its message is one line."""


def _chain(exc: BaseException | None) -> list[BaseException]:
    out = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _did_you_mean(word: str, known) -> str:
    import difflib

    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _known_keys(node_type_name: str) -> list[str]:
    """Field names of the schema dataclass called `node_type_name` (in this module or cartridges')."""
    import dataclasses
    import sys

    for module in (sys.modules[__name__], sys.modules.get("cartridges.config")):
        cls = getattr(module, node_type_name, None)
        if cls is not None and dataclasses.is_dataclass(cls):
            return [f.name for f in dataclasses.fields(cls)]
    return []


def _sections_with(root_schema: str, leaf: str) -> list[str]:
    """The sections of root schema `root_schema` whose own schema has a field named `leaf`."""
    import dataclasses
    import sys

    cls = getattr(sys.modules[__name__], root_schema, None)
    if cls is None or not dataclasses.is_dataclass(cls):
        return []
    hits = []
    for f in dataclasses.fields(cls):
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if isinstance(sub, type) and dataclasses.is_dataclass(sub):
            if leaf in {g.name for g in dataclasses.fields(sub)}:
                hits.append(f.name)
    return hits


def _unparsable_override(overrides: list[str]) -> str | None:
    """The one-line error for the first override Hydra's grammar cannot parse, or None if every one parses.

    The usual cause is a value with spaces left unquoted, which the shell splits into several overrides."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for text in overrides:
        try:
            parser.parse_override(text)
        except HydraException as e:
            reason = next((line.strip() for line in str(e).splitlines() if line.strip() not in ("", "None")), "")
            opened = sum(text.count(c) for c in "[{") - sum(text.count(c) for c in "]}")
            hint = " (quote a value that holds spaces: 'key=[{a: 1, b: 2}]')" if opened > 0 else ""
            return f"{text}: not a valid override: {reason}{hint}"
    return None


def _one_line(exc: BaseException | None) -> str:
    """One plain line for a Hydra/OmegaConf error chain: what was wrong, what is known, the closest name."""
    import re

    chain = _chain(exc)
    for e in chain:
        options = getattr(e, "options", None)
        found = re.search(r"Could not find '([^']+)/([^'/]+)'", str(e))
        if found:
            group, name = found.groups()
            known = sorted(options or [])
            listing = f" (known: {', '.join(known)})" if known else ""
            return f"{group}={name}: no such preset in {group}/{listing}{_did_you_mean(name, known)}"
    for e in chain:
        key = getattr(e, "full_key", None)
        first = str(e).splitlines()[0] if str(e) else ""
        missing = re.match(r"Key '([^']+)' not in '([^']+)'", first)
        if key and missing:
            leaf, schema = missing.groups()
            section = key.rpartition(".")[0]
            prefix = f"{section}." if section else ""
            known = [prefix + k for k in _known_keys(schema)]
            if not section:  # a section's key given without its section, e.g. epochs=3 for train.epochs
                known += [f"{k}.{leaf}" for k in _sections_with(schema, leaf)]
            return f"{key}: no such key in {section or 'the root config'}{_did_you_mean(key, known)}"
        if key and "$VALUE" not in first:
            override = next((m.group(1) for x in chain if (m := re.search(r"override (\S+)", str(x)))), None)
            return f"{override or key}: {first}"
    parts = []
    for e in reversed(chain):
        lines = [line.strip() for line in str(e).splitlines() if line.strip() and "$" not in line]
        if lines and lines[0] != "None" and lines[0] not in parts:
            parts.append(lines[0])
    return "; ".join(parts) if parts else "invalid config"


MIXER_OPTIONS = "model.mixers."


def mixer_overrides(overrides: list[str]) -> tuple[list[str], set[str]]:
    """Make `model.mixers.<mixer>[.<option>]=v` set options whether or not the preset lists that mixer (Hydra's
    `++`), so options for a mixer the preset lacks need no `+`; also return the mixers the overrides name
    (`"*"` for a whole `model.mixers=...`). `+`, `++` and `~` overrides are kept as written."""
    out, named = [], set()
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key == MIXER_OPTIONS[:-1]:
            named.add("*")
        elif key.startswith(MIXER_OPTIONS):
            named.add(key[len(MIXER_OPTIONS):].split(".", 1)[0])
            if override[0] not in "+~" and "=" in override:
                override = "++" + override
        out.append(override)
    return out, named


def drop_preset_mixer_options(node, named: set[str]) -> list[str]:
    """Remove from a composed config the preset's options for mixers its `model.pattern` does not use (a pattern
    changed on the command line leaves them behind); options the command line gave (`named`) stay, so that a
    typo still fails. Returns the mixers dropped."""
    from omegaconf import DictConfig, ListConfig, open_dict

    model = node.get("model") if isinstance(node, DictConfig) else None
    if not isinstance(model, DictConfig) or not isinstance(model.get("mixers"), DictConfig):
        return []
    if "*" in named or not isinstance(model.get("pattern"), ListConfig):
        return []
    dropped = [m for m in model.mixers if m not in model.pattern and m not in named]
    with open_dict(model.mixers):
        for m in dropped:
            del model.mixers[m]
    return dropped


def compose_config(config_dir: str | Path, config_name: str, overrides: list[str] = ()) -> tuple[Any, str]:
    """Compose `<config_dir>/<config_name>.yaml` with Hydra `overrides` over the registered schemas.

    Returns the typed config (dataclasses, their `__post_init__` checks run) and its resolved YAML. Every
    failure (unknown key, missing value, impossible value) is a `ConfigError` with a one-line message. Where the
    config has a `model` with `pattern` and `mixers`, `model.mixers.<mixer>.<option>=v` adds or sets an option,
    and the preset's options for mixers the final pattern does not use are dropped (`mixer_overrides`,
    `drop_preset_mixer_options`).
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    try:
        overrides, named = mixer_overrides(list(overrides))
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            node = compose(config_name=config_name, overrides=overrides)
        OmegaConf.resolve(node)
        dropped = drop_preset_mixer_options(node, named)
        if dropped:
            log.info("model.mixers: dropped the preset's options for %s, which model.pattern %s does not use",
                     dropped, list(node.model.pattern))
        missing = sorted(OmegaConf.missing_keys(node))
        if missing:
            raise ConfigError(f"{config_name}: set {', '.join(missing)} (e.g. {missing[0]}=...)")
        cfg = OmegaConf.to_object(node)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_unparsable_override(overrides) or _one_line(e)) from None
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    finally:
        GlobalHydra.instance().clear()
    return cfg, OmegaConf.to_yaml(node)
