"""`attnzoo-bench data`: real corpora at scale (docs/data.md). For each corpus size: a synthetic English-like
corpus written to disk (.txt and .jsonl halves), `attnzoo-data prepare` on it with a fixed tokenizer (trained once on
the first corpus, so prepare times tokenization, not BPE training), then `attnzoo-train data=shards` (the default
model) for a few steps, and the training loader alone. Reported per size: prepare tokens/s (end to end, and the
tokenizing phase as the command prints it), the peak memory of prepare's and training's whole process trees (PSS:
pages shared between forked workers counted once), the training process's own peak RSS, training tokens/s and the
loader's tokens/s with its workers (the loader must outrun training by far: it is not the bottleneck).

    attnzoo-bench --out docs/bench data --sizes-mb 50 500          # the docs' numbers (minutes; idle machine)
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

HELP = "attnzoo-data prepare tokens/s and memory, training memory and loader tokens/s on prepared corpora"

QUICK = {"sizes_mb": [0.3], "steps": 3, "loader_batches": 20, "vocab_size": 512}

COMMON = ("the of and to a in is was that for it with as his on be at by had this not are but from or have an "
          "they which one you were her all she there would their we him been has when who will more no if out so "
          "said what up its about into than them can only other new some could time these two may then do first "
          "any my now such like our over man me even most made after also did many before must through back "
          "years where much your way well down should because each just those people how too little state good "
          "very make world still own see men work long get here between both life being under never day same "
          "another know while last might us great old year off come since against go came right used take three").split()
ONSETS = "b c d f g h j k l m n p r s t v w z br cr dr fr gr pr tr bl cl fl gl pl sl sh ch th st sp".split()
VOWELS = "a e i o u ai ea ee oo ou ie io".split()
CODAS = ["", "", "n", "r", "s", "t", "l", "nd", "st", "ng", "rk", "ck", "m"]


def add_arguments(p) -> None:
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[50.0, 500.0], help="corpus sizes (10**6 bytes)")
    p.add_argument("--work", default=None, help="where corpora and prepared folders go (default: a temp dir)")
    p.add_argument("--workers", type=int, default=2, help="prepare's tokenizer processes and the loader's workers")
    p.add_argument("--vocab-size", type=int, default=32768, help="the BPE trained once on the first corpus")
    p.add_argument("--steps", type=int, default=40, help="training steps of the default model per corpus")
    p.add_argument("--loader-batches", type=int, default=400, help="batches the loader alone is timed over")


# ----------------------------------------------------------------------------- a synthetic corpus


def vocabulary(rng: np.random.Generator, n: int) -> list[str]:
    """The commonest English words, then pseudo-words of 1-3 syllables in a random Zipf rank."""
    words = set(COMMON)
    while len(words) < n:
        words.add("".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(rng.integers(1, 4))))
    rest = sorted(words - set(COMMON))
    rng.shuffle(rest)
    return list(COMMON) + rest


def documents(rng: np.random.Generator, vocab: list[str], probs: np.ndarray):
    words = np.array(vocab, dtype=object)
    while True:
        lengths = rng.integers(4, 28, size=int(rng.integers(2, 30)))
        ids = rng.choice(len(vocab), size=int(lengths.sum()), p=probs)
        sents, pos = [], 0
        for n in lengths:
            s = " ".join(words[ids[pos: pos + n]])
            pos += n
            sents.append(s[0].upper() + s[1:] + rng.choice([".", ".", ".", "?", "!", ";"]))
        yield " ".join(sents)


def write_corpus(out: Path, mb: float, seed: int = 0, file_mb: float = 10.0) -> Path:
    """About `mb` MB of documents (Zipf-distributed words), alternately .txt files (documents separated by a blank
    line) and .jsonl files ({"id", "text"}). Deterministic for a seed."""
    rng = np.random.default_rng(seed)
    vocab = vocabulary(rng, 20_000)
    probs = 1.0 / np.arange(1, len(vocab) + 1) ** 1.1
    probs /= probs.sum()
    out.mkdir(parents=True, exist_ok=True)
    total, target, per_file, k = 0, int(mb * 1e6), int(file_mb * 1e6), 0
    docs = documents(rng, vocab, probs)
    while total < target:
        jsonl = k % 2 == 1
        size, n = 0, 0
        with open(out / f"part-{k:04d}.{'jsonl' if jsonl else 'txt'}", "w") as f:
            while size < min(per_file, target - total):
                text = next(docs)
                line = json.dumps({"id": f"{k}-{n}", "text": text}) + "\n" if jsonl else text + "\n\n"
                f.write(line)
                size += len(line)
                n += 1
        total += size
        k += 1
    return out


# ----------------------------------------------------------------------------- memory of a process tree


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except OSError:
            pass
    return out


def _pss_bytes(pid: int) -> int:
    """Proportional set size of `pid` and its descendants (Linux smaps_rollup; 0 where unreadable)."""
    total = 0
    for p in _tree(pid):
        try:
            m = re.search(r"^Pss:\s+(\d+) kB", Path(f"/proc/{p}/smaps_rollup").read_text(), re.M)
            total += int(m.group(1)) * 1024 if m else 0
        except OSError:
            pass
    return total


def run_measured(cmd: list[str], env: dict | None = None) -> dict:
    """Run `cmd`; its wall seconds, output, and the peak PSS of its process tree (sampled every 0.2 s)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _pss_bytes(proc.pid))
            done.wait(0.2)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out, _ = proc.communicate()
    done.set()
    t.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}:\n{out[-3000:]}")
    return {"seconds": time.perf_counter() - t0, "output": out, "peak_pss": peak[0]}


