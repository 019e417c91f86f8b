"""`attnzoo-ckpt consolidate SRC DST` (a sharded FSDP checkpoint folder as one .ckpt file) and `attnzoo-ckpt info
CKPT` (what a checkpoint holds: step, form, parameters); the work is attnzoo.training.fsdp / checkpoint_io."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from attnzoo.config.errors import ConfigError
from attnzoo.distributed.checkpoint_files import check_checkpoint_file, check_consolidate_paths, is_sharded_checkpoint

# torch is imported once the paths were checked (issue 45: a refused path in the time of Python's start)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="attnzoo-ckpt", description="Checkpoint tools; see docs/distributed.md.")
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write a sharded (trainer=fsdp) checkpoint as one .ckpt file, which "
                       "attnzoo-eval / -generate / -export, attnzoo.load and DDP or 1-process resumes read")
    c.add_argument("src", metavar="SRC", help="a sharded checkpoint folder (a run's checkpoints/last.ckpt)")
    c.add_argument("dst", metavar="DST", help="the .ckpt file to write")
    i = sub.add_parser("info", help="a checkpoint's step, form (file or sharded folder) and parameter count")
    i.add_argument("ckpt", metavar="CKPT")
    return ap


def describe(path: str) -> str:
    check_checkpoint_file(path, field="CKPT")
    from attnzoo.training.checkpoint_io import check_checkpoint

    state = check_checkpoint(path, field="CKPT")
    form = "sharded folder (torch.distributed.checkpoint)" if is_sharded_checkpoint(path) else "single file"
    n = sum(v.numel() for k, v in state["state_dict"].items() if hasattr(v, "numel"))
    return f"{path}: {form}, global_step {state['global_step']}, {len(state['state_dict'])} tensors ({n:,} values)"


def main(argv: Optional[list] = None) -> None:
    args = _parser().parse_args(argv)
    try:
        if args.command == "info":
            print(describe(args.ckpt))
            return
        check_consolidate_paths(args.src, args.dst)
        from attnzoo.training.fsdp import consolidate

        out = consolidate(args.src, args.dst)
        print(f"attnzoo-ckpt: wrote {out} ({Path(out).stat().st_size / 2**20:.1f} MiB) from {args.src}")
    except ConfigError as e:
        print(f"attnzoo-ckpt: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
