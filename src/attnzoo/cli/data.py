"""`attnzoo-data prepare SRC OUT` (tokenize a corpus once into token shards) and `attnzoo-data info OUT`
(print a prepared folder's manifest); the work is attnzoo.data.prepare."""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from attnzoo.config.errors import ConfigError
from attnzoo.data.configs import read_manifest as read_prepared_folder
from attnzoo.data.prepare import PrepareOptions, describe, prepare


def _parser() -> argparse.ArgumentParser:
    d = PrepareOptions()
    ap = argparse.ArgumentParser(prog="attnzoo-data", description="Prepare a text corpus once as token shards "
                                 "(litdata) that data=shards streams; see docs/data.md.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize SRC into OUT (resumes a killed run; a finished OUT is a no-op)")
    p.add_argument("src", metavar="SRC", help="a folder or file of .txt/.jsonl/.jsonl.zst/.parquet, a datasets "
                   "save_to_disk folder, or hf:NAME[:CONFIG] (streamed from the hub)")
    p.add_argument("out", metavar="OUT", help="the prepared folder (new, empty, or one this command wrote)")
    p.add_argument("--tokenizer", choices=("bpe", "file", "model"), default=None,
                   help="bpe: byte-level BPE trained on a sample of SRC (default); file: --tokenizer-file; "
                   "model: --tokenizer-model (implied by those options)")
    p.add_argument("--tokenizer-file", metavar="PATH", help="a HF tokenizers JSON (tokenizer.json)")
    p.add_argument("--tokenizer-model", metavar="DIR", help="a transformers model directory with tokenizer.json "
                   "(as model.init_from accepts)")
    p.add_argument("--eos-token", metavar="TOKEN", help="the end-of-text token (default: the tokenizer's own)")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help="bpe: the vocabulary learned")
    p.add_argument("--sample-docs", type=int, default=d.sample_docs, help="bpe: at most this many documents ...")
    p.add_argument("--sample-bytes", type=int, default=d.sample_bytes, help="bpe: ... and characters train it")
    p.add_argument("--text-field", default=d.text_field, help="the text field of .jsonl/.parquet/datasets rows")
    p.add_argument("--txt-docs", choices=("blank", "line", "file"), default=d.txt_docs,
                   help="a .txt document: a blank-line separated block (default), a line, or the whole file")
    p.add_argument("--split", default=d.split, help="the split of a DatasetDict or hub dataset")
    p.add_argument("--val-fraction", type=float, default=d.val_fraction, help="documents held out for val")
    p.add_argument("--seed", type=int, default=d.seed, help="draws the val documents")
    p.add_argument("--num-workers", type=int, default=d.num_workers, help="tokenizer processes")
    p.add_argument("--unit-bytes", type=int, default=d.unit_bytes, help="the resumable grain (bytes of source)")
    p.add_argument("--chunk-bytes", type=int, default=d.chunk_bytes, help="litdata chunk size on disk")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--progress-every", type=float, metavar="SECONDS", default=None,
                   help="where stderr is not a terminal (a log, a pipe), print each long step's progress (rate, ETA) "
                   "every SECONDS (default: 10; a terminal shows a bar)")
    i = sub.add_parser("info", help="print a prepared folder's manifest")
    i.add_argument("out", metavar="OUT")
    return ap


def main(argv: Optional[list] = None) -> None:
    args = _parser().parse_args(argv)
    try:
        if args.command == "info":  # checked as data=shards checks it: the manifest, tokenizer.json, both splits
            print(describe(read_prepared_folder(args.out, field="OUT")))
            return
        kind = args.tokenizer or ("file" if args.tokenizer_file else "model" if args.tokenizer_model else "bpe")
        opts = {k: v for k, v in vars(args).items() if k not in ("command", "src", "out", "quiet", "progress_every")}
        progress = False if args.quiet else True if args.progress_every is None else args.progress_every
        prepare(args.src, args.out, **{**opts, "tokenizer": kind, "progress": progress})
    except ConfigError as e:
        print(f"attnzoo-data: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
