"""The tokenizer side of `attnzoo-data prepare` (attnzoo.data.prepare): which tokenizer (trained byte-level BPE,
a tokenizer.json, a model directory's), its end-of-text id and shard dtype, `EncodeUnits`, the function
litdata's worker processes run over units (HF `tokenizers` batch encoder, one item per document), and the
progress of the long steps (`Progress`: sampling and training the BPE, tokenizing)."""
from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np

from attnzoo.config.errors import ConfigError
from attnzoo.data.sources import documents, is_val
from attnzoo.data.tokenizer import READING, BPETokenizer

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


def train_bpe(units: list[dict], o: PrepareOptions, src: str = "SRC"):
    """Byte-level BPE (attnzoo.data.tokenizer.BPETokenizer, with <|endoftext|>) on a sample of the documents:
    an equal share of `sample_bytes` from every unit in turn, at most `sample_docs` documents. Both steps report
    their progress (`o.progress`)."""
    every, t0 = progress_every(o), time.time()
    if every is not None:
        print(f"attnzoo-data: training a {o.vocab_size}-token byte-level BPE on a sample of {src}", file=sys.stderr)
    share = max(1 << 16, o.sample_bytes // max(1, len(units)))
    sample, size = [], 0
    reading = Progress("attnzoo-data: sampling the source", min(o.sample_bytes, sum(u["bytes"] for u in units)),
                       "characters", every)
    for unit in units:
        taken = 0
        for _, text in documents(unit, o.text_field, o.txt_docs):
            sample.append(text)
            taken += len(text)
            size += len(text)
            reading.update(size)
            if taken >= share or size >= o.sample_bytes or len(sample) >= o.sample_docs:
                break
        if size >= o.sample_bytes or len(sample) >= o.sample_docs:
            break
    reading.close()
    stage: list = [None]  # the open stage's Progress

    def heard(name: str, done: int, total: int) -> None:
        if stage[0] is None or stage[0].what != f"attnzoo-data: training BPE: {name}":
            if stage[0] is not None:
                stage[0].close()
            unit = "characters" if name == READING else "merges" if "merge" in name else "words"
            stage[0] = Progress(f"attnzoo-data: training BPE: {name}", total, unit, every)
        stage[0].update(done)

    tok = BPETokenizer.train("\n\n".join(sample), o.vocab_size, heard if every is not None else None).tok
    if stage[0] is not None:
        stage[0].close()
    if every is not None:
        print(f"attnzoo-data: BPE trained in {time.time() - t0:.1f} s", file=sys.stderr)
    return tok


# ----------------------------------------------------------------------------- progress

PROGRESS_EVERY = 10.0  # seconds between progress lines where stderr is not a terminal (PrepareOptions.progress)


def progress_every(o: PrepareOptions) -> Optional[float]:
    """The seconds between progress lines that `o.progress` asks for (True: PROGRESS_EVERY); None: no progress."""
    if o.progress is False:
        return None
    return PROGRESS_EVERY if o.progress is True else float(o.progress)


def _duration(seconds: float) -> str:
    s = round(seconds)
    return f"{s} s" if s < 60 else f"{s // 60} min {s % 60:02d} s" if s < 3600 else f"{s // 3600} h {s % 3600 // 60:02d} min"


class Progress:
    """A long step's progress on stderr, with its rate and ETA. On a terminal, tqdm's bar; anywhere else (a log
    file, a pipe: where a bar draws once at 0% and once at 100%) a line when it starts, one every `every`
    seconds and one when it ends, so that a log follows it too:

        attnzoo-data: tokenizing: 12.6 MB of 47.4 MB (27%), 1.05 MB/s, ETA 33 s

    `every=None`: silent. `update(done)` sets the amount done so far (from any one thread at a time); `clock`
    and `stream` are injectable (tests)."""

    def __init__(self, what: str, total: float, unit: str = "B", every: Optional[float] = PROGRESS_EVERY,
                 stream=None, clock=time.monotonic):
        self.what, self.total, self.unit, self.every, self.clock = what, total, unit, every, clock
        self.stream = stream if stream is not None else sys.stderr
        self.start = self.said = clock()
        self.done, self.bar = 0, None
        if every is not None and getattr(self.stream, "isatty", lambda: False)():
            from tqdm.auto import tqdm  # the bar (a dependency of datasets and litdata)

            self.bar = tqdm(total=total, unit=unit, unit_scale=True, unit_divisor=1000, desc=what, file=self.stream)
        elif every is not None:
            self._say(f"{what}: {self._amount(total)} to go")

    def _amount(self, n: float) -> str:
        """47.4 MB, 992 kB; 21,506 words, 4.98M characters."""
        k = next(i for i in (3, 2, 1, 0) if n >= 1000 ** i or i == 0)
        if self.unit == "B":
            return f"{n / 1000 ** k:.3g} {' kMG'[k].strip()}B"
        return f"{n:,.0f} {self.unit}" if k < 2 else f"{n / 1000 ** k:.3g}{' kMG'[k]} {self.unit}"

    def _say(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def update(self, done: float) -> None:
        self.done = done
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
        elif self.every is not None and self.clock() - self.said >= self.every:
            self.said = self.clock()
            elapsed = max(self.said - self.start, 1e-9)
            rate = done / elapsed
            eta = _duration((self.total - done) / rate) if rate > 0 else "unknown"
            share = f" ({100 * done / self.total:.0f}%)" if self.total else ""
            self._say(f"{self.what}: {self._amount(done)} of {self._amount(self.total)}{share}, "
                      f"{self._amount(rate)}/s, ETA {eta}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.every is not None:
            elapsed = max(self.clock() - self.start, 1e-9)
            self._say(f"{self.what}: done, {self._amount(self.done)} in {_duration(elapsed)} "
                      f"({self._amount(self.done / elapsed)}/s)")


VAL_PASS_SHARE = 0.2  # of a part's work: the val pass reads every document but encodes few (measured: ~1/5)


@contextlib.contextmanager
def tokenizing(total: int, splits: list[str], o: PrepareOptions):
    """The tokenizing step's progress over `total` bytes of source, read once per split: yields ({split: the counter
    of characters its workers have read}, `part_done(nbytes)` to call when a part is finished). A thread reads
    the counters; the progress is in bytes of source, a part's val pass counted as VAL_PASS_SHARE of its work."""
    read = {split: multiprocessing.Value("q", 0) for split in splits}
    share = {split: VAL_PASS_SHARE if split == "val" else 1 - VAL_PASS_SHARE * ("val" in splits) for split in splits}
    base = [0.0]
    progress = Progress("attnzoo-data: tokenizing", total, "B", progress_every(o))
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(min(max(progress.every or 1.0, 0.05), 1.0)):
            progress.update(base[0] + min(sum(share[s] * read[s].value for s in splits), total - base[0]))

    def part_done(nbytes: int) -> None:
        base[0] += nbytes
        for counter in read.values():
            counter.value = 0
        progress.update(base[0])

    watcher = threading.Thread(target=watch, daemon=True)
    if progress.every is not None:
        watcher.start()
    try:
        yield read, part_done
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join()
        progress.close()


# ----------------------------------------------------------------------------- the workers


class EncodeUnits:
    """litdata's `fn`: one unit index in, that unit's documents of one split out (ids + EOS, manifest dtype).
    Picklable; the tokenizer is loaded once per worker process."""

    def __init__(self, units: list[dict], tokenizer: str, val: bool, o: PrepareOptions, dtype: str, eos: int,
                 read=None):
        self.units, self.tokenizer, self.val, self.dtype, self.eos = units, tokenizer, val, dtype, eos
        self.fraction, self.seed, self.field, self.txt_docs = o.val_fraction, o.seed, o.text_field, o.txt_docs
        self.read = read  # a shared counter (multiprocessing.Value) of the characters read, for the progress
        self._tok = None

    def __call__(self, index: int):
        if self._tok is None:
            from tokenizers import Tokenizer  # per worker process

            self._tok = Tokenizer.from_file(self.tokenizer)
        batch, chars, unread = [], 0, 0
        for key, text in documents(self.units[index], self.field, self.txt_docs):
            unread += len(text)
            if unread >= 1 << 20:
                self._count(unread)
                unread = 0
            if is_val(key, self.fraction, self.seed) != self.val:
                continue
            batch.append(text)
            chars += len(text)
            if chars >= 1 << 20 or len(batch) >= 4096:
                yield from self._encode(batch)
                batch, chars = [], 0
        yield from self._encode(batch)
        self._count(unread)

    def _count(self, n: int) -> None:
        if self.read is not None:
            with self.read.get_lock():
                self.read.value += n

    def _encode(self, texts: list[str]):
        if not texts:
            return
        for enc in self._tok.encode_batch_fast(texts, add_special_tokens=False):
            ids = enc.ids
            arr = np.empty(len(ids) + 1, dtype=self.dtype)
            arr[:-1] = ids
            arr[-1] = self.eos
            yield arr
