"""Typed config schemas of the cartridges commands (Hydra structured configs).

Merge order: dataclass defaults -> YAML preset in cartridges/configs/ -> command-line overrides (Hydra syntax,
e.g. `cartridges-distill data=runs/ss num_tokens=256`). Unknown keys fail in Hydra's merge; impossible values
fail in `__post_init__`. Both happen before any work starts.
"""

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zoo.config import ConfigError, compose_config
from zoo.paths import package_path

SEED_PROMPT_TYPES = (
    "structuring",
    "summarization",
    "question",
    "use_case",
    "creative",
    "generic",
    "quiz",
    "extraction",
    "recall",
)
METHODS = ("self_study", "hard_labels", "ntp")
INITS = ("first_tokens", "truncated_context", "corpus_tokens", "random", "peft", "attention_matching")
LR_SCHEDULES = ("constant", "cosine")
TARGETS = ("answers", "conversation")


def _check_device(name: str, device: str) -> None:
    if not (device in ("auto", "cpu", "cuda") or device.startswith("cuda:")):
        raise ValueError(f"{name}.device must be auto|cpu|cuda|cuda:N, got {device!r}")


def _check_precision(name: str, precision: str) -> None:
    if precision not in ("auto", "fp32", "bf16"):
        raise ValueError(f"{name}.precision must be auto|fp32|bf16, got {precision!r}")


@dataclass
class CorpusConfig:
    """Text files, a directory of .txt/.md files, or an HF dataset saved with `save_to_disk`."""

    path: str = "???"
    text_field: str = "text"  # column of an HF dataset
    min_tokens: int = 512
    max_tokens: int = 4096

    def __post_init__(self) -> None:
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"corpus needs 1 <= min_tokens <= max_tokens, got {self.min_tokens}, {self.max_tokens}")


