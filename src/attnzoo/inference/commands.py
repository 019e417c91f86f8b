"""The command lines of `attnzoo-generate` and `attnzoo-eval`: parsed and checked without torch (issue 45: a
refused flag, a missing run dir, a truncated checkpoint file or a GPU device on a CPU machine is reported in
the time of Python's start, not after torch's ~1.7 s import), then handed to inference/generate.py, which
loads the run and does the work (and checks what needs the run: its positions, its KV layers, its device).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Optional

from attnzoo.config.errors import ConfigError
from attnzoo.config.machine import no_cuda_reason
from attnzoo.config.paths import unwritable
from attnzoo.distributed.checkpoint_files import META, check_checkpoint_file, is_sharded_checkpoint

KV_FLAGS = ("--kv-cache-dtype", "--kv-group-size", "--kv-residual")
# the device types torch.device() parses (c10/core/DeviceType.cpp); which of them this machine has is torch's call
TORCH_DEVICE_TYPES = ("cpu", "cuda", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve", "fpga", "maia", "xla",
                      "vulkan", "metal", "xpu", "mps", "meta", "hpu", "lazy", "ipu", "mtia", "privateuseone")


def kv_format_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--kv-cache-dtype", help="KV-cache format: fp32, bf16, int8, int4 (KIVI) (default: the run's "
                    "inference.kv_cache_dtype)")
    ap.add_argument("--kv-group-size", type=int, help="G: tokens per key scale, channels per value scale "
                    "(default: the run's inference.kv_group_size)")
    ap.add_argument("--kv-residual", type=int, help="R: recent tokens kept in full precision (default: the run's "
                    "inference.kv_residual)")


def device_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:N, mps (default: cuda when one is visible)")


def resolve_checkpoint(path: str | Path, best: bool = False) -> Path:
    """A run dir (its checkpoints/last.ckpt, or best.ckpt) or a checkpoint (a file, or a sharded folder)."""
    p = Path(path).expanduser()
    if p.is_dir() and not is_sharded_checkpoint(p) and ((p / META).exists() or any(p.glob("*.distcp"))):
        check_checkpoint_file(p, field="checkpoint")  # a sharded folder whose save did not finish: that, not "no run"
    if p.is_dir() and not is_sharded_checkpoint(p):  # a run dir (a sharded checkpoint, trainer=fsdp, is a folder too)
        ck = p / "checkpoints" / ("best.ckpt" if best else "last.ckpt")
        if not ck.exists():
            raise ConfigError(f"{p} has no checkpoints/{ck.name}; allowed: a run dir with one, or a .ckpt file",
                              field="checkpoint")
        return ck
    if not p.exists():
        raise ConfigError(f"{p} does not exist; allowed: a run dir or a .ckpt file", field="checkpoint")
    return p


def precheck_device(device: Optional[str], field: str = "--device") -> None:
    """What can be said of `device` without torch: on a machine certainly without CUDA (config/machine.py) and
    not a Mac, only the CPU exists, so any other device is refused in the line the full check (generate.py
    check_device) gives. Elsewhere torch decides."""
    if device is None or sys.platform == "darwin" or no_cuda_reason() is None:
        return
    m = re.fullmatch(r"([a-z_]+)(?::\d+)?", device)
    if not m or m.group(1) not in TORCH_DEVICE_TYPES:
        raise ConfigError(f"unknown device {device!r}; allowed: cpu", field=field)
    if m.group(1) != "cpu":
        raise ConfigError(f"{device}: no such device on this machine; allowed: cpu", field=field)


def check_out_file(out: Optional[Path], field: str = "--out") -> None:
    """An output file path that can be written: not a directory, not under a file or a read-only directory."""

    if out is None:
        return
    if out.is_dir():
        raise ConfigError(f"{out} is a directory; allowed: a file path", field=field)
    why = unwritable(out)
    if why:
        raise ConfigError(f"{out} cannot be written ({why}); allowed: a path under a writable directory", field=field)


def check_sampling(temperature: float, top_k: Optional[int], top_p: Optional[float]) -> None:
    if not temperature >= 0:  # NaN too
        raise ConfigError(f"must be >= 0 (0: greedy), got {temperature}", field="--temperature")
    if top_k is not None and top_k < 0:
        raise ConfigError(f"must be >= 0 (0: no top-k cut), got {top_k}", field="--top-k")
    if top_p is not None and not 0 < top_p <= 1:
        raise ConfigError(f"must be in (0, 1] (1: no nucleus cut), got {top_p}", field="--top-p")


def read_prompts(path: Path) -> str:
    """A --prompts file's text (was: a UnicodeDecodeError traceback for a file that is not UTF-8)."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (invalid byte at offset {e.start}); allowed: a UTF-8 text file "
                          f"with one prompt per line", field="--prompts") from None


