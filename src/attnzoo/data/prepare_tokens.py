"""The tokenizer side of `attnzoo-data prepare` (attnzoo.data.prepare): which tokenizer (trained byte-level BPE,
a tokenizer.json, a model directory's), its end-of-text id and shard dtype, and `EncodeUnits`, the function
litdata's worker processes run over units (HF `tokenizers` batch encoder, one item per document)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np

from attnzoo.config.errors import ConfigError
from attnzoo.data.sources import documents, is_val
from attnzoo.data.tokenizer import BPETokenizer

if TYPE_CHECKING:  # annotations only (prepare imports this module)
    from attnzoo.data.prepare import PrepareOptions

EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")
MAX_VOCAB = 2**32


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tokenizer_source(o: PrepareOptions) -> tuple[Optional[Path], dict]:
    """(the tokenizer.json given, None for bpe; what identifies the tokenizer for the same-OUT check)."""
    if o.tokenizer == "bpe":
        return None, {"kind": "bpe", "vocab_size": o.vocab_size, "sample_docs": o.sample_docs,
                      "sample_bytes": o.sample_bytes, "eos_token": o.eos_token}
    field = f"--tokenizer-{o.tokenizer}"
    given = Path(o.tokenizer_file if o.tokenizer == "file" else o.tokenizer_model).expanduser()
    path = given if o.tokenizer == "file" else given / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; allowed: " + ("a HF tokenizers JSON (tokenizer.json)"
                          if o.tokenizer == "file" else "a transformers model directory with tokenizer.json"),
                          field=field)
    return path, {"kind": o.tokenizer, "sha256": file_sha256(path), "eos_token": o.eos_token}


def load_tokenizer(path: Path, field: str):
    from tokenizers import Tokenizer  # the Rust tokenizer; only prepare and its workers need it

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise ConfigError(f"{path} is not a tokenizers JSON ({str(e).splitlines()[0][:100]})", field=field) from None


def eos_of(tok, path: Path, o: PrepareOptions, field: str) -> int:
    """The end-of-text id: --eos-token, else the model directory's eos_token, else a known end-of-text name."""
    names = [o.eos_token] if o.eos_token else []
    conf = path.parent / "tokenizer_config.json"
    if not names and conf.is_file():
        eos = json.loads(conf.read_text()).get("eos_token")
        names += [eos.get("content") if isinstance(eos, dict) else eos] if eos else []
    names += [] if o.eos_token else list(EOS_NAMES)
    for name in names:
        if name and tok.token_to_id(name) is not None:
            return tok.token_to_id(name)
    raise ConfigError(f"{path} has no end-of-text token (none of {', '.join(names)}); allowed: --eos-token TOKEN "
                      f"(a token of its vocabulary)", field=field)


def vocab_size_of(tok) -> int:
    return tok.get_vocab_size(with_added_tokens=True)


def dtype_for(vocab: int) -> str:
    if vocab > MAX_VOCAB:
        raise ConfigError(f"the tokenizer has {vocab:,} ids, over uint32 ({MAX_VOCAB:,}); allowed: a vocabulary "
                          f"of at most 2**32 ids", field="--tokenizer")
    return "uint16" if vocab <= 2**16 else "uint32"


def train_bpe(units: list[dict], o: PrepareOptions):
    """Byte-level BPE (attnzoo.data.tokenizer.BPETokenizer, with <|endoftext|>) on a sample of the documents:
    an equal share of `sample_bytes` from every unit in turn, at most `sample_docs` documents."""
    share = max(1 << 16, o.sample_bytes // max(1, len(units)))
    sample, size = [], 0
    for unit in units:
        taken = 0
        for _, text in documents(unit, o.text_field, o.txt_docs):
            sample.append(text)
            taken += len(text)
            size += len(text)
            if taken >= share or size >= o.sample_bytes or len(sample) >= o.sample_docs:
                break
        if size >= o.sample_bytes or len(sample) >= o.sample_docs:
            break
    return BPETokenizer.train("\n\n".join(sample), o.vocab_size).tok


# ----------------------------------------------------------------------------- the workers


class EncodeUnits:
    """litdata's `fn`: one unit index in, that unit's documents of one split out (ids + EOS, manifest dtype).
    Picklable; the tokenizer is loaded once per worker process."""

    def __init__(self, units: list[dict], tokenizer: str, val: bool, o: PrepareOptions, dtype: str, eos: int):
        self.units, self.tokenizer, self.val, self.dtype, self.eos = units, tokenizer, val, dtype, eos
        self.fraction, self.seed, self.field, self.txt_docs = o.val_fraction, o.seed, o.text_field, o.txt_docs
        self._tok = None

    def __call__(self, index: int):
        if self._tok is None:
            from tokenizers import Tokenizer  # per worker process

            self._tok = Tokenizer.from_file(self.tokenizer)
        batch, chars = [], 0
        for key, text in documents(self.units[index], self.field, self.txt_docs):
            if is_val(key, self.fraction, self.seed) != self.val:
                continue
            batch.append(text)
            chars += len(text)
            if chars >= 1 << 20 or len(batch) >= 4096:
                yield from self._encode(batch)
                batch, chars = [], 0
        yield from self._encode(batch)

    def _encode(self, texts: list[str]):
        if not texts:
            return
        for enc in self._tok.encode_batch_fast(texts, add_special_tokens=False):
            ids = enc.ids
            arr = np.empty(len(ids) + 1, dtype=self.dtype)
            arr[:-1] = ids
            arr[-1] = self.eos
            yield arr