@dataclass
class SynthesizeConfig:
    """`cartridges-synthesize`: self-study conversations with the teacher's top-k log-probs."""

    model: str = "smollm2-135m-instruct"  # known name, .gguf file or HF dir
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    output: str = "???"  # directory; the HF dataset lands in <output>/dataset
    num_conversations: int = 1024
    conversations_per_chunk: int = 8  # consecutive conversations share a chunk (prefix reuse on a server)
    seed_prompt_types: list[str] = field(
        default_factory=lambda: ["structuring", "summarization", "question", "use_case", "creative"]
    )
    max_user_tokens: int = 128  # model A's message
    max_answer_tokens: int = 256  # model B's answer
    temperature: float = 0.6  # model A; model B answers greedily
    top_logprobs: int = 20
    # also the teacher's top-k on the user turn (it read the chunk), for cartridges-distill targets=conversation
    turn_targets: bool = False
    batch_size: int = 16  # conversations per generation call; also the resume granularity
    backend: str = "transformers"  # transformers | openai
    base_url: str = "http://localhost:8000/v1"  # openai backend
    server_model: str = ""  # model name on the server; "" uses `model`
    seed: int = 0
    device: str = "auto"
    precision: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    progress: bool = True

    def __post_init__(self) -> None:
        unknown = sorted(set(self.seed_prompt_types) - set(SEED_PROMPT_TYPES))
        if unknown or not self.seed_prompt_types:
            raise ValueError(f"seed_prompt_types must be a non-empty subset of {SEED_PROMPT_TYPES}, got {unknown}")
        if self.backend not in ("transformers", "openai"):
            raise ValueError(f"backend must be transformers|openai, got {self.backend!r}")
        for name in ("num_conversations", "conversations_per_chunk", "max_user_tokens", "max_answer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.top_logprobs <= 100 or self.batch_size < 1 or self.temperature < 0:
            raise ValueError("top_logprobs must be in [1, 100], batch_size >= 1 and temperature >= 0")
        _check_device("synthesize", self.device)
        _check_precision("synthesize", self.precision)


@dataclass
class LoggerConfig:
    backend: str = "none"  # none | wandb (mirrors metrics.jsonl, never the only copy)
    project: str = "cartridges"
    mode: str = "offline"

    def __post_init__(self) -> None:
        if self.backend not in ("none", "wandb"):
            raise ValueError(f"logger.backend must be none|wandb, got {self.backend!r}")


@dataclass
class DistillConfig:
    """`cartridges-distill`: train a cartridge against a frozen model."""

    model: str = "smollm2-135m-instruct"
    data: str = ""  # a cartridges-synthesize output dir (required by self_study and hard_labels)
    corpus: CorpusConfig = field(default_factory=CorpusConfig)  # init (first_tokens) and the ntp baseline
    output: str = "???"
    method: str = "self_study"  # self_study (top-k KL) | hard_labels | ntp
    # answers: B's answer tokens are the targets | conversation: the user turn's too (data synthesized with
    # turn_targets=true), as the reference implementation distils the whole conversation
    targets: str = "answers"
    num_tokens: int = 256  # p, cartridge size
    num_frozen: int = 1
    # first_tokens | truncated_context | corpus_tokens | random | peft | attention_matching (cartridges/init.py)
    init: str = "first_tokens"
    peft_adapter: str = ""  # init=peft: a PEFT CARTRIDGE adapter directory to start from
    save_peft: bool = False  # also write <output>/peft_adapter/, the result as a PEFT adapter
    heldout_fraction: float = 0.05  # conversations held out of training, for the logged held-out KL
    lr: float = 2e-2
    lr_schedule: str = "constant"  # constant (the paper's) | cosine: lr·(1 + cos(π·step/steps))/2, for a fixed budget
    steps: int = 1000
    pack_len: int = 2048  # tokens per packed sequence
    batch_size: int = 1  # packed sequences per step
    checkpoint_every: int = 100
    log_every: int = 10
    seed: int = 0
    device: str = "auto"
    precision: str = "auto"  # auto: bf16 model on CUDA (fp32 cartridge), fp32 on CPU
    resume: bool = False
    overwrite: bool = False
    progress: bool = True
    logger: LoggerConfig = field(default_factory=LoggerConfig)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.method != "ntp" and not self.data:
            raise ValueError(f"method={self.method} needs data=<cartridges-synthesize output dir>")
        if self.targets not in TARGETS:
            raise ValueError(f"targets must be one of {TARGETS}, got {self.targets!r}")
        if self.targets == "conversation" and self.method == "ntp":
            raise ValueError("targets=conversation needs conversations: method=self_study or hard_labels")
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")
        if (self.init == "peft") != bool(self.peft_adapter):
            raise ValueError("init=peft and peft_adapter=<PEFT adapter dir> go together")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        if self.num_tokens < 1 or not 0 <= self.num_frozen <= self.num_tokens:
            raise ValueError(
                f"need num_tokens >= 1 and 0 <= num_frozen <= num_tokens ({self.num_tokens}, {self.num_frozen})"
            )
        if not self.lr > 0 or self.steps < 1 or self.pack_len < 2 or self.batch_size < 1:
            raise ValueError("lr must be > 0, steps >= 1, pack_len >= 2, batch_size >= 1")
        if self.checkpoint_every < 1 or self.log_every < 1:
            raise ValueError("checkpoint_every and log_every must be >= 1")
        if self.resume and self.overwrite:
            raise ValueError("resume and overwrite exclude each other")
        _check_device("distill", self.device)
        _check_precision("distill", self.precision)


@dataclass
class EvalConfig:
    """`python -m cartridges.eval`: QA accuracy and KV memory per arm."""

    model: str = "smollm2-135m-instruct"
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    qa: str = "???"  # JSON list of {"question", "answer", optional "aliases"}
    cartridges: dict[str, str] = field(default_factory=dict)  # arm name -> cartridge file
    truncated_tokens: list[int] = field(default_factory=list)  # one truncated-context arm per size
    arms: list[str] = field(default_factory=lambda: ["icl", "none"])  # built-in arms besides the above
    max_new_tokens: int = 48
    batch_size: int = 16
    limit: int = 0  # first N questions only (0: all)
    output: str = ""  # directory for results.json and answers.jsonl ("" prints only)
    device: str = "auto"
    precision: str = "auto"
    progress: bool = True

    def __post_init__(self) -> None:
        bad = sorted(set(self.arms) - {"icl", "none"})
        if bad:
            raise ValueError(f"arms may hold icl and none, got {bad}")
        if any(n < 1 for n in self.truncated_tokens):
            raise ValueError("truncated_tokens must be >= 1")
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.limit < 0:
            raise ValueError("max_new_tokens and batch_size must be >= 1, limit >= 0")
        _check_device("eval", self.device)
        _check_precision("eval", self.precision)


SCHEMAS = {"synthesize": SynthesizeConfig, "distill": DistillConfig, "eval": EvalConfig}


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for name, schema in SCHEMAS.items():
        cs.store(name=f"{name}_schema", node=schema)


def load_config(command: str, overrides: list[str] = ()) -> tuple[Any, str]:
    """Compose cartridges/configs/<command>.yaml (package data; `$CARTRIDGES_CONFIG_DIR` replaces the
    directory) with Hydra `overrides`: (typed config, resolved YAML)."""
    if command not in SCHEMAS:
        raise ConfigError(f"unknown command {command!r}")
    register_configs()
    env = os.environ.get("CARTRIDGES_CONFIG_DIR")
    return compose_config(Path(env) if env else package_path("cartridges", "configs"), command, overrides)


def run_command(prog: str, command: str, usage: str, work, argv: list[str] | None = None):
    """The shared shell of the cartridges commands: --help, --version, --cfg, --threads, logging, and one-line
    errors (exit 2).

    `work(cfg)` does the command's job; its result is returned (None after --help or --cfg).
    """
    import logging
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(usage)
        return None
    if "--version" in args:
        from zoo.cli import version_line

        print(version_line(prog))
        return None
    show = "--cfg" in args
    args = [a for a in args if a != "--cfg"]
    threads = 0
    if "--threads" in args:  # torch CPU threads; 0 (the default): the cores available to this process
        i = args.index("--threads")
        try:
            threads = int(args[i + 1])
        except (IndexError, ValueError):
            print(f"{prog}: error: --threads needs a whole number (0: the cores available)", file=sys.stderr)
            raise SystemExit(2) from None
        del args[i : i + 2]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        cfg, resolved = load_config(command, args)
        if show:
            print(resolved, end="")
            return None
        from zoo.device import set_threads

        set_threads(threads)
        return work(cfg)
    except ValueError as e:
        print(f"{prog}: error: {str(e).splitlines()[0]}", file=sys.stderr)
        raise SystemExit(2) from None


def to_dict(cfg: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(cfg)