def precheck_kv_format(args: argparse.Namespace) -> None:
    """The KV-cache flags' own values (a dtype, G >= 1, R >= 0) before the checkpoint is read (was: after loading
    it); what needs the run (its layers, its head_dim, its own inference section) is checked once it is loaded."""
    from attnzoo.mixers.kv_format import KVFormat

    given = [args.kv_cache_dtype, args.kv_group_size, args.kv_residual]
    if any(v is not None for v in given):
        d = KVFormat()
        KVFormat(given[0] or d.dtype, d.group_size if given[1] is None else given[1],
                 d.residual if given[2] is None else given[2]).check(fields=KV_FLAGS)


def precheck_checkpoint(path: str, best: bool) -> None:
    """The checkpoint's path and file (a truncated zip, a folder without its index): before torch reads it."""
    ckpt = resolve_checkpoint(path, best)
    if not is_sharded_checkpoint(ckpt):
        check_checkpoint_file(ckpt, field="checkpoint")


def check_prompt_fit(prompts: list, encode, position: str, max_seq_len: int, max_new_tokens: int,
                     extrapolate: bool = False) -> None:
    """Every prompt encodes to tokens and fits model.max_seq_len with its new tokens (`model.max_seq_len`: the
    longest prompt + generation, config/schema.py), for every position method: with learned positions a hard limit
    (the table), with computed ones unless `extrapolate`. Checked for all prompts before the first is sampled; by
    precheck_prompt_fit on the checkpoint's saved config (torch-free) and by generate.py on the loaded run."""
    limit = max_seq_len if position == "learned" else None
    if limit is None and not extrapolate:
        for i, prompt in enumerate(prompts):
            n = len(encode(prompt))
            which = "the prompt" if len(prompts) == 1 else f"prompt {i + 1}"
            if n + max_new_tokens > max_seq_len:
                raise ConfigError(f"{which} ({n} tokens) + {max_new_tokens} new tokens exceed model.max_seq_len="
                                  f"{max_seq_len} ({position} positions: lengths the model is not sized for); "
                                  f"allowed: <= {max(max_seq_len - n, 0)}, or --extrapolate to generate past it",
                                  field="--max-new-tokens")
    field = "prompt" if len(prompts) == 1 else "--prompts"
    for i, prompt in enumerate(prompts):
        n = len(encode(prompt))
        which = "the prompt" if len(prompts) == 1 else f"prompt {i + 1}"
        if n == 0:
            raise ConfigError(f"{which} encodes to no tokens", field=field)
        if limit is not None and n >= limit:
            raise ConfigError(f"{which} ({n} tokens) fills the learned position table (model.max_seq_len={limit}); "
                              f"allowed: a prompt of < {limit} tokens", field=field)
        if limit is not None and n + max_new_tokens > limit:
            raise ConfigError(f"{which} ({n} tokens) + {max_new_tokens} new tokens exceed the learned position "
                              f"table (model.max_seq_len={limit}); allowed: <= {limit - n}", field="--max-new-tokens")


