"""`attnzoo-data prepare SRC OUT`: a source tokenized once into litdata token shards (the contract of issue 27,
docs/data.md) that `data=shards` streams.

    prepare("corpus/", "prepared/", num_workers=2)   # -> the manifest (a dict); read_manifest("prepared/")

How: the source is cut into units (attnzoo.data.sources) and the units grouped into parts. Each part is one
`litdata.optimize` call per split over its units, in `num_workers` processes; a worker reads a unit's documents,
keeps those of its split (`is_val`, by document key) and encodes them in batches with the Rust batch encoder of a
HF `tokenizers` Tokenizer; each document is one item (its ids, then EOS). A part is written into OUT/.work/tmp-K
and renamed to OUT/.work/parts/K once both splits are complete, so a SIGKILL loses at most the parts in
flight: the same command resumes from the finished parts. At the end the parts' chunks are hard-linked into
OUT/train and OUT/val under one index.json each, tokenizer.json is copied, and manifest.json is written last
(temp file + rename): a folder with a manifest is complete.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, fields, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Optional

import numpy as np

from attnzoo.data._manifest_shape import PREPARED_WITH, manifest_damage as _manifest_damage
from attnzoo.config.errors import ConfigError, check, check_choice
from attnzoo.config.paths import follow_umask
from attnzoo.data.sources import (ALLOWED_SRC, SUFFIXES, TXT_DOCS, check_file, documents, fingerprint_files,
                                  input_files, is_dataset_dir, is_val, open_dataset, plan_dataset_units, plan_units)
from attnzoo.data.prepare_tokens import (EncodeUnits, dtype_for, eos_of, file_sha256, load_tokenizer, tokenizer_source,
                                         tokenizing, train_bpe, vocab_size_of)
from attnzoo.data.tokenizer import SPECIALS

FORMAT, VERSION = "attnzoo-shards", 1
SPLITS = ("train", "val")


@dataclass
class PrepareOptions:
    """The knobs of `prepare` (the CLI's options, same names with dashes)."""

    # bpe (trained on a sample of SRC) | file (tokenizer_file) | model (tokenizer_model); None: the one whose
    # source is given (file / model), else bpe, as the CLI infers it
    tokenizer: Optional[str] = None
    tokenizer_file: Optional[str] = None  # a HF tokenizers JSON (tokenizer.json)
    tokenizer_model: Optional[str] = None  # a transformers model directory with tokenizer.json (model.init_from)
    eos_token: Optional[str] = None  # the end-of-text token; None: the tokenizer's own (EOS_NAMES, eos_token)
    vocab_size: int = 32768  # bpe: the vocabulary learned
    sample_docs: int = 200_000  # bpe: at most this many documents of SRC train it ...
    sample_bytes: int = 64_000_000  # ... and at most this many characters
    text_field: str = "text"  # the field / column of .jsonl, .jsonl.zst, .parquet and datasets sources
    txt_docs: str = "blank"  # a .txt document: blank (blank-line separated blocks) | line | file
    split: str = "train"  # the split of a DatasetDict / hub dataset
    val_fraction: float = 0.005  # documents held out for validation (drawn by document key, seeded)
    seed: int = 0
    num_workers: int = 2  # tokenizer processes
    unit_bytes: int = 64 << 20  # the resumable grain: large files are cut into units of about this many bytes
    chunk_bytes: int = 64 << 20  # litdata chunk size on disk
    # progress of the long steps on stderr, with rate and ETA: True (a bar on a terminal, elsewhere a line every
    # 10 s), seconds between those lines, or False (none)
    progress: bool | float = True

    def validate(self) -> None:
        if self.tokenizer is None:
            self.tokenizer = "file" if self.tokenizer_file else "model" if self.tokenizer_model else "bpe"
        check_choice(self.tokenizer, "--tokenizer", ("bpe", "file", "model"))
        # a second tokenizer source was silently ignored (--tokenizer-file beside --tokenizer-model: the file won)
        for kind, given, flag in (("file", self.tokenizer_file, "--tokenizer-file"),
                                  ("model", self.tokenizer_model, "--tokenizer-model")):
            check(given is None or self.tokenizer == kind, flag, f"given with --tokenizer {self.tokenizer}, which "
                  f"does not read it; allowed: one tokenizer source (--tokenizer-file or --tokenizer-model, or "
                  f"neither for bpe)")
        if self.tokenizer == "file":
            check(self.tokenizer_file is not None, "--tokenizer-file", "a tokenizer.json path is needed with "
                  "--tokenizer file")
        if self.tokenizer == "model":
            check(self.tokenizer_model is not None, "--tokenizer-model", "a model directory is needed with "
                  "--tokenizer model")
        if self.tokenizer == "bpe":
            check(self.vocab_size >= 260, "--vocab-size", f"got {self.vocab_size}; allowed: >= 260 (256 bytes + "
                  f"specials)")
            # the BPE trained here has one special token, its end of text (was: refused after training it)
            check(self.eos_token in (None, *SPECIALS), "--eos-token", f"{self.eos_token!r} is not a special token "
                  f"of the BPE --tokenizer bpe trains; allowed: {', '.join(SPECIALS)}, or omit it")
        check(self.sample_docs >= 1, "--sample-docs", f"got {self.sample_docs}; allowed: >= 1")
        check(self.sample_bytes >= 1, "--sample-bytes", f"got {self.sample_bytes}; allowed: >= 1")
        check_choice(self.txt_docs, "--txt-docs", TXT_DOCS)
        check(0.0 <= self.val_fraction < 1.0, "--val-fraction", f"got {self.val_fraction}; allowed: 0 <= f < 1")
        check(self.num_workers >= 1, "--num-workers", f"got {self.num_workers}; allowed: >= 1")
        check(self.unit_bytes >= 1024, "--unit-bytes", f"got {self.unit_bytes}; allowed: >= 1024")
        check(self.chunk_bytes >= 1024, "--chunk-bytes", f"got {self.chunk_bytes}; allowed: >= 1024")
        check(isinstance(self.progress, bool) or isinstance(self.progress, (int, float)) and self.progress >= 0,
              "--progress-every", f"got {self.progress!r}; allowed: seconds >= 0")


# ----------------------------------------------------------------------------- manifest


def read_manifest(out: str | Path) -> dict:
    """The manifest of a prepared folder; one-line ConfigError (field OUT) when `out` is not one."""
    out = Path(out).expanduser()
    path = out / "manifest.json"
    if not path.is_file():
        what = "does not exist" if not out.exists() else "is a file" if not out.is_dir() else "has no manifest.json"
        raise ConfigError(f"{out} {what}: not a prepared folder; allowed: a folder written by attnzoo-data prepare",
                          field="OUT")
    try:
        m = json.loads(path.read_text())
    except ValueError:
        raise ConfigError(f"{path} is not JSON; allowed: a folder written by attnzoo-data prepare", field="OUT") \
            from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ConfigError(f"{path} is not an {FORMAT} manifest", field="OUT")
    if not isinstance(m.get("version"), int) or m["version"] > VERSION:
        raise ConfigError(f"{path} is version {m.get('version')} ({m.get('created_by')}); this attnzoo reads "
                          f"version <= {VERSION}; allowed: a newer attnzoo, or prepare it again", field="OUT")
    if m.get("complete") is not True:
        raise ConfigError(f"{path} is not complete; allowed: run attnzoo-data prepare again to finish it",
                          field="OUT")
    damage = _manifest_damage(m)
    if damage:
        raise ConfigError(f"{path} is damaged ({damage}); allowed: a folder written by attnzoo-data prepare "
                          f"(prepare it again)", field="OUT")
    return m


def describe(m: dict) -> str:
    """The manifest in a few readable lines (attnzoo-data info)."""
    tok, src = m["tokenizer"], m["source"]
    lines = [f"format      {m['format']} v{m['version']} ({m.get('created_by', '?')})",
             f"source      {src['path']} ({src['files']} files, text field {src['text_field']!r}, "
             f"fingerprint {src['fingerprint'][:16]})",
             f"tokenizer   {tok['kind']}: {tok['file']} (vocab {tok['vocab_size']:,}, eos id {tok['eos_id']}, "
             f"sha256 {tok['sha256'][:16]})",
             f"dtype       {m['dtype']}",
             f"val         {m['val']['fraction']} of documents (seed {m['val']['seed']})"]
    for name, s in m["splits"].items():
        lines.append(f"{name:<12}{s['tokens']:,} tokens, {s['documents']:,} documents ({s['dir']}/)")
    return "\n".join(lines)


def _atomic_json(path: Path, obj: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    follow_umask(fd)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def created_by() -> str:
    try:
        return f"attnzoo {version('attnzoo')}"
    except PackageNotFoundError:
        return "attnzoo"


# ----------------------------------------------------------------------------- source and tokenizer


def resolve_source(src: str, o: PrepareOptions) -> tuple[dict, list[dict]]:
    """(the manifest's source record, the units) of SRC; one-line refusals for what cannot be read."""
    if src.startswith("hf:"):
        name = src[3:]
        fp = hashlib.sha256(f"hub:{name}:{o.split}".encode()).hexdigest()
        unit = {"kind": "hub", "path": name, "split": o.split, "rel": "", "start": 0, "end": 0, "bytes": 0}
        try:  # reachable (or in the local cache offline) before any work: a missing one is one line, not a traceback
            open_dataset(unit)
        except Exception as e:  # noqa: BLE001 - datasets / huggingface_hub raise many types (ConnectionError, ...)
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ConfigError(f"{src} cannot be opened from the Hugging Face hub ({why}); allowed: a hub dataset this "
                              f"machine reaches (or has in its datasets cache, with HF_HUB_OFFLINE=1), or a local "
                              f"copy: {ALLOWED_SRC.replace(', or hf:NAME', '')}", field="SRC") from None
        return {"path": src, "fingerprint": fp, "files": 0, "text_field": o.text_field}, [unit]
    path = Path(src).expanduser().absolute()
    if not path.exists():
        raise ConfigError(f"{path} does not exist; allowed: {ALLOWED_SRC}", field="SRC")
    if is_dataset_dir(path):
        ds = open_dataset({"kind": "dataset", "path": str(path)})
        split = None
        if hasattr(ds, "keys"):  # a DatasetDict
            check_choice(o.split, "--split", list(ds.keys()))
            ds, split = ds[o.split], o.split
        if o.text_field not in ds.column_names:
            raise ConfigError(f"{path} has no column {o.text_field!r} (its columns: "
                              f"{', '.join(ds.column_names[:8])}); allowed: --text-field NAME", field="--text-field")
        if len(ds) == 0:
            raise ConfigError(f"{path} holds no row; allowed: {ALLOWED_SRC}", field="SRC")
        rows = max(1, int(o.unit_bytes / max(1.0, ds.data.nbytes / len(ds))))
        units = plan_dataset_units(len(ds), rows, str(path), split, "dataset")
        return {"path": str(path), "fingerprint": ds._fingerprint, "files": len(ds.cache_files),
                "text_field": o.text_field}, units
    files, skipped = input_files(path)
    if not files:
        seen = f" (only: {', '.join(p.name for p in skipped[:3])})" if skipped else ""
        raise ConfigError(f"{path} holds no input file{seen}; allowed: {ALLOWED_SRC}", field="SRC")
    for f in files:
        check_file(f, o.text_field)
    if all(f.stat().st_size == 0 for f in files):
        raise ConfigError(f"{path}: every input file is empty; allowed: {ALLOWED_SRC}", field="SRC")
    if skipped and o.progress is not False:
        print(f"attnzoo-data: skipped {len(skipped)} files that are not {'/'.join(SUFFIXES)} "
              f"(e.g. {skipped[0].name})", file=sys.stderr)
    units = plan_units(path, files, o.unit_bytes, o.txt_docs)
    return {"path": str(path), "fingerprint": fingerprint_files(path, files), "files": len(files),
            "text_field": o.text_field}, units


def _optimize(fn: EncodeUnits, inputs: list[int], out: Path, o: PrepareOptions) -> None:
    from litdata import optimize  # the shard writer; imported when there is work
    from litdata.streaming.item_loader import TokensLoader

    try:
        optimize(fn=fn, inputs=inputs, output_dir=str(out), num_workers=min(o.num_workers, len(inputs)),
                 chunk_bytes=o.chunk_bytes, item_loader=TokensLoader(), verbose=False, reorder_files=False,
                 start_method="fork" if sys.platform == "linux" else "spawn")
    except RuntimeError as e:  # litdata re-raises a worker's error as the text of its traceback
        found = [line for line in str(e).splitlines() if line.startswith("attnzoo.config.errors.ConfigError: ")]
        if found:
            raise ConfigError(found[-1].split(": ", 1)[1]) from None
        raise


def _index(folder: Path) -> dict:
    return json.loads((folder / "index.json").read_text())


def _counts(index: dict) -> tuple[int, int]:
    """(tokens, documents) of a TokensLoader index: `dim` is a chunk's tokens, `chunk_size` its items."""
    return sum(c["dim"] or 0 for c in index["chunks"]), sum(c["chunk_size"] for c in index["chunks"])


def _longest(folder: Path, index: dict, itemsize: int) -> int:
    """Tokens of the longest document (its end-of-text id included), from the chunks' headers only: a chunk
    starts with uint32 n, then n + 1 uint32 byte offsets of its items."""
    longest = 0
    for c in index["chunks"]:
        with open(folder / c["filename"], "rb") as f:
            n = int(np.frombuffer(f.read(4), dtype=np.uint32)[0])
            offsets = np.frombuffer(f.read(4 * (n + 1)), dtype=np.uint32).astype(np.int64)
        if n:
            longest = max(longest, int(np.diff(offsets).max()) // itemsize)
    return longest


# ----------------------------------------------------------------------------- prepare


def _parts(units: list[dict], o: PrepareOptions) -> list[list[int]]:
    """Consecutive units grouped into parts of about num_workers * unit_bytes (>= num_workers units each, so
    every worker has a unit)."""
    parts, cur, size = [], [], 0
    for i, u in enumerate(units):
        cur.append(i)
        size += u["bytes"]
        if len(cur) >= o.num_workers and size >= o.num_workers * o.unit_bytes * 0.75:
            parts.append(cur)
            cur, size = [], 0
    return parts + ([cur] if cur else [])


def _same(old: dict, new: dict, out: Path) -> None:
    """Refuse, in one line, another source, tokenizer or split into a prepared (or half-prepared) OUT."""
    if old["source"]["fingerprint"] != new["source"]["fingerprint"] or old["source"]["path"] != new["source"]["path"]:
        raise ConfigError(f"{out} was prepared from another source ({old['source']['path']}, fingerprint "
                          f"{old['source']['fingerprint'][:12]}; this SRC: {new['source']['path']}, "
                          f"{new['source']['fingerprint'][:12]}); allowed: the same SRC, or another OUT", field="SRC")
    if old["tokenizer"] != new["tokenizer"]:
        raise ConfigError(f"{out} was prepared with another tokenizer ({_tok_text(old['tokenizer'])}; asked: "
                          f"{_tok_text(new['tokenizer'])}); allowed: the same tokenizer options, or another OUT",
                          field="--tokenizer")
    for key, value in new["layout"].items():
        if old["layout"].get(key) != value:
            raise ConfigError(f"{out} was prepared with {key}={old['layout'].get(key)!r} (asked: {value!r}); "
                              f"allowed: the same value, or another OUT", field=f"--{key.replace('_', '-')}")


def _tok_text(t: dict) -> str:
    return ", ".join(f"{k}={v if k != 'sha256' else str(v)[:12]}" for k, v in t.items() if v is not None)


def checked_options(options: dict, exclude: tuple = ()) -> PrepareOptions:
    """`prepare`'s options as PrepareOptions, checked: an unknown name (or one in `exclude`) or a bad value is
    a one-line ConfigError (field `prepare`, or the option's flag)."""
    names = {f.name for f in fields(PrepareOptions)} - set(exclude)
    unknown = sorted(set(options) - names)
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]!r}; allowed: {', '.join(sorted(names))}", field="prepare")
    o = PrepareOptions(**options)
    o.validate()
    return o


def prepare(src: str | Path, out: str | Path, **options) -> dict:
    """Tokenize SRC into OUT (the prepared-corpus contract); returns the manifest. Resumes a killed run from
    its finished parts; on a finished OUT of the same SRC and options it does nothing and returns its manifest.
    Bad input is a one-line ConfigError raised before any work (a malformed record deep in a file, found by a
    worker, is one line too)."""
    o = checked_options(options)
    out = Path(out).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file; allowed: a new or empty directory, or a folder attnzoo-data prepared",
                          field="OUT")
    above = next(p for p in out.parents if p.exists())  # the folder OUT would be created in
    if not out.exists() and not (above.is_dir() and os.access(above, os.W_OK | os.X_OK)):
        what = "a file" if not above.is_dir() else "not writable"
        raise ConfigError(f"{out} cannot be created: {above} is {what}; allowed: a new or empty directory under a "
                          f"writable folder, or a folder attnzoo-data prepared", field="OUT")
    work = out / ".work"
    done = read_manifest(out) if (out / "manifest.json").exists() else None
    others = [p for p in out.iterdir() if p.name != ".work"] if out.is_dir() else []
    if done is None and others and not (work / "plan.json").is_file():  # .work alone: killed before its plan
        raise ConfigError(f"{out} is not empty and not a folder attnzoo-data prepared; allowed: a new or empty "
                          f"directory, or a folder attnzoo-data prepared", field="OUT")
    source, units = resolve_source(str(src), o)
    given, tok_id = tokenizer_source(o)
    layout = {"text_field": o.text_field, "txt_docs": o.txt_docs, "split": o.split, "val_fraction": o.val_fraction,
              "seed": o.seed}
    settings = {"source": source, "tokenizer": tok_id, "layout": layout}
    if done is not None:
        damage = _manifest_damage(done, PREPARED_WITH)
        if damage:
            raise ConfigError(f"{out}/manifest.json is damaged ({damage}); allowed: a folder written by attnzoo-data "
                              f"prepare (prepare it again)", field="OUT")
        _same(done["prepare"], settings, out)
        shutil.rmtree(work, ignore_errors=True)  # a kill after the manifest, before the clean-up
        if o.progress is not False:
            print(f"attnzoo-data: {out} is already prepared from this source; nothing to do")
        return done
    field = f"--tokenizer-{o.tokenizer}" if given else "--tokenizer"
    plan_path = work / "plan.json"
    held = contextlib.ExitStack()  # the folder's lock, from the first write to the end (a second prepare: refused)
    if plan_path.is_file():
        held.enter_context(sole_writer(out, work))
        plan = json.loads(plan_path.read_text())
        _same(plan["settings"], settings, out)
        tok = load_tokenizer(work / "tokenizer.json", field)
    else:
        tok = load_tokenizer(given, field) if given else None
        if tok is not None:
            eos_of(tok, given, o, field)
            dtype_for(vocab_size_of(tok))  # refused before any work
        work.mkdir(parents=True, exist_ok=True)
        held.enter_context(sole_writer(out, work))
        if tok is None:
            tok = train_bpe(units, o, str(src))
            (work / "tokenizer.json").write_text(tok.to_str())
        else:
            shutil.copyfile(given, work / "tokenizer.json")
        plan = {"settings": settings, "units": units, "parts": _parts(units, o)}
        _atomic_json(plan_path, plan)
    tok_path = work / "tokenizer.json"
    eos = eos_of(tok, given or tok_path, o, field) if given or o.eos_token else tok.token_to_id(SPECIALS[0])
    vocab = vocab_size_of(tok)
    dtype = dtype_for(vocab)
    with held:
        try:
            stats = _run_parts(plan, str(tok_path), work, o, dtype, eos)
            manifest = _finish(out, work, plan, source, o, dtype, eos, vocab)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # a full disk: the unfinished part and merge removed, the finished parts kept for a rerun to resume
            for stray in [*work.glob("tmp-*"), work / "merged"]:
                shutil.rmtree(stray, ignore_errors=True)
            done_parts = sum(1 for k in range(len(plan["parts"])) if (work / "parts" / str(k)).is_dir())
            raise ConfigError(f"no space left writing {e.filename or out} ({e.strerror}); {done_parts} of "
                              f"{len(plan['parts'])} parts are finished and kept in {work}; allowed: free space, then "
                              f"the same command again to complete it", field="OUT") from None
    if o.progress is not False:
        n_tok = sum(s["tokens"] for s in manifest["splits"].values())
        secs = max(stats["seconds"], 1e-9)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        tr, va = manifest["splits"]["train"], manifest["splits"]["val"]
        print(f"attnzoo-data: {out}: {tr['tokens']:,} train tokens ({tr['documents']:,} documents), "
              f"{va['tokens']:,} val tokens ({va['documents']:,} documents), {dtype}")
        print(f"attnzoo-data: tokenized {stats['tokens']:,} tokens in {secs:.1f} s: {stats['tokens'] / secs:,.0f} "
              f"tokens/s ({o.num_workers} workers; {n_tok:,} tokens in OUT); peak RSS {rss:,.0f} MB "
              f"(largest worker {kids:,.0f} MB)")
    return manifest


