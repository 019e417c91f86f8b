"""Text corpora: the embedded default (this Python's own standard-library sources) or a user file/folder."""
from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import Optional

from attnzoo.config.errors import ConfigError

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".json", ".csv", ".tex", ".html", ".c", ".h")


def stdlib_files() -> list[Path]:
    """Top-level `.py` files of the running interpreter's standard library, sorted by name.

    Present on every machine with Python and no download needed; the exact text depends on the
    Python version, so runs record the corpus hash (`data/corpus_sha`)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def load_corpus(path: Optional[str], max_chars: Optional[int]) -> tuple[str, str]:
    """Return (text, source description). `path` None = embedded stdlib corpus; else a file or a folder
    (every text file under it, sorted), its files joined by a blank line. One-line ConfigError when missing."""
    parts, source = load_documents(path, max_chars)
    return "\n\n".join(parts), source


def load_documents(path: Optional[str], max_chars: Optional[int]) -> tuple[list[str], str]:
    """(one text per file, source description), `max_chars` counted as in `load_corpus` (the joined text's
    first max_chars characters: the last document is cut there)."""
    if path is None:
        files, source = stdlib_files(), "python-stdlib"
    else:
        p = Path(path).expanduser()
        if not p.exists():
            raise ConfigError(f"{path} does not exist; allowed: a text file or a folder of text files", field="data.path")
        if p.is_file():
            files = [p]
        else:
            files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
            if not files:
                raise ConfigError(f"{path} holds no text files; allowed: {', '.join(TEXT_SUFFIXES)}", field="data.path")
        source = str(p)
    parts, total = [], 0
    for f in files:
        raw = f.read_bytes()
        nul = raw.find(b"\0", 0, 1 << 16)  # text files never hold NUL bytes; binaries (images, archives, .pt) do
        if nul >= 0:
            raise ConfigError(f"{f} is a binary file (NUL byte at offset {nul}); allowed: UTF-8 text files",
                              field="data.path")
        text = raw.decode("utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if max_chars is not None and total >= max_chars:
            break
    if max_chars is not None:  # cut where the joined text (2 separator characters per file) reaches max_chars
        room, kept = max_chars, []
        for text in parts:
            if room <= 0:
                break
            kept.append(text[:room])
            room -= len(text) + 2
        parts = kept
    if not "".join(parts).strip():
        raise ConfigError(f"{source} is empty; allowed: a non-empty text", field="data.path")
    return parts, source


def cap_notice(path: Optional[str], max_chars: Optional[int], kept: str) -> Optional[str]:
    """The one line a run prints when data.max_chars cut a user's data.path (the embedded corpus is capped by
    design): how much it kept, and the way to train on all of it. None when nothing was cut."""
    if path is None or max_chars is None or len(kept) < max_chars:
        return None
    p = Path(path).expanduser()
    files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES]
    size = sum(f.stat().st_size for f in files)
    return (f"attnzoo: data.path={path} ({size / 1e6:,.1f} MB) is longer than data.max_chars={max_chars:,} characters: "
            f"training on its first {max_chars:,} only; for all of it, stream it: `attnzoo-data prepare {path} OUT` "
            f"then data=shards data.path=OUT (or data.max_chars=null, read whole into memory)")


def text_sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", errors="replace")).hexdigest()[:16]