def saved_prompt_encoder(cfg: dict):
    """The run's prompt encoding from its saved config, without torch or Lightning (what its data module's `encode`
    does: the text corpus's tokenizer from the run's cache, a prepared folder's tokenizer.json, token ids for a
    synthetic task), or None where that needs more than reading files (a data.source to prepare, a missing file)."""
    from attnzoo.data import DATAMODULES

    data = cfg.get("data") or {}
    name = data.get("name", "text")
    if name not in DATAMODULES.names():
        return None
    if name not in ("text", "shards"):  # a synthetic task's prompt is token ids (LoadedRun.encode without `encode`)
        natural = getattr(DATAMODULES.get(name).config_cls, "natural_text", False)
        return None if natural else (lambda s: [int(t) for t in s.split()])
    from attnzoo.data.tokenizer import FileTokenizer

    if name == "shards":
        path = data.get("path")
        tok_file = Path(str(path)).expanduser() / "tokenizer.json" if path else None
        return FileTokenizer.from_file(tok_file).encode if tok_file is not None and tok_file.is_file() else None
    if name != "text":
        return None
    if data.get("tokenizer") == "file":
        tok_file = Path(str(data.get("tokenizer_file"))).expanduser()
        return FileTokenizer.from_file(tok_file).encode if tok_file.is_file() else None
    from attnzoo.data.corpus import load_corpus, text_sha
    from attnzoo.data.tokenizer import get_tokenizer

    text, _ = load_corpus(data.get("path"), data.get("max_chars"))
    cache = Path((cfg.get("paths") or {}).get("cache_dir") or "~/.cache/attnzoo").expanduser()
    return get_tokenizer(data.get("tokenizer", "bpe"), text, data.get("vocab_size"), cache, text_sha(text)).encode


def precheck_prompt_fit(args: argparse.Namespace, prompts: list) -> None:
    """check_prompt_fit on the config the checkpoint carries, read without torch (issue 45: a prompt past the
    learned table is refused in the time of Python's start, not after torch and the run are loaded). Where the
    config cannot be read so (a sharded checkpoint, an unexpected archive, a data.source to prepare) nothing is
    said here: generate.py makes the same check on the loaded run."""
    from attnzoo.distributed.checkpoint_files import saved_run_config
    from attnzoo.training.families import family_of

    ckpt = resolve_checkpoint(args.run, args.best)
    cfg = None if is_sharded_checkpoint(ckpt) else saved_run_config(ckpt)
    if cfg is None or not isinstance(cfg.get("model"), dict):
        return
    model = cfg["model"]
    try:
        if not family_of(model).decoder_only:
            return
        encode = saved_prompt_encoder(cfg)
        if encode is None:
            return
        encode(prompts[0])
    except (ConfigError, ValueError, OSError, TypeError, KeyError):  # the loaded run reports it as before
        return
    position = (model.get("position") or {}).get("name", "none")
    check_prompt_fit(prompts, encode, position, int(model["max_seq_len"]), args.max_new_tokens, args.extrapolate)


# ----------------------------------------------------------------------------- attnzoo-generate


def generate_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="attnzoo-generate", description="Sample from a trained run (decoder LMs).")
    ap.add_argument("run", help="a run directory (its checkpoints/last.ckpt) or a .ckpt file")
    ap.add_argument("prompt", nargs="?", help="the prompt (synthetic tasks: space-separated token ids)")
    ap.add_argument("--prompts", type=Path, help="a file with one prompt per line (instead of PROMPT)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="prompt + new tokens: at most model.max_seq_len "
                    "(past it with --extrapolate, except with learned positions)")
    ap.add_argument("--extrapolate", action="store_true", help="let prompt + new tokens pass model.max_seq_len with "
                    "computed positions (rope, alibi, sinusoidal, none): lengths the model is not sized for")
    ap.add_argument("--temperature", type=float, default=0.8, help=">= 0; 0 = greedy")
    ap.add_argument("--top-k", type=int, default=40, help=">= 0; 0 = no top-k cut")
    ap.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--best", action="store_true", help="use checkpoints/best.ckpt")
    device_arg(ap)
    ap.add_argument("--batch-size", type=int, default=8, help="prompts of --prompts decoded together (>= 1)")
    ap.add_argument("--compile", choices=("auto", "true", "false"), default="auto", help="compile the decode step "
                    "once (static cache; auto: on CUDA, where it pays at once; on a CPU the first compile takes ~20 s)")
    kv_format_args(ap)
    return ap


