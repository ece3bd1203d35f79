"""Corpus loading, chat formatting and chunking.

A corpus is a list of documents (text files, a directory of them, or an HF dataset on disk). The model reads a
document as the system message of its chat template; `context_ids` renders that prefix and `turn_ids` renders
the turns that follow it. The same helpers serve self-study (the teacher reads chunk + turns), distillation
(the student reads cartridge + turns) and evaluation, so all three see identical token ids.
"""

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md")
CONTEXT_INSTRUCTION = "Answer questions using the following document.\n\n"


class CorpusError(ValueError):
    """The corpus cannot be read or is too short for the requested chunks."""


def load_texts(path: str | Path, text_field: str = "text") -> list[tuple[str, str]]:
    """(name, text) of every document: a text file, a directory of .txt/.md files (sorted), or an HF dataset
    saved with `save_to_disk` (one document per row of `text_field`)."""
    path = Path(path).expanduser()
    if path.is_file():
        return [(path.name, path.read_text())]
    if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
        import datasets

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
        if text_field not in ds.column_names:
            raise CorpusError(f"dataset {path} has no column {text_field!r} (columns: {ds.column_names})")
        return [(f"{path.name}[{i}]", t) for i, t in enumerate(ds[text_field]) if t]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise CorpusError(f"directory {path} holds no {'/'.join(TEXT_SUFFIXES)} files")
        return [(str(p.relative_to(path)), p.read_text()) for p in files]
    raise CorpusError(f"corpus {path} is neither a file, a directory nor an HF dataset on disk")


def corpus_hash(texts: list[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for name, text in texts:
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


def render(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def system_message(document: str) -> dict[str, str]:
    return {"role": "system", "content": CONTEXT_INSTRUCTION + document}


def context_ids(tokenizer, document: str) -> list[int]:
    """The chat-template prefix holding `document` as the system message: what ICL puts in the KV cache."""
    return render(tokenizer, [system_message(document)])


def turn_ids(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> list[int]:
    """Tokens of user/assistant `messages` as they follow a context prefix (no system message of their own).

    Rendered after a placeholder system message and cut off, so templates that insert a default system prompt
    (SmolLM2's does) add nothing here. Raises if the template does not render the prefix unchanged.
    """
    prefix = render(tokenizer, [system_message("")])
    full = render(tokenizer, [system_message(""), *messages], add_generation_prompt=add_generation_prompt)
    if full[: len(prefix)] != prefix:
        raise CorpusError("the chat template does not render the system message as a fixed prefix")
    return full[len(prefix) :]


@dataclass
class Chunk:
    doc: int
    start: int
    end: int
    text: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.start}:{self.end}"


class Corpus:
    """Tokenized documents; chunks are token spans decoded back to text."""

    def __init__(self, texts: list[tuple[str, str]], tokenizer, min_tokens: int = 512, max_tokens: int = 4096):
        if not texts:
            raise CorpusError("the corpus holds no documents")
        if not 1 <= min_tokens <= max_tokens:
            raise CorpusError(f"need 1 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
        self.texts = texts
        self.tokenizer = tokenizer
        self.min_tokens, self.max_tokens = min_tokens, max_tokens
        self.tokens = [list(tokenizer.encode(text, add_special_tokens=False)) for _, text in texts]
        self.hash = corpus_hash(texts)
        self._eligible = [i for i, t in enumerate(self.tokens) if len(t) >= min_tokens]
        if not self._eligible:
            longest = max(len(t) for t in self.tokens)
            raise CorpusError(f"no document reaches min_tokens={min_tokens} (longest: {longest} tokens)")

    @classmethod
    def from_path(cls, path, tokenizer, min_tokens=512, max_tokens=4096, text_field="text") -> "Corpus":
        return cls(load_texts(path, text_field), tokenizer, min_tokens, max_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    def full_text(self) -> str:
        return "\n\n".join(text for _, text in self.texts)

    def chunk(self, doc: int, start: int, end: int) -> Chunk:
        return Chunk(doc, start, end, self.tokenizer.decode(self.tokens[doc][start:end]))

    def sample_chunk(self, rng: random.Random) -> Chunk:
        """A span of min..max tokens at a random place of a random document long enough for min_tokens.

        The span is drawn over the document extended by its length on both sides and then clipped (never below
        min_tokens), so a document's first and last tokens are covered about as often as its middle: uniform
        starts in [0, n - length] would cover token 0 only when the start is exactly 0."""
        doc = rng.choice(self._eligible)
        n = len(self.tokens[doc])
        length = rng.randint(self.min_tokens, min(self.max_tokens, n))
        start = rng.randint(self.min_tokens - length, n - self.min_tokens)
        start, end = max(0, start), min(n, start + length)
        return self.chunk(doc, start, end)

    def coverage(self, chunks: list[Chunk]) -> dict[str, float]:
        """How often the chunks cover each corpus token: min, mean, and the fraction never covered."""
        counts = [[0] * len(t) for t in self.tokens]
        for c in chunks:
            row = counts[c.doc]
            for i in range(c.start, c.end):
                row[i] += 1
        flat = [x for i in self._eligible for x in counts[i]]
        if not flat:
            return {"min": 0.0, "mean": 0.0, "uncovered_fraction": 1.0}
        return {
            "min": float(min(flat)),
            "mean": sum(flat) / len(flat),
            "uncovered_fraction": sum(x == 0 for x in flat) / len(flat),
        }

    def windows(self) -> list[list[int]]:
        """Consecutive spans of max_tokens of every document; a tail shorter than min_tokens is dropped."""
        out = []
        for toks in self.tokens:
            for start in range(0, len(toks), self.max_tokens):
                piece = toks[start : start + self.max_tokens]
                if len(piece) >= self.min_tokens:
                    out.append(piece)
        return out


def left_pad(prompts: list[list[int]], pad_id: int):
    """Token-id prompts as one left-padded batch: (ids [B, W], attention mask [B, W] of 0/1), both long."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    return ids, mask
