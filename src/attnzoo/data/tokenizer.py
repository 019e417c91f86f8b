"""Tokenizers: byte-level BPE trained with HF `tokenizers` on the training text, char-level, or a given
`tokenizers` file (`tokenizer.json`, e.g. an imported transformers model's own: `FileTokenizer`).

Both are cached on disk by (corpus hash, kind, vocab size) and written atomically (temp file + rename),
so concurrent processes (DDP ranks, sweep jobs) never read a half-written file.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from attnzoo.config.paths import follow_umask

if TYPE_CHECKING:
    import torch  # encode_corpus imports it: attnzoo-data refuses before torch's import (issue 45)

SPECIALS = ["<|endoftext|>"]


class CharTokenizer:
    """One id per distinct character of the training text, plus <|endoftext|> (id 0) and <unk> (id 1)."""

    kind = "char"

    def __init__(self, chars: list[str]):
        self.itos = ["<|endoftext|>", "<unk>"] + chars
        self.stoi = {c: i for i, c in enumerate(self.itos)}

    @classmethod
    def train(cls, text: str) -> "CharTokenizer":
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        return [self.stoi.get(c, 1) for c in text]

    def decode(self, ids) -> str:
        return "".join(self.itos[i] if i > 1 else "" for i in ids)

    def save(self, path: Path) -> None:
        _atomic_write(path, json.dumps({"kind": "char", "chars": self.itos[2:]}))

    @classmethod
    def load(cls, path: Path) -> "CharTokenizer":
        return cls(json.loads(Path(path).read_text())["chars"])


class BPETokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenisation, no unknown tokens) from HF `tokenizers`."""

    kind = "bpe"

    def __init__(self, tok):
        self.tok = tok

    @classmethod
    def train(cls, text: str, vocab_size: int) -> "BPETokenizer":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        chunk = 1 << 16
        tok.train_from_iterator((text[i : i + chunk] for i in range(0, len(text), chunk)), trainer=trainer)
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def encode_long(self, text: str) -> list[int]:
        """Encode a long text in line-aligned chunks, in parallel (HF's batch encoder)."""
        lines = text.splitlines(keepends=True)
        step = 2000
        chunks = ["".join(lines[i : i + step]) for i in range(0, len(lines), step)]
        ids: list[int] = []
        for enc in self.tok.encode_batch(chunks):
            ids.extend(enc.ids)
        return ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids))

    def save(self, path: Path) -> None:
        _atomic_write(path, self.tok.to_str())

    @classmethod
    def load(cls, path: Path) -> "BPETokenizer":
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))


class FileTokenizer(BPETokenizer):
    """A HF `tokenizers` JSON file as it is (any model: BPE, WordPiece, Unigram, WordLevel), e.g. the
    tokenizer.json of an imported transformers model. The text is encoded as one stream, without the special
    tokens its post-processor would add per call (a BOS at every chunk boundary)."""

    kind = "file"

    def __init__(self, tok, path: str):
        super().__init__(tok)
        self.path = path

    @classmethod
    def from_file(cls, path: str | Path) -> "FileTokenizer":
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)), str(path))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_long(self, text: str) -> list[int]:
        lines = text.splitlines(keepends=True)
        chunks = ["".join(lines[i : i + 2000]) for i in range(0, len(lines), 2000)]
        return [i for enc in self.tok.encode_batch(chunks, add_special_tokens=False) for i in enc.ids]


def file_sha(path: str | Path) -> str:
    import hashlib

    return hashlib.sha256(Path(path).expanduser().read_bytes()).hexdigest()[:16]


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    follow_umask(fd)  # a shared cache dir: readable as any other file (mkstemp makes 0600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def get_tokenizer(kind: str, text: str, vocab_size: int, cache_dir: Path, corpus_sha: str):
    """Load the cached tokenizer for this corpus + settings, or train and cache it."""
    path = Path(cache_dir).expanduser() / "tokenizers" / f"{kind}-{vocab_size if kind == 'bpe' else 0}-{corpus_sha}.json"
    cls = BPETokenizer if kind == "bpe" else CharTokenizer
    if path.exists():
        try:
            return cls.load(path)
        except Exception:  # a damaged cache entry is rebuilt, not fatal
            path.unlink(missing_ok=True)
    tok = cls.train(text, vocab_size) if kind == "bpe" else cls.train(text)
    tok.save(path)
    return tok


def encode_corpus(tok, text: str, cache_dir: Path, key: str) -> torch.Tensor:
    """Token ids of the whole text (int32), cached beside the tokenizer."""
    import torch

    path = Path(cache_dir).expanduser() / "tokens" / f"{key}.pt"
    if path.exists():
        try:
            return torch.load(path, weights_only=True)
        except Exception:
            path.unlink(missing_ok=True)
    ids = tok.encode_long(text) if hasattr(tok, "encode_long") else tok.encode(text)
    t = torch.tensor(ids, dtype=torch.int32)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    follow_umask(fd)
    os.close(fd)
    torch.save(t, tmp)
    os.replace(tmp, path)
    return t
