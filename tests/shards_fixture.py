"""Prepared corpora for tests, written here with litdata's chunk writer (what litdata.optimize writes with, in
this process: a second faster) and a manifest per the contract of `attnzoo-data prepare` (docs/data.md), so the
data=shards tests do not depend on the prepare command."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from litdata import TokensLoader
from litdata.streaming.writer import BinaryWriter

from attnzoo.data.corpus import stdlib_files
from attnzoo.data.tokenizer import BPETokenizer


def write_split(out: Path, docs: list[np.ndarray], chunk_size: int) -> None:
    """One litdata TokensLoader dataset: each item one document's ids (ending with its end-of-text), chunks of
    up to `chunk_size` tokens (whole documents)."""
    out.mkdir(parents=True, exist_ok=True)
    writer = BinaryWriter(str(out), chunk_size=chunk_size, item_loader=TokensLoader())
    for i, doc in enumerate(docs):
        writer[i] = doc
    writer.done()
    writer.merge()


def write_prepared(out: Path, train: list[np.ndarray], val: list[np.ndarray], tokenizer_json: str, eos_id: int,
                   vocab_size: int, chunk_size: int = 4096, **manifest_extra) -> Path:
    """OUT as `attnzoo-data prepare` leaves it: manifest.json, tokenizer.json, train/, val/."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tokenizer_json)
    write_split(out / "train", train, chunk_size)
    write_split(out / "val", val, chunk_size)
    dtype = str(train[0].dtype)
    manifest = {
        "format": "attnzoo-shards", "version": 1, "created_by": "attnzoo tests",
        "source": {"path": "tests", "fingerprint": "0" * 64, "files": len(train) + len(val), "text_field": "text"},
        "tokenizer": {"kind": "bpe", "file": "tokenizer.json", "sha256": "0" * 64, "vocab_size": vocab_size,
                      "eos_id": eos_id},
        "dtype": dtype, "val": {"fraction": len(val) / (len(train) + len(val)), "seed": 0},
        "splits": {name: {"dir": name, "tokens": int(sum(len(d) for d in docs)), "documents": len(docs),
                          "max_document_tokens": int(max(len(d) for d in docs))}
                   for name, docs in (("train", train), ("val", val))},
        "complete": True, **manifest_extra,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return out


def text_corpus(out: Path, n_files: int = 40, vocab_size: int = 384, chunk_size: int = 4096, chars: int = 6000) -> Path:
    """A small real-text corpus: stdlib sources (each file's first `chars` characters), one document per file, a
    byte-level BPE trained on them."""
    texts = [f.read_text(errors="replace")[:chars] for f in stdlib_files()[:n_files]]
    tok = BPETokenizer.train("\n".join(texts), vocab_size)
    eos = tok.tok.token_to_id("<|endoftext|>")
    docs = [np.array(tok.encode(t) + [eos], dtype=np.uint16) for t in texts]
    n_val = max(2, len(docs) // 10)
    return write_prepared(out, docs[n_val:], docs[:n_val], tok.tok.to_str(), eos, tok.vocab_size, chunk_size)


def numbered_corpus(out: Path, n_docs: int = 60, eos: int = 0, chunk_size: int = 120) -> Path:
    """Documents of distinct token ids (a global counter from 1, each ending with `eos`), so every block of the
    stream is recognisable by its tokens; uint32 ids. The tokenizer is a stub (never used to encode)."""
    rng = np.random.default_rng(0)
    docs, nxt = [], 1
    for _ in range(n_docs):
        n = int(rng.integers(5, 60))
        docs.append(np.array(list(range(nxt, nxt + n)) + [eos], dtype=np.uint32))
        nxt += n
    stub = BPETokenizer.train("abc abd", 260).tok.to_str()
    return write_prepared(out, docs[6:], docs[:6], stub, eos, nxt, chunk_size)
