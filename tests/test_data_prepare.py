"""`attnzoo-data prepare` / `info` (issue 27 item 1): the prepared-corpus contract on tiny corpora (documents
round-trip, EOS at every document's end, val drawn by document key, dtype, manifest), every source format, the
three tokenizer choices, resume after SIGKILL (the same documents as an uninterrupted run), the no-op re-run,
and every bad input refused in one line before any work (rows of docs/reliability.md's table:
scripts/bad_input_table.py EXTRA)."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from attnzoo.cli.data import main
from attnzoo.data import prepare as prep
from attnzoo.data.prepare import prepare, read_manifest
from attnzoo.data.sources import is_val

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the of and to in is was for on that with as by at from his her an which have are were be this or had "
         "not but it one all river stone light garden window morning letter").split()
FAST = {"vocab_size": 300, "num_workers": 2, "progress": False}


def _doc(rng) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))).capitalize() + "."


def make_corpus(folder: Path, n: int = 120, seed: int = 0) -> list[str]:
    """A .txt (blank-line separated documents) and a .jsonl file; returns every document."""
    import random

    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    txt, jsonl = [_doc(rng) for _ in range(n)], [_doc(rng) for _ in range(n)]
    (folder / "a.txt").write_text("\n\n".join(txt) + "\n")
    (folder / "b.jsonl").write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(jsonl)))
    return txt + jsonl


def read_items(folder: Path, dtype: str) -> list[np.ndarray]:
    """Every item of a litdata TokensLoader dataset, read from its chunk files (header: n, n + 1 offsets)."""
    index = json.loads((folder / "index.json").read_text())
    items = []
    for c in index["chunks"]:
        raw = (folder / c["filename"]).read_bytes()
        n = int(np.frombuffer(raw[:4], np.uint32)[0])
        offsets = np.frombuffer(raw[4 : 4 * (n + 2)], np.uint32)
        items += [np.frombuffer(raw[a:b], dtype) for a, b in zip(offsets[:-1], offsets[1:])]
    return items


def split_docs(out: Path) -> dict:
    m = read_manifest(out)
    return {s: Counter(tuple(a.tolist()) for a in read_items(out / s, m["dtype"])) for s in ("train", "val")}


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    from attnzoo.data.tokenizer import BPETokenizer

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(BPETokenizer.train(" ".join(WORDS * 20), 300).tok.to_str())
    return path


def test_prepare_contract(tmp_path, capsys):
    docs = make_corpus(tmp_path / "src")
    main(["prepare", str(tmp_path / "src"), str(tmp_path / "out"), "--vocab-size", "300", "--val-fraction", "0.2",
          "--seed", "3", "--unit-bytes", "2048", "--progress-every", "0"])
    cap = capsys.readouterr()
    assert "tokens/s" in cap.out and "peak RSS" in cap.out
    # stderr is not a terminal here (a log): every long step prints progress lines with rate and ETA, the BPE's
    # own stages included (issue 47 item 7; --progress-every 0: a line at every update, no waiting)
    for step in ("sampling the source", "training BPE: reading the text", "training BPE: compute merges",
                 "tokenizing"):
        lines = [x for x in cap.err.splitlines() if x.startswith(f"attnzoo-data: {step}: ")]
        assert any(re.search(r" of .* \(\d+%\), .*/s, ETA ", x) for x in lines), (step, cap.err)
        assert re.fullmatch(r".*: done, .* in \d+ s \(.*/s\)", lines[-1]), lines[-1]
    m = read_manifest(tmp_path / "out")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert m["dtype"] == "uint16" and m["tokenizer"]["eos_id"] == tok.token_to_id("<|endoftext|>")
    assert m["tokenizer"]["vocab_size"] == tok.get_vocab_size() == 300
    assert m["source"]["files"] == 2 and m["val"] == {"fraction": 0.2, "seed": 3} and m["complete"] is True
    assert not (tmp_path / "out" / ".work").exists()
    decoded = {}
    for split in ("train", "val"):
        items = read_items(tmp_path / "out" / split, "uint16")
        assert all(a[-1] == m["tokenizer"]["eos_id"] and (a[:-1] != m["tokenizer"]["eos_id"]).all() for a in items)
        assert m["splits"][split]["documents"] == len(items)
        assert m["splits"][split]["tokens"] == sum(len(a) for a in items)
        decoded[split] = Counter(tok.decode(a[:-1].tolist()) for a in items)
    assert decoded["train"] + decoded["val"] == Counter(docs)  # every document once, never cut
    # val is drawn by document key (relpath:byte offset), as the contract says
    src = tmp_path / "src"
    keys = [f"b.jsonl:{off}" for off in np.cumsum([0] + [len(x) for x in (src / "b.jsonl").read_bytes()
                                                          .splitlines(keepends=True)])[:-1]]
    want_val = [json.loads(line)["text"] for key, line in zip(keys, (src / "b.jsonl").read_text().splitlines())
                if is_val(key, 0.2, 3)]
    assert all(decoded["val"][t] for t in want_val) and 0 < m["splits"]["val"]["documents"] < len(docs) / 2
    # info prints it; a second prepare is a no-op
    main(["info", str(tmp_path / "out")])
    info = capsys.readouterr().out
    assert "train" in info and f"{m['splits']['train']['tokens']:,} tokens" in info and "uint16" in info
    before = (tmp_path / "out" / "manifest.json").stat().st_mtime_ns
    main(["prepare", str(src), str(tmp_path / "out"), "--vocab-size", "300", "--val-fraction", "0.2", "--seed", "3"])
    assert "nothing to do" in capsys.readouterr().out
    assert (tmp_path / "out" / "manifest.json").stat().st_mtime_ns == before


def test_progress_in_a_log_is_a_line_every_interval_with_rate_and_eta():
    """Issue 47 item 7: where stderr is not a terminal (a log, a pipe) a long step prints a line when it starts,
    one every `every` seconds with its rate and ETA, and one when it ends (the clock is injected: no waiting)."""
    import io

    from attnzoo.data.prepare_tokens import Progress

    now, log = [0.0], io.StringIO()
    progress = Progress("attnzoo-data: tokenizing", 100e6, "B", every=10, stream=log, clock=lambda: now[0])
    for now[0], done in ((4, 10e6), (10, 25e6), (15, 40e6), (20, 50e6), (30, 100e6)):
        progress.update(done)
    progress.close()
    assert log.getvalue().splitlines() == [
        "attnzoo-data: tokenizing: 100 MB to go",
        "attnzoo-data: tokenizing: 25 MB of 100 MB (25%), 2.5 MB/s, ETA 30 s",
        "attnzoo-data: tokenizing: 50 MB of 100 MB (50%), 2.5 MB/s, ETA 20 s",
        "attnzoo-data: tokenizing: 100 MB of 100 MB (100%), 3.33 MB/s, ETA 0 s",
        "attnzoo-data: tokenizing: done, 100 MB in 30 s (3.33 MB/s)"]


def _write_sources(tmp_path: Path, docs: list[str]) -> dict:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    rows = [{"body": t, "n": i} for i, t in enumerate(docs)]
    (tmp_path / "zst").mkdir()
    (tmp_path / "zst" / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps(r) + "\n" for r in rows).encode()))
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pq" / "a.parquet", row_group_size=7)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    (tmp_path / "lines.txt").write_text("\n".join(docs) + "\n")
    return {"zst": {}, "pq": {"unit_bytes": 1024}, "ds": {"unit_bytes": 1024}, "lines.txt": {"txt_docs": "line"}}


def test_sources(tmp_path, tokenizer_file):
    """.jsonl.zst, .parquet (cut by row groups), a save_to_disk dataset (cut by rows) and a one-document-per-line
    .txt file give the same documents."""
    from tokenizers import Tokenizer

    import random

    rng = random.Random(1)
    docs = [_doc(rng) for _ in range(60)]
    tok = Tokenizer.from_file(str(tokenizer_file))
    for name, extra in _write_sources(tmp_path, docs).items():
        m = prepare(tmp_path / name, tmp_path / f"out-{name}", tokenizer="file", tokenizer_file=str(tokenizer_file),
                    text_field="body", val_fraction=0.1, **{**FAST, **extra})
        got = Counter()
        for split in ("train", "val"):
            got += Counter(tok.decode(a[:-1].tolist()) for a in read_items(tmp_path / f"out-{name}" / split, "uint16"))
        assert got == Counter(docs), name
        assert m["tokenizer"]["kind"] == "file" and m["tokenizer"]["eos_id"] == tok.token_to_id("<|endoftext|>")


def test_tokenizer_model_dir(tmp_path, tokenizer_file):
    """--tokenizer-model DIR: the model directory's tokenizer.json and its tokenizer_config.json eos_token."""
    make_corpus(tmp_path / "src", n=20)
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    (tmp_path / "out" / ".work").mkdir(parents=True)  # a run killed before it wrote its plan: started afresh
    m = prepare(tmp_path / "src", tmp_path / "out", tokenizer="model", tokenizer_model=str(model), **FAST)
    assert m["tokenizer"]["kind"] == "model" and m["tokenizer"]["sha256"] == prep.file_sha256(tokenizer_file)


