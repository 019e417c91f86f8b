"""Write a synthetic English-like corpus of about N MB for measuring `attnzoo-data prepare`: documents of
sentences drawn from a Zipf-distributed vocabulary of pseudo-words (plus the commonest English words), half
as .txt files (documents separated by blank lines) and half as .jsonl files ({"id", "text"}). Deterministic
for a given seed.

    .venv/bin/python scripts/make_corpus.py OUT_DIR --mb 100 [--seed 0] [--file-mb 10]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

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


def vocabulary(rng: np.random.Generator, n: int) -> list[str]:
    words = set(COMMON)
    while len(words) < n:
        syl = rng.integers(1, 4)
        words.add("".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(syl)))
    rest = sorted(words - set(COMMON))
    rng.shuffle(rest)  # the Zipf rank of a pseudo-word is random, not alphabetical
    return list(COMMON) + rest


def documents(rng: np.random.Generator, vocab: list[str], probs: np.ndarray):
    words = np.array(vocab, dtype=object)
    while True:
        n_sent = int(rng.integers(2, 30))
        lengths = rng.integers(4, 28, size=n_sent)
        ids = rng.choice(len(vocab), size=int(lengths.sum()), p=probs)
        sents, pos = [], 0
        for n in lengths:
            w = words[ids[pos : pos + n]]
            pos += n
            s = " ".join(w)
            sents.append(s[0].upper() + s[1:] + rng.choice([".", ".", ".", "?", "!", ";"]))
        yield " ".join(sents)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--mb", type=float, default=100.0, help="total size in MB (10**6 bytes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--file-mb", type=float, default=10.0, help="size of each file")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    vocab = vocabulary(rng, 20_000)
    probs = 1.0 / np.arange(1, len(vocab) + 1) ** 1.1
    probs /= probs.sum()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    total, target, per_file, k = 0, int(args.mb * 1e6), int(args.file_mb * 1e6), 0
    docs = documents(rng, vocab, probs)
    while total < target:
        jsonl = k % 2 == 1
        path = out / f"part-{k:04d}.{'jsonl' if jsonl else 'txt'}"
        size, n = 0, 0
        with open(path, "w") as f:
            while size < min(per_file, target - total):
                text = next(docs)
                line = json.dumps({"id": f"{k}-{n}", "text": text}) + "\n" if jsonl else text + "\n\n"
                f.write(line)
                size += len(line)
                n += 1
        total += size
        k += 1
    print(f"wrote {total / 1e6:.1f} MB in {k} files to {out}")


if __name__ == "__main__":
    main()
