"""The documents of a source for `attnzoo-data prepare`: a folder (or one file) of .txt / .jsonl / .jsonl.zst /
.parquet files, a HF `datasets` dataset saved with `save_to_disk`, or a hub name `hf:owner/name[:config]`
(streamed; needs the network).

The source is cut into *units* (a file, a byte range of a large .txt / .jsonl file aligned on a document
boundary, a range of parquet row groups, a range of dataset rows), the resumable grain of prepare: a unit is
tokenized whole or not at all. Every document has a key stable across re-runs (`relpath:byte offset`,
`relpath:line`, `relpath:row`, `row`) from which the validation split is drawn (`is_val`).
"""
from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Iterator

from attnzoo.config.errors import ConfigError

SUFFIXES = (".txt", ".jsonl", ".jsonl.zst", ".parquet")
TXT_DOCS = ("blank", "line", "file")  # a .txt document: a blank-line separated block, one line, the whole file
HEAD = 1 << 16  # bytes hashed at each end of a file for the fingerprint
ALLOWED_SRC = "a folder or file of .txt/.jsonl/.jsonl.zst/.parquet, a datasets save_to_disk folder, or hf:NAME"


def suffix_of(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def is_val(key: str, fraction: float, seed: int) -> bool:
    """The contract's split rule: a document goes to val when sha256(f"{seed}:{key}") mod 2**32 < fraction * 2**32."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[-4:], "big") < fraction * 2**32


# ----------------------------------------------------------------------------- what SRC is


def is_dataset_dir(path: Path) -> bool:
    return path.is_dir() and any((path / f).is_file() for f in ("dataset_info.json", "dataset_dict.json",
                                                                  "state.json"))


def input_files(src: Path) -> tuple[list[Path], list[Path]]:
    """(the input files of a folder or file, sorted; the files skipped for their suffix). Hidden names skipped."""
    if src.is_file():
        return ([src], []) if suffix_of(src) else ([], [src])
    files, skipped = [], []
    for p in sorted(src.rglob("*")):
        if any(part.startswith(".") for part in p.relative_to(src).parts) or not p.is_file():
            continue
        (files if suffix_of(p) else skipped).append(p)
    return files, skipped


def check_text_head(path: Path, head: bytes) -> None:
    """One line when the first bytes of a .txt / .jsonl input are not UTF-8 text (a binary file)."""
    nul = head.find(b"\x00")
    if nul >= 0:
        raise ConfigError(f"{path} is binary (a NUL byte at offset {nul}), not UTF-8 text; allowed: UTF-8 text "
                          f"files, or move it out of SRC", field="SRC")
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 3:  # a character cut at the end of the sample is fine
            raise ConfigError(f"{path} is not UTF-8 text (invalid byte at offset {e.start}); allowed: UTF-8 text "
                              f"files, or move it out of SRC", field="SRC") from None


def _check_record(path: Path, line: bytes, field: str, where: str) -> None:
    try:
        rec = json.loads(line)
    except ValueError:
        raise ConfigError(f"{path} {where} is not JSON; allowed: one JSON object per line", field="SRC") from None
    if not isinstance(rec, dict) or not isinstance(rec.get(field), str):
        fields = ", ".join(list(rec)[:8]) if isinstance(rec, dict) else type(rec).__name__
        raise ConfigError(f"{path} {where} has no string field {field!r} (its fields: {fields}); allowed: "
                          f"--text-field NAME", field="--text-field")


def _first_line(stream) -> bytes | None:
    for line in stream:
        if line.strip():
            return line
    return None


def check_file(path: Path, field: str) -> None:
    """Refuse, in one line, an input file that cannot be read as documents (binary, no text field)."""
    kind = suffix_of(path)
    if kind in (".txt", ".jsonl"):
        with open(path, "rb") as f:
            check_text_head(path, f.read(8192))
            f.seek(0)
            line = _first_line(f) if kind == ".jsonl" else None
        if line is not None:
            _check_record(path, line, field, "line 1")
    elif kind == ".jsonl.zst":
        try:
            with _zst_lines(path) as lines:
                line = _first_line(lines)
        except Exception as e:  # zstandard.ZstdError and friends: not a zstd stream
            raise ConfigError(f"{path} is not a zstd stream ({str(e).splitlines()[0][:80]})", field="SRC") from None
        if line is not None:
            _check_record(path, line, field, "line 1")
    elif kind == ".parquet":
        import pyarrow.parquet as pq  # datasets' dependency, only for parquet inputs

        try:
            schema = pq.read_schema(path)
        except Exception as e:
            raise ConfigError(f"{path} is not a parquet file ({str(e).splitlines()[0][:80]})", field="SRC") from None
        names = schema.names
        if field not in names:
            raise ConfigError(f"{path} has no column {field!r} (its columns: {', '.join(names[:8])}); allowed: "
                              f"--text-field NAME", field="--text-field")
        kind = schema.field(field).type
        kind = getattr(kind, "value_type", kind)  # a dictionary-encoded column: its values' type
        if not str(kind).startswith(("string", "large_string")):  # was: every row skipped, "holds no document"
            text_cols = [n for n in names if str(getattr(schema.field(n).type, "value_type", schema.field(n).type))
                         .startswith(("string", "large_string"))]
            raise ConfigError(f"{path} column {field!r} holds {kind}, not text (its text columns: "
                              f"{', '.join(text_cols[:8]) or 'none'}); allowed: --text-field NAME of a string column",
                              field="--text-field")


def _zst_lines(path: Path):
    import zstandard  # only for .jsonl.zst inputs

    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))


def fingerprint_files(src: Path, files: list[Path]) -> str:
    """sha256 over the sorted (relative path, size, sha256 of the first and last 64 KiB) of every input file."""
    h = hashlib.sha256()
    base = src if src.is_dir() else src.parent
    for p in sorted(files, key=lambda p: str(p.relative_to(base))):
        size = p.stat().st_size
        with open(p, "rb") as f:
            ends = hashlib.sha256(f.read(HEAD))
            if size > HEAD:
                f.seek(max(HEAD, size - HEAD))
                ends.update(f.read(HEAD))
        h.update(f"{p.relative_to(base)}\0{size}\0{ends.hexdigest()}\n".encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------- units


def _aligned(f, pos: int, blank: bool) -> int:
    """The first document boundary at or after byte `pos`: the start of the next line (line documents) or the
    position after the next blank line (blank-line separated documents)."""
    if pos == 0:
        return 0
    f.seek(pos - 1)
    f.readline()  # the rest of the line `pos` falls in
    if not blank:
        return f.tell()
    while True:
        line = f.readline()
        if not line or not line.strip():
            return f.tell()


def plan_units(src: Path, files: list[Path], unit_bytes: int, txt_docs: str) -> list[dict]:
    """Cut the input files into units of about `unit_bytes` (large .txt / .jsonl files by byte ranges aligned on
    document boundaries, parquet files by row groups; .jsonl.zst files whole)."""
    base = src if src.is_dir() else src.parent
    units = []
    for p in files:
        kind, rel, size = suffix_of(p), str(p.relative_to(base)), p.stat().st_size
        if size == 0:
            continue
        if kind == ".parquet":
            import pyarrow.parquet as pq  # parquet inputs only

            meta = pq.ParquetFile(p).metadata
            start, acc, groups = 0, 0, []
            for g in range(meta.num_row_groups):
                acc += meta.row_group(g).total_byte_size
                groups.append(g)
                if acc >= unit_bytes or g == meta.num_row_groups - 1:
                    units.append({"kind": kind, "path": str(p), "rel": rel, "groups": groups, "row": start,
                                  "bytes": acc})
                    start += sum(meta.row_group(i).num_rows for i in groups)
                    groups, acc = [], 0
        elif kind == ".jsonl.zst" or (kind == ".txt" and txt_docs == "file") or size <= unit_bytes:
            units.append({"kind": kind, "path": str(p), "rel": rel, "start": 0, "end": size, "bytes": size})
        else:
            with open(p, "rb") as f:
                cuts = sorted({_aligned(f, k, kind == ".txt" and txt_docs == "blank")
                               for k in range(0, size, unit_bytes)} | {size})
            for a, b in zip(cuts, cuts[1:]):
                if b > a:
                    units.append({"kind": kind, "path": str(p), "rel": rel, "start": a, "end": b, "bytes": b - a})
    return units


def plan_dataset_units(n_rows: int, unit_rows: int, path: str, split: str | None, kind: str) -> list[dict]:
    return [{"kind": kind, "path": path, "split": split, "rel": "", "start": a, "end": min(a + unit_rows, n_rows),
             "bytes": min(a + unit_rows, n_rows) - a} for a in range(0, n_rows, unit_rows)]


# ----------------------------------------------------------------------------- documents of a unit


def documents(unit: dict, field: str = "text", txt_docs: str = "blank") -> Iterator[tuple[str, str]]:
    """(key, text) of every non-blank document of a unit, in order."""
    kind, rel = unit["kind"], unit["rel"]
    if kind == ".txt":
        yield from _txt_documents(unit, txt_docs)
    elif kind == ".jsonl":
        with open(unit["path"], "rb") as f:
            f.seek(unit["start"])
            pos = unit["start"]
            while pos < unit["end"]:
                line = f.readline()
                if not line:
                    break
                if line.strip():
                    text = _field(line, field, unit, f"byte {pos}")
                    if text:
                        yield f"{rel}:{pos}", text
                pos += len(line)
    elif kind == ".jsonl.zst":
        with _zst_lines(Path(unit["path"])) as lines:
            for n, line in enumerate(lines, 1):
                if line.strip():
                    text = _field(line, field, unit, f"line {n}")
                    if text:
                        yield f"{rel}:{n}", text
    elif kind == ".parquet":
        import pyarrow.parquet as pq  # parquet inputs only

        row = unit["row"]
        for batch in pq.ParquetFile(unit["path"]).iter_batches(row_groups=unit["groups"], columns=[field]):
            for text in batch.column(0).to_pylist():
                if isinstance(text, str) and text.strip():
                    yield f"{rel}:{row}", text
                row += 1
    elif kind in ("dataset", "hub"):
        ds = open_dataset(unit)
        rows = ds.select(range(unit["start"], unit["end"])) if kind == "dataset" else ds
        for row, rec in enumerate(rows, unit["start"]):
            text = rec.get(field)
            if isinstance(text, str) and text.strip():
                yield str(row), text


def _field(line: bytes, field: str, unit: dict, where: str) -> str | None:
    """The text of one JSON line (None when missing, null or blank: such records are skipped)."""
    try:
        rec = json.loads(line)
    except ValueError:
        raise ConfigError(f"{unit['path']} {where} is not JSON; allowed: one JSON object per line", field="SRC") \
            from None
    text = rec.get(field) if isinstance(rec, dict) else None
    return text if isinstance(text, str) and text.strip() else None


def _txt_documents(unit: dict, txt_docs: str) -> Iterator[tuple[str, str]]:
    rel = unit["rel"]
    with open(unit["path"], "rb") as f:
        if txt_docs == "file":
            text = f.read().decode("utf-8", errors="replace")
            if text.strip():
                yield f"{rel}:0", text
            return
        f.seek(unit["start"])
        pos, start, lines = unit["start"], None, []
        while pos < unit["end"]:
            line = f.readline()
            if not line:
                break
            if txt_docs == "line":
                if line.strip():
                    yield f"{rel}:{pos}", line.rstrip(b"\r\n").decode("utf-8", errors="replace")
            elif line.strip():
                start = pos if start is None else start
                lines.append(line)
            elif lines:
                yield f"{rel}:{start}", b"".join(lines).rstrip(b"\r\n").decode("utf-8", errors="replace")
                start, lines = None, []
            pos += len(line)
        if lines:
            yield f"{rel}:{start}", b"".join(lines).rstrip(b"\r\n").decode("utf-8", errors="replace")


def open_dataset(unit: dict):
    """The `datasets` dataset a dataset / hub unit reads (datasets is imported only for such sources)."""
    import datasets

    if unit["kind"] == "hub":
        name, _, config = unit["path"].partition(":")
        return datasets.load_dataset(name, config or None, split=unit["split"], streaming=True)
    ds = datasets.load_from_disk(unit["path"])
    return ds[unit["split"]] if unit.get("split") else ds