def refused(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1, cap.err
    assert cap.out == "" and lines[0].startswith("attnzoo-data: error: "), cap
    return lines[0][len("attnzoo-data: error: "):]


def _bad_src(kind: str, tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    if kind == "empty folder":
        (src / "notes.md").write_text("not an input")
    elif kind == "empty files":
        (src / "a.txt").write_text("")
    elif kind == "no text field":
        (src / "a.jsonl").write_text('{"body": "x"}\n')
    elif kind == "binary":
        make_corpus(src, n=3)
        (src / "c.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    elif kind == "latin-1":  # no NUL byte: not binary, but not UTF-8 either
        make_corpus(src, n=3)
        (src / "c.txt").write_bytes(b"caf\xe9 au lait\n\nna\xefve\n")
    elif kind.startswith("parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        if kind == "parquet corrupt":
            (src / "a.parquet").write_bytes(b"PAR1 not a parquet file")
            return src
        column = "body" if kind == "parquet without text" else "text"
        values = pa.array([1, 2, 3]) if kind == "parquet of numbers" else pa.array(["a b", "c d", "e f"])
        pq.write_table(pa.table({column: values}), src / "a.parquet")
    return src


@pytest.mark.parametrize("kind, want", [
    ("missing", "SRC: <tmp>/nowhere does not exist; allowed: a folder or file of .txt/.jsonl/.jsonl.zst/.parquet"),
    ("empty folder", "SRC: <tmp>/src holds no input file (only: notes.md); allowed:"),
    ("empty files", "SRC: <tmp>/src: every input file is empty; allowed:"),
    ("no text field", "--text-field: <tmp>/src/a.jsonl line 1 has no string field 'text' (its fields: body); "
                      "allowed: --text-field NAME"),
    ("binary", "SRC: <tmp>/src/c.txt is binary (a NUL byte at offset 8), not UTF-8 text; allowed:"),
    # issue 43 item 3 (a parquet column of numbers was read as no document at all, after OUT was made)
    ("latin-1", "SRC: <tmp>/src/c.txt is not UTF-8 text (invalid byte at offset 3); allowed: UTF-8 text files"),
    ("parquet without text", "--text-field: <tmp>/src/a.parquet has no column 'text' (its columns: body); allowed: "
                             "--text-field NAME"),
    ("parquet corrupt", "SRC: <tmp>/src/a.parquet is not a parquet file ("),
    ("parquet of numbers", "--text-field: <tmp>/src/a.parquet column 'text' holds int64, not text (its text columns: "
                           "none); allowed: --text-field NAME of a string column"),
])
def test_bad_source(tmp_path, capsys, kind, want):
    src = tmp_path / "nowhere" if kind == "missing" else _bad_src(kind, tmp_path)
    line = refused(capsys, ["prepare", str(src), str(tmp_path / "out")])
    assert line.replace(str(tmp_path), "<tmp>").startswith(want), line
    assert not (tmp_path / "out").exists()  # before any work


@pytest.mark.parametrize("argv, want", [
    (["--val-fraction", "1.5"], "--val-fraction: got 1.5; allowed: 0 <= f < 1"),
    (["--val-fraction", "nan"], "--val-fraction: got nan; allowed: 0 <= f < 1"),
    (["--chunk-bytes", "0"], "--chunk-bytes: got 0; allowed: >= 1024"),
    (["--num-workers", "0"], "--num-workers: got 0; allowed: >= 1"),
    # was refused only after the BPE was trained and OUT made (issue 43 item 3)
    (["--eos-token", "NOSUCH"], "--eos-token: 'NOSUCH' is not a special token of the BPE --tokenizer bpe trains; "
                                "allowed: <|endoftext|>, or omit it"),
], ids=lambda v: v if isinstance(v, str) and v.startswith("--") and " " not in v else None)
def test_bad_option(tmp_path, capsys, argv, want):
    make_corpus(tmp_path / "src", n=3)
    assert refused(capsys, ["prepare", str(tmp_path / "src"), str(tmp_path / "out"), *argv]) == want
    assert not (tmp_path / "out").exists()  # before any work


def test_a_tokenizer_file_that_is_not_a_tokenizer(tmp_path, capsys):
    make_corpus(tmp_path / "src", n=3)
    (tmp_path / "tok.json").write_text("garbage")
    line = refused(capsys, ["prepare", str(tmp_path / "src"), str(tmp_path / "out"), "--tokenizer-file",
                            str(tmp_path / "tok.json")])
    assert line == f"--tokenizer-file: {tmp_path}/tok.json is not a tokenizers JSON (expected value at line 1 column 1)"
    assert not (tmp_path / "out").exists()


def _manifest_of(folder: Path, **change) -> Path:
    """A prepared folder's manifest.json alone (what info and data=shards read first), with `change` applied
    (dotted keys; None removes)."""
    from tests.shards_fixture import write_prepared

    m = json.loads((write_prepared(folder, [np.array([1, 2, 0], np.uint16)], [np.array([3, 0], np.uint16)], "{}",
                                   0, 300) / "manifest.json").read_text())
    for key, value in change.items():
        *up, leaf = key.split(".")
        node = m
        for k in up:
            node = node[k]
        if value is None:
            node.pop(leaf)
        else:
            node[leaf] = value
    (folder / "manifest.json").write_text(json.dumps(m))
    return folder


@pytest.mark.parametrize("change, damage", [
    ({"splits": None}, "splits is missing"),
    ({"tokenizer": None}, "tokenizer is missing"),
    ({"tokenizer.vocab_size": "many"}, "tokenizer.vocab_size is 'many', not an integer >= 1"),
    ({"splits.train": 5}, "splits.train is 5, not a mapping"),
    ({"dtype": "float64"}, "dtype is 'float64', not uint16 or uint32"),
    ({"tokenizer.eos_id": 300}, "tokenizer.eos_id 300 is outside the vocabulary of 300 ids"),
], ids=["no-splits", "no-tokenizer", "vocab-text", "split-int", "dtype", "eos-outside"])
def test_a_damaged_manifest_is_one_line_in_info_and_data_shards(tmp_path, capsys, change, damage):
    """Issue 43 item 3: a hand-edited or damaged manifest.json (complete, of this version) ended `attnzoo-data info`
    and data=shards in a KeyError / TypeError traceback; now one line naming the field, the same in both."""
    from attnzoo.data.configs import read_manifest as read_prepared_folder

    out = _manifest_of(tmp_path / "out", **change)
    line = f"{out}/manifest.json is damaged ({damage}); allowed: a folder written by attnzoo-data prepare (prepare " \
           f"it again)"
    assert refused(capsys, ["info", str(out)]) == f"OUT: {line}"
    with pytest.raises(Exception) as e:
        read_prepared_folder(str(out))
    assert str(e.value) == f"data.path: {line}"


def test_a_file_given_as_the_prepared_folder(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("x")
    assert refused(capsys, ["info", str(tmp_path / "notes.txt")]) == (
        f"OUT: {tmp_path}/notes.txt is a file: not a prepared folder; allowed: a folder written by attnzoo-data "
        f"prepare")


def test_bad_out(tmp_path, capsys, tokenizer_file):
    make_corpus(tmp_path / "src", n=20)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x").write_text("mine")
    line = refused(capsys, ["prepare", str(tmp_path / "src"), str(tmp_path / "junk")])
    assert line.startswith(f"OUT: {tmp_path}/junk is not empty and not a folder attnzoo-data prepared"), line
    # under a file (was NotADirectoryError from mkdir): refused before any work, the file untouched
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    assert refused(capsys, ["prepare", str(tmp_path / "src"), str(notes / "out")]) == (
        f"OUT: {notes}/out cannot be created: {notes} is a file; allowed: a new or empty directory under a writable "
        f"folder, or a folder attnzoo-data prepared")
    assert notes.read_text() == "mine"
    # two tokenizer sources (the model directory was silently ignored): refused, nothing created
    line = refused(capsys, ["prepare", str(tmp_path / "src"), str(tmp_path / "two"), "--tokenizer-file",
                            str(tokenizer_file), "--tokenizer-model", str(tmp_path)])
    assert line == ("--tokenizer-model: given with --tokenizer file, which does not read it; allowed: one tokenizer "
                    "source (--tokenizer-file or --tokenizer-model, or neither for bpe)"), line
    assert not (tmp_path / "two").exists()
    assert refused(capsys, ["info", str(tmp_path / "junk")]) == (
        f"OUT: {tmp_path}/junk has no manifest.json: not a prepared folder; allowed: a folder written by "
        f"attnzoo-data prepare")
    out = tmp_path / "out"
    prepare(tmp_path / "src", out, tokenizer="file", tokenizer_file=str(tokenizer_file), **FAST)
    # another source, another tokenizer, another val split into the prepared OUT
    make_corpus(tmp_path / "src2", n=20, seed=5)
    line = refused(capsys, ["prepare", str(tmp_path / "src2"), str(out), "--tokenizer-file", str(tokenizer_file)])
    assert line.startswith(f"SRC: {out} was prepared from another source"), line
    line = refused(capsys, ["prepare", str(tmp_path / "src"), str(out), "--vocab-size", "300"])
    assert line.startswith(f"--tokenizer: {out} was prepared with another tokenizer (kind=file"), line
    line = refused(capsys, ["prepare", str(tmp_path / "src"), str(out), "--tokenizer-file", str(tokenizer_file),
                            "--val-fraction", "0.1"])
    assert line == (f"--val-fraction: {out} was prepared with val_fraction=0.005 (asked: 0.1); allowed: the same "
                    f"value, or another OUT"), line
    # a manifest from a newer attnzoo
    m = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**m, "version": 99, "created_by": "attnzoo 9.0"}))
    for argv in (["info", str(out)], ["prepare", str(tmp_path / "src"), str(out)]):
        assert refused(capsys, argv) == (f"OUT: {out}/manifest.json is version 99 (attnzoo 9.0); this attnzoo "
                                         f"reads version <= 1; allowed: a newer attnzoo, or prepare it again")


def test_vocabulary_over_uint32(tmp_path, capsys, monkeypatch, tokenizer_file):
    make_corpus(tmp_path / "src", n=5)
    monkeypatch.setattr(prep, "vocab_size_of", lambda tok: 2**32 + 1)
    line = refused(capsys, ["prepare", str(tmp_path / "src"), str(tmp_path / "out"), "--tokenizer-file",
                            str(tokenizer_file)])
    assert line == ("--tokenizer: the tokenizer has 4,294,967,297 ids, over uint32 (4,294,967,296); allowed: a "
                    "vocabulary of at most 2**32 ids")
    assert not (tmp_path / "out").exists()
    assert prep.dtype_for(2**16) == "uint16" and prep.dtype_for(2**16 + 1) == "uint32"


def test_kill_and_resume(tmp_path, tokenizer_file):
    """SIGKILL (the whole process group) once some parts are finished; the same command resumes, and OUT holds
    the same documents per split as an uninterrupted run: none lost, none twice."""
    make_corpus(tmp_path / "src", n=400)  # ~40 parts of ~80 ms: the kill lands after 3 and well before the last
    argv = ["--tokenizer-file", str(tokenizer_file), "--unit-bytes", "2048", "--val-fraction", "0.1", "--quiet"]
    cmd = [sys.executable, "-m", "attnzoo.cli.data", "prepare", str(tmp_path / "src"), str(tmp_path / "out"), *argv]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=subprocess.PIPE)
    parts = tmp_path / "out" / ".work" / "parts"
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None and len(list(parts.glob("*")) if parts.is_dir() else []) < 3:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(list(parts.glob("*")))
    plan = json.loads((tmp_path / "out" / ".work" / "plan.json").read_text())
    assert not (tmp_path / "out" / "manifest.json").exists() and 3 <= done < len(plan["parts"]), done
    res = subprocess.run(cmd[:-1], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"resuming: {done}" in res.stderr or "resuming:" in res.stderr
    prepare(tmp_path / "src", tmp_path / "whole", tokenizer="file", tokenizer_file=str(tokenizer_file),
            unit_bytes=2048, val_fraction=0.1, num_workers=2, progress=False)
    assert split_docs(tmp_path / "out") == split_docs(tmp_path / "whole")
    assert read_manifest(tmp_path / "out")["splits"] == read_manifest(tmp_path / "whole")["splits"]


def test_bad_record_in_a_worker(tmp_path, capsys, tokenizer_file):
    """A malformed line past the first (found by a tokenizer worker, not the up-front check) is one line too."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.jsonl").write_text('{"text": "hello there"}\n{"text": "oops"\n')
    line = refused(capsys, ["prepare", str(tmp_path / "src"), str(tmp_path / "out"), "--tokenizer-file",
                            str(tokenizer_file), "--quiet"])
    assert line == f"SRC: {tmp_path}/src/a.jsonl byte 24 is not JSON; allowed: one JSON object per line"


def test_manifest_records_each_splits_longest_document(tmp_path, tokenizer_file):
    """splits.<split>.max_document_tokens (data=shards refuses packing with seq_len beyond it): the longest
    document's tokens, its end-of-text id included, as the shards hold them."""
    make_corpus(tmp_path / "src", n=60)
    manifest = prepare(tmp_path / "src", tmp_path / "out", tokenizer_file=str(tokenizer_file), val_fraction=0.1,
                       progress=False)
    for split in ("train", "val"):
        items = read_items(tmp_path / "out" / split, manifest["dtype"])
        assert items and manifest["splits"][split]["max_document_tokens"] == max(len(a) for a in items)


def test_full_disk_and_a_second_prepare_are_one_line(tmp_path, capsys, monkeypatch, tokenizer_file):
    """A full disk while a part is written (checked by hand on an 8 MiB tmpfs, then completed by the same command
    after a remount to 64 MiB): one line, the unfinished part removed, the finished parts kept for the rerun. A second
    prepare into a folder another process is writing (its lock held): refused in one line, nothing touched."""
    import errno

    from filelock import FileLock

    make_corpus(tmp_path / "src", n=20)
    out = tmp_path / "out"
    optimize = prep._optimize

    def fills_the_disk(encoder, units, dest, o):
        Path(dest).mkdir(parents=True)
        (Path(dest) / "chunk-0-0.bin").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prep, "_optimize", fills_the_disk)
    args = ["prepare", str(tmp_path / "src"), str(out), "--tokenizer-file", str(tokenizer_file), "--vocab-size", "300",
            "--quiet"]
    line = refused(capsys, args)
    assert line == (f"OUT: no space left writing {out} (No space left on device); 0 of 1 parts are finished and "
                    f"kept in {out}/.work; allowed: free space, then the same command again to complete it"), line
    assert not list((out / ".work").glob("tmp-*")) and (out / ".work" / "plan.json").is_file()
    monkeypatch.setattr(prep, "_optimize", optimize)
    with FileLock(str(out / ".work" / ".lock")):  # another process at work on OUT
        line = refused(capsys, args)
    assert line == (f"OUT: {out} is being prepared by another process (its lock {out}/.work/.lock is held); "
                    f"allowed: wait for it to finish (a rerun then finds it prepared), or another OUT"), line
    main(args)  # the rerun completes it
    assert read_manifest(out)["splits"]["train"]["documents"] > 0 and not (out / ".work").exists()


def test_a_hub_source_that_cannot_be_reached_is_one_line_before_any_work(tmp_path):
    """`attnzoo-data prepare hf:NAME OUT` without the network (issue 43: a ConnectionError traceback after ~24 s of
    retries): the source is opened before OUT is made, and refused in one line naming SRC. HF_HUB_OFFLINE makes
    the offline case certain on a machine that has a network (datasets reads it at import: a process of its own)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    r = subprocess.run([sys.executable, "-c", "from attnzoo.cli.data import main; main()", "prepare",
                        "hf:attnzoo-no-such/dataset", str(tmp_path / "out")], env=env, capture_output=True, text=True,
                       timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith("attnzoo-data: error: SRC: hf:attnzoo-no-such/dataset cannot be opened from the Hugging "
                               "Face hub (") and "allowed: a hub dataset" in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def test_info_refuses_a_folder_data_shards_refuses(tmp_path, capsys):
    """`attnzoo-data info OUT` checks a prepared folder as `data=shards` does (issue 43 item 2: info described a folder
    without tokenizer.json that training then refused): each missing part is the same one line, naming OUT."""
    from attnzoo.data.configs import read_manifest as read_prepared_folder

    out = tmp_path / "out"
    (tmp_path / "src.txt").write_text("hello world\n\n" * 200)
    prepare(str(tmp_path / "src.txt"), out, tokenizer="bpe", vocab_size=300, progress=False)
    main(["info", str(out)])
    assert "tokenizer" in capsys.readouterr().out
    for part in ("tokenizer.json", "train/index.json"):
        (out / part).rename(out / (part.replace("/", "_") + ".gone"))
        with pytest.raises(SystemExit) as e:
            main(["info", str(out)])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err == f"attnzoo-data: error: OUT: {out} has no {part}; allowed: a folder written by " \
            f"`attnzoo-data prepare SRC OUT`", err
        with pytest.raises(Exception) as shards:
            read_prepared_folder(str(out))
        assert str(shards.value) == f"data.path: {err.split('OUT: ', 1)[1]}"
        (out / (part.replace("/", "_") + ".gone")).rename(out / part)