def precheck_generate(args: argparse.Namespace) -> list[str]:
    """attnzoo-generate's refusals that need neither torch nor the run; returns the prompts."""
    if args.batch_size < 1:
        raise ConfigError(f"must be >= 1, got {args.batch_size}", field="--batch-size")
    if (args.prompt is None) == (args.prompts is None):
        raise ConfigError("give one of PROMPT or --prompts FILE", field="prompt")
    if args.prompts is not None and args.prompts.is_dir():
        raise ConfigError(f"{args.prompts} is a directory; allowed: a text file with one prompt per line",
                          field="--prompts")
    if args.prompts is not None and not args.prompts.is_file():
        raise ConfigError(f"{args.prompts} does not exist", field="--prompts")
    if args.max_new_tokens < 1:
        raise ConfigError(f"must be >= 1, got {args.max_new_tokens}", field="--max-new-tokens")
    check_sampling(args.temperature, args.top_k, args.top_p)
    precheck_device(args.device)
    precheck_kv_format(args)
    prompts = [args.prompt] if args.prompt is not None else \
        [p for p in read_prompts(args.prompts).splitlines() if p.strip()]
    if not prompts:
        raise ConfigError(f"{args.prompts} holds no prompt (no non-blank line); allowed: one prompt per line",
                          field="--prompts")
    precheck_checkpoint(args.run, args.best)
    precheck_prompt_fit(args, prompts)
    return prompts


def generate_main(argv: list[str] | None = None) -> None:
    args = generate_parser().parse_args(argv)
    try:
        prompts = precheck_generate(args)
        from attnzoo.inference.generate import default_device, run_generate

        args.device = args.device or default_device()
        run_generate(args, prompts)
    except ConfigError as e:
        print(f"attnzoo-generate: error: {e}", file=sys.stderr)
        sys.exit(2)


# ----------------------------------------------------------------------------- attnzoo-eval


def eval_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="attnzoo-eval", description="Evaluate a trained run; writes JSON.")
    ap.add_argument("run", help="a run directory (its checkpoints/last.ckpt) or a .ckpt file")
    ap.add_argument("--text", type=Path, help="a text file to evaluate on (the run's tokenizer) instead of its val split")
    ap.add_argument("--context-lengths", type=int, nargs="*", default=[], help="also evaluate at these lengths (>= 2)")
    ap.add_argument("--max-batches", type=int, default=None,
                    help=">= 1 (default: every batch of the validation split or --text, which can be more than the "
                         "run's own validation scored: trainer.limit_val_batches, e.g. 2 with debug=smoke; the output "
                         "says how many batches and tokens it scored and what the run's limit was)")
    ap.add_argument("--best", action="store_true", help="use checkpoints/best.ckpt")
    ap.add_argument("--out", type=Path, help="JSON path (default: <run dir>/eval.json, with --task niah niah.json and "
                    "its heatmap niah.png; or next to the .ckpt)")
    device_arg(ap)
    kv_format_args(ap)
    niah = ap.add_argument_group("needle in a haystack (--task niah: RULER's NIAH tasks and passkey, offline; "
                                 "docs/long_context.md)")
    niah.add_argument("--task", choices=("lm", "niah"), default="lm", help="lm: loss / perplexity (default); niah: "
                      "retrieval accuracy per task, context length and needle depth, with a heatmap")
    niah.add_argument("--niah-tasks", default=",".join(DEFAULT_NIAH_TASKS),
                      help="comma-separated, of: niah_single_1..3, niah_multikey_1..3, niah_multivalue, "
                           "niah_multiquery, passkey (default: %(default)s)")
    niah.add_argument("--lengths", type=int, nargs="+", help="context lengths in the run's tokens (default: the "
                      "run's data.seq_len x 1, 2, 4)")
    niah.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0],
                      help="needle depths, fractions of the haystack in [0, 1] (default: 0 0.25 0.5 0.75 1)")
    niah.add_argument("--samples", type=int, help="prompts per (task, length, depth) (default 4; a data=needle run: "
                      "examples per (length, depth), default 256)")
    niah.add_argument("--haystack", type=Path, help="a text file or folder for the text haystacks (default: the "
                      "run's own corpus)")
    niah.add_argument("--seed", type=int, default=0)
    niah.add_argument("--max-new-tokens", type=int, help="completion length (default: the answers' tokens + 4)")
    niah.add_argument("--batch-size", type=int, default=4, help="prompts decoded together (default 4)")
    niah.add_argument("--extrapolate", action="store_true", help="lengths past model.max_seq_len (computed "
                      "positions only)")
    return ap


