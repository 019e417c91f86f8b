"""Write a synthetic English-like corpus of about N MB (attnzoo.bench.data.write_corpus: Zipf-distributed words,
.txt files of blank-line separated documents and .jsonl files of {"id", "text"}), deterministic for a seed. The
corpus `attnzoo-bench data` measures `attnzoo-data prepare` on.

    .venv/bin/python scripts/make_corpus.py OUT_DIR --mb 100 [--seed 0] [--file-mb 10]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from attnzoo.bench.data import write_corpus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--mb", type=float, default=100.0, help="total size in MB (10**6 bytes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--file-mb", type=float, default=10.0, help="size of each file")
    args = ap.parse_args()
    print(write_corpus(Path(args.out), args.mb, args.seed, args.file_mb))


if __name__ == "__main__":
    main()