@contextlib.contextmanager
def sole_writer(out: Path, work: Path):
    """OUT/.work/.lock held while this process writes OUT: a second prepare into the same folder is refused in one
    line (was: a crash, and a stray .work/tmp-0/ left). An OS file lock: released when the holder dies (a kill)."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(work / ".lock"), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise ConfigError(f"{out} is being prepared by another process (its lock {work / '.lock'} is held); allowed: "
                          f"wait for it to finish (a rerun then finds it prepared), or another OUT", field="OUT") from None
    try:
        yield
    finally:
        lock.release()


def _run_parts(plan: dict, tok_path: str, work: Path, o: PrepareOptions, dtype: str, eos: int) -> dict:
    """Tokenize every part not yet finished; a part is complete when work/parts/K exists."""
    parts_dir = work / "parts"
    parts_dir.mkdir(exist_ok=True)
    units, parts = plan["units"], plan["parts"]
    todo = [k for k in range(len(parts)) if not (parts_dir / str(k)).is_dir()]
    if len(todo) < len(parts) and o.progress is not False:
        print(f"attnzoo-data: resuming: {len(parts) - len(todo)} of {len(parts)} parts already done",
              file=sys.stderr)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one encoder thread per worker process; no fork warning
    total = sum(units[i]["bytes"] for k in todo for i in parts[k])
    splits = [s for s in SPLITS if s == "train" or o.val_fraction > 0]
    t0, tokens = time.time(), 0
    with tokenizing(total, splits, o if todo else replace(o, progress=False)) as (read, part_done):
        for k in todo:
            tmp = work / f"tmp-{k}"
            shutil.rmtree(tmp, ignore_errors=True)
            for split in splits:
                fn = EncodeUnits(units, tok_path, split == "val", o, dtype, eos, read[split])
                _optimize(fn, parts[k], tmp / split, o)
                tokens += _counts(_index(tmp / split))[0]
            os.replace(tmp, parts_dir / str(k))
            part_done(sum(units[i]["bytes"] for i in parts[k]))
    return {"tokens": tokens, "seconds": time.time() - t0}


def _merge(parts: list[Path], dest: Path) -> dict:
    """One litdata dataset from the parts' datasets: their chunks hard-linked (copied where links fail) under
    new names into `dest`, their index entries concatenated. Returns the index written."""
    dest.mkdir(parents=True)
    chunks, config = [], None
    for part in parts:
        if not (part / "index.json").is_file():
            continue
        index = _index(part)
        config = config if config is not None and config.get("data_format") else index["config"]
        for c in index["chunks"]:
            name = f"chunk-0-{len(chunks)}.bin"
            try:
                os.link(part / c["filename"], dest / name)
            except OSError:
                shutil.copyfile(part / c["filename"], dest / name)
            chunks.append({**c, "filename": name})
    index = {"chunks": chunks, "config": config or {}, "updated_at": str(time.time())}
    (dest / "index.json").write_text(json.dumps(index))
    return index


def _finish(out: Path, work: Path, plan: dict, source: dict, o: PrepareOptions, dtype: str, eos: int,
            vocab: int) -> dict:
    """Merge the parts into OUT/train and OUT/val, copy tokenizer.json, write manifest.json last."""
    merged = work / "merged"
    shutil.rmtree(merged, ignore_errors=True)
    parts = [work / "parts" / str(k) for k in range(len(plan["parts"]))]
    splits = {}
    for split in SPLITS:
        index = _merge([p / split for p in parts], merged / split)
        tokens, docs = _counts(index)
        splits[split] = {"dir": split, "tokens": tokens, "documents": docs,
                         "max_document_tokens": _longest(merged / split, index, np.dtype(dtype).itemsize)}
    if splits["train"]["documents"] == 0:
        raise ConfigError(f"{source['path']} holds no document (every one blank, or all drawn for val); allowed: "
                          f"{ALLOWED_SRC}", field="SRC")
    for split in SPLITS:
        shutil.rmtree(out / split, ignore_errors=True)
        os.replace(merged / split, out / split)
    shutil.copyfile(work / "tokenizer.json", out / "tokenizer.json")
    manifest = {
        "format": FORMAT, "version": VERSION, "created_by": created_by(), "source": source,
        "tokenizer": {"kind": o.tokenizer, "file": "tokenizer.json", "sha256": file_sha256(out / "tokenizer.json"),
                      "vocab_size": vocab, "eos_id": eos},
        "dtype": dtype, "val": {"fraction": o.val_fraction, "seed": o.seed}, "splits": splits,
        "prepare": plan["settings"],  # what the same-OUT check compares on a re-run
        "complete": True,
    }
    _atomic_json(out / "manifest.json", manifest)
    shutil.rmtree(work, ignore_errors=True)
    return manifest