# ----------------------------------------------------------------------------- the benchmark


def _loader_tokens_per_sec(path: Path, workers: int, batches: int) -> float:
    from attnzoo.data.shards import ShardsDataConfig, ShardsDataModule

    dm = ShardsDataModule(ShardsDataConfig(path=str(path), num_workers=workers), seed=0)
    dm.setup("fit")
    it = iter(dm.train_dataloader())
    first = next(it)  # workers started, first chunks opened
    b, t = first[0].shape
    t0 = time.perf_counter()
    n = 0
    for _ in range(batches):
        try:
            next(it)
        except StopIteration:
            break
        n += 1
    return n * b * t / (time.perf_counter() - t0)


def run(args) -> dict:
    import tempfile

    from attnzoo.data.prepare import read_manifest

    work = Path(args.work or tempfile.mkdtemp(prefix="attnzoo-bench-data-")).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    rows, tokenizer = [], None
    load = {"before": os.getloadavg()}
    for mb in args.sizes_mb:
        src, out, run_dir = work / f"corpus_{mb:g}mb", work / f"shards_{mb:g}mb", work / f"train_{mb:g}mb"
        if not src.is_dir():
            write_corpus(src, mb)
        if tokenizer is None:  # once, on the first corpus: prepare then times tokenization alone
            first = run_measured([py, "-m", "attnzoo.cli.data", "prepare", str(src), str(out), "--vocab-size",
                                  str(args.vocab_size), "--num-workers", str(args.workers)])
            tokenizer = work / "tokenizer.json"
            tokenizer.write_bytes((out / "tokenizer.json").read_bytes())
            subprocess.run(["rm", "-rf", str(out)], check=True)
        prep = run_measured([py, "-m", "attnzoo.cli.data", "prepare", str(src), str(out), "--tokenizer-file",
                             str(tokenizer), "--num-workers", str(args.workers)])
        m = re.search(r"tokenized ([\d,]+) tokens in ([\d.]+) s", prep["output"])
        manifest = read_manifest(out)
        tokens = sum(s["tokens"] for s in manifest["splits"].values())
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        tr = run_measured([py, "-c", "import resource, runpy, sys; sys.argv = sys.argv[1:]\n"
                           "try:\n    runpy.run_module('attnzoo.cli.train', run_name='__main__')\nfinally:\n"
                           "    print('maxrss_kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)",
                           "attnzoo-train", "data=shards", f"data.path={out}", f"data.num_workers={args.workers}",
                           f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={args.steps}",
                           "trainer.limit_val_batches=2", "sample.max_new_tokens=0", "perf.measure_decode=false",
                           "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}"])
        summary = json.loads((run_dir / "summary.json").read_text())
        train_tps = float(summary["metrics"]["perf/tokens_per_sec"])
        loader_tps = _loader_tokens_per_sec(out, args.workers, args.loader_batches)
        rows.append({
            "corpus MB": mb, "tokens": tokens, "dtype": manifest["dtype"],
            "prepare s": round(prep["seconds"], 1), "prepare tokens/s": tokens / prep["seconds"],
            "tokenizing tokens/s": int(m.group(1).replace(",", "")) / float(m.group(2)) if m else None,
            "prepare peak PSS MB": prep["peak_pss"] / 2**20,
            "train peak RSS MB": int(re.search(r"maxrss_kb (\d+)", tr["output"]).group(1)) / 1024,
            "train peak PSS MB": tr["peak_pss"] / 2**20,
            "train tokens/s": train_tps, "loader tokens/s": loader_tps, "loader / train": loader_tps / train_tps,
        })
    load["after"] = os.getloadavg()
    columns = list(rows[0])
    return {
        "title": f"Real corpora: prepare ({args.workers} workers), train and load ({args.workers} loader workers)",
        "columns": columns, "rows": rows, "load": load, "work": str(work),
        "notes": [f"Load average (1, 5, 15 min) before {tuple(round(x, 2) for x in load['before'])}, after "
                  f"{tuple(round(x, 2) for x in load['after'])}. Peak memory: PSS of the whole process tree "
                  f"(sampled every 0.2 s); train peak RSS: the training process alone. Training: the default "
                  f"model (conf/model/default.yaml), {args.steps} steps of data.batch_size x data.seq_len tokens."],
    }
