"""Tokenizers: byte-level BPE trained with HF `tokenizers` on the training text, char-level, or a given
`tokenizers` file (`tokenizer.json`, e.g. an imported transformers model's own: `FileTokenizer`).

Both are cached on disk by (corpus hash, kind, vocab size) and written atomically (temp file + rename),
so concurrent processes (DDP ranks, sweep jobs) never read a half-written file.
"""
from __future__ import annotations

import json
import os
import re
import sys
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
    def train(cls, text: str, vocab_size: int, progress=None) -> "BPETokenizer":
        """Train on `text`. `progress(stage, done, total)`, when given, hears every stage: 'reading the text'
        (characters), then the trainer's own 'tokenize words', 'count pairs', 'compute merges' (`_train_watched`)."""
        if progress is not None and hasattr(os, "fork") and sys.platform != "win32":
            return cls(_train_watched(text, vocab_size, progress))
        tok, trainer = _bpe(vocab_size, show_progress=False)
        tok.train_from_iterator(_chunks(text, progress), trainer=trainer)
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


def _bpe(vocab_size: int, show_progress: bool):
    """An untrained byte-level BPE and its trainer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    return tok, trainer


READING = "reading the text"
CHUNK = 1 << 16  # characters per piece handed to the trainer
_BAR = re.compile(r"\]\s+(\S.*?)\s+[^\x00-\x7f]*\s*(\d+)\s*/\s*(\d+)\s*$")  # [00:00:05] Compute merges ███░ 4315 / 8192


def _chunks(text: str, progress=None):
    """The text in pieces for the trainer, reporting the characters handed over."""
    for i in range(0, len(text), CHUNK):
        yield text[i : i + CHUNK]
        if progress is not None:
            progress(READING, min(i + CHUNK, len(text)), len(text))


def _train_watched(text: str, vocab_size: int, progress):
    """Train in a forked child whose stderr is a pseudo-terminal, so that the Rust trainer draws its progress bars
    (it draws none when stderr is not a terminal: a log, a pipe) and this process reads them: every stage's count
    and total go to `progress`, wherever this process' own output goes ('pre-processing sequences', the pieces of
    the text read, as READING in characters). Returns the trained `tokenizers.Tokenizer`."""
    import pty
    import signal

    from tokenizers import Tokenizer

    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    master, slave = pty.openpty()
    pid = os.fork()
    if pid == 0:  # the child: train, write the tokenizer, exit without running the parent's exit handlers
        code = 1
        try:
            os.close(master)
            os.dup2(slave, 1)
            os.dup2(slave, 2)
            tok, trainer = _bpe(vocab_size, show_progress=True)
            tok.train_from_iterator(_chunks(text), trainer=trainer)
            Path(out).write_text(tok.to_str())
            code = 0
        except BaseException:  # noqa: BLE001 - reported to the parent through the terminal, which raises it
            import traceback

            os.write(2, traceback.format_exc().encode())
        finally:
            os._exit(code)
    os.close(slave)
    said, last = [], ["", 0, 0]

    def heard(raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").strip()
        if not (m := _BAR.search(line)):
            said.append(line) if line else None
            return
        stage, done, total = m.group(1), int(m.group(2)), int(m.group(3))
        if stage == "Pre-processing sequences":  # pieces of the text done, of an unknown total (its final draw
            if done:  # reads 0 / 0)
                progress(READING, min(done * CHUNK, len(text)), len(text))
        elif total and done <= total and (stage == last[0] or [done, total] != last[1:]):  # a new bar's first
            progress(stage.lower(), done, total)  # draw may show the last one's count
        last[:] = [stage, done, total]

    buf = b""
    try:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child has exited, its end of the terminal closed
                break
            if not data:
                break
            # a bar redraws after \r or a terminal escape (clear the line) and the next starts right after the last
            # one's final draw ('... 0 / 0[00:00:00] Tokenize words'); a line ends with \n
            *lines, buf = re.split(rb"[\r\n]|\x1b\[[0-9;?]*[A-Za-z]|(?=\[\d+:\d\d:\d\d\])", buf + data)
            for raw in lines:
                heard(raw)
        heard(buf)
        _, status = os.waitpid(pid, 0)
        pid = 0
        if status != 0:
            raise RuntimeError("training the BPE failed: " + " | ".join(said[-6:]))
        return Tokenizer.from_str(Path(out).read_text())
    finally:
        if pid:  # interrupted (Ctrl-C): the child goes too
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(master)
        Path(out).unlink(missing_ok=True)


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