DEFAULT_NIAH_TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1", "passkey")


def precheck_niah(args: argparse.Namespace) -> None:
    """--task niah's settings, before torch: the tasks, lengths and depths (data/needles.check_request), the counts,
    a --haystack that exists, and no option of the lm evaluation beside it."""
    from attnzoo.data.needles import check_request

    if args.task != "niah":
        return
    for flag, given in (("--text", args.text is not None), ("--context-lengths", bool(args.context_lengths)),
                        ("--max-batches", args.max_batches is not None)):
        if given:
            raise ConfigError("is an option of --task lm; allowed with --task niah: --niah-tasks, --lengths, "
                              "--depths, --samples, --haystack", field=flag)
    args.niah_tasks = [t.strip() for t in str(args.niah_tasks).split(",") if t.strip()]
    check_request(args.niah_tasks, args.lengths or [1], args.depths)
    for flag, value in (("--samples", 1 if args.samples is None else args.samples), ("--batch-size", args.batch_size),
                        ("--max-new-tokens", 1 if args.max_new_tokens is None else args.max_new_tokens)):
        if value < 1:
            raise ConfigError(f"must be >= 1, got {value}", field=flag)
    if args.haystack is not None and not args.haystack.exists():
        raise ConfigError(f"{args.haystack} does not exist; allowed: a text file or a folder of text files",
                          field="--haystack")


def precheck_eval(args: argparse.Namespace) -> None:
    """attnzoo-eval's refusals that need neither torch nor the run."""
    precheck_niah(args)
    short = [L for L in args.context_lengths if L < 2]
    if short:
        raise ConfigError(f"got {' '.join(map(str, short))}; allowed: lengths >= 2 (a prediction needs a "
                          f"token before it)", field="--context-lengths")
    if args.max_batches is not None and args.max_batches < 1:
        raise ConfigError(f"must be >= 1, got {args.max_batches}; allowed: omit it for every batch",
                          field="--max-batches")
    check_out_file(args.out)
    precheck_device(args.device)
    precheck_kv_format(args)
    if args.text is not None and not args.text.exists():
        raise ConfigError(f"{args.text} does not exist; allowed: a text file or a folder of text files", field="--text")
    precheck_checkpoint(args.run, args.best)


def eval_main(argv: list[str] | None = None) -> None:
    args = eval_parser().parse_args(argv)
    try:
        precheck_eval(args)
        from attnzoo.inference.generate import default_device, run_eval

        args.device = args.device or default_device()
        run_eval(args)
    except ConfigError as e:
        print(f"attnzoo-eval: error: {e}", file=sys.stderr)
        sys.exit(2)
