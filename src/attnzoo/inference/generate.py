"""Use what you trained: `attnzoo.load`, `attnzoo-generate` and `attnzoo-eval`.

    import attnzoo
    run = attnzoo.load("outputs/train/2026-12-01_10-00-00")     # a run dir (its last.ckpt) or a .ckpt
    run.model, run.config, run.encode("def f("), run.decode([...])

    attnzoo-generate RUN_DIR "def fib(n):" --max-new-tokens 64 --temperature 0.8 --top-k 40
    attnzoo-generate RUN_DIR --prompts prompts.txt               # one prompt per line, one completion each,
                                                                 # --batch-size of them decoded together
    attnzoo-eval RUN_DIR                                         # val loss / ppl (/ acc) on the run's data
    attnzoo-eval RUN_DIR --text other.txt --context-lengths 512 1024 --out eval.json
    attnzoo-eval RUN_DIR --kv-cache-dtype int4                   # + val/loss_kvq(_delta) through a KIVI int4 cache
    attnzoo-generate RUN_DIR "def " --kv-cache-dtype int8        # sample from an int8 KV cache

`--kv-cache-dtype fp32|bf16|int8|int4`, `--kv-group-size G`, `--kv-residual R` default to the run's own
`inference.*` settings (attnzoo.mixers.kv_quant). Decoding goes through attnzoo.models.decoding.Decoder: a static
cache (the dynamic one for mixers and KV formats without a static form), the step compiled with --compile (auto:
on CUDA).

Checkpoints are read with `torch.load(weights_only=True)`; a missing, corrupt or mismatched checkpoint
(weights that do not fit the config it carries) is refused in one line, exit status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader

from attnzoo.analysis.extrapolation import evaluate_kv_format, evaluate_lengths, evaluate_loader
from attnzoo.config.errors import ConfigError
from attnzoo.config.schema import InferenceConfig, resolve_model, tagged
from attnzoo.data import DATAMODULES, build_datamodule
from attnzoo.data.corpus import load_corpus
from attnzoo.data.text import Blocks
from attnzoo.mixers.kv_quant import KVFormat, coverage, quantizes
from attnzoo.models.decoding import Decoder
from attnzoo.training.checkpoint_io import check_checkpoint
from attnzoo.training.families import family_of


@dataclass
class LoadedRun:
    model: torch.nn.Module  # eval mode, on `device`
    lit: Any  # the LightningModule (loss / accuracy as in training)
    config: dict  # the run's resolved config (as saved in the checkpoint)
    datamodule: Any  # the run's data module, set up (its tokenizer for text)
    checkpoint: Path
    global_step: int

    @property
    def encode(self) -> Callable[[str], list]:
        if hasattr(self.datamodule, "encode"):
            return self.datamodule.encode
        return lambda s: [int(t) for t in s.split()]  # synthetic tasks: prompts are token ids

    @property
    def decode(self) -> Callable[[list], str]:
        if hasattr(self.datamodule, "decode"):
            return self.datamodule.decode
        return lambda ids: " ".join(map(str, ids))


def load(path: str | Path, *, best: bool = False, device: str = "cpu", cache_dir: Optional[str] = None) -> LoadedRun:
    """The model of a run, ready to use: `path` is a run dir (its checkpoints/last.ckpt, or best.ckpt with
    best=True) or a .ckpt file. Returns a `LoadedRun`: the model in eval mode on `device`, its LightningModule,
    the run's resolved config (as saved in the checkpoint), its data module set up for validation (the
    tokenizer of a text run: `encode` / `decode`), the checkpoint path and its global step. `cache_dir`: where
    the data module finds its cached tokenizer (default: the run's paths.cache_dir).

    Refused (ConfigError, one line naming `checkpoint`): a path that does not exist, a run dir without the
    checkpoint, a file that is not a readable checkpoint (read with weights_only=True), a checkpoint without an
    attnzoo run config, weights that do not fit the config it carries."""

    ckpt_path = resolve_checkpoint(path, best)
    state = check_checkpoint(ckpt_path, field="checkpoint")
    hp = state.get("hyper_parameters") or {}
    cfg = hp.get("cfg")
    if not isinstance(cfg, dict) or "model" not in cfg or "data" not in cfg:
        raise ConfigError(f"{ckpt_path} carries no attnzoo run config (hyper_parameters.cfg)", field="checkpoint")
    data_cfg = tagged(DATAMODULES, cfg["data"], "data", default_name="text")
    cache = cache_dir or (cfg.get("paths") or {}).get("cache_dir") or "~/.cache/attnzoo"
    dm = build_datamodule(data_cfg, cache_dir=cache, seed=cfg.get("seed", 0))
    dm.setup("validate")
    family = family_of(cfg["model"])
    lit = family.build_lit(cfg, resolve_model(cfg["model"], vocab_size=dm.vocab_size), dm)
    try:
        lit.load_state_dict(state["state_dict"], strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise ConfigError(f"{ckpt_path}: the weights do not fit the config it carries ({first[1].strip()[:160] if len(first) > 1 else first[0][:160]})",
                          field="checkpoint") from None
    lit.to(device).eval()
    return LoadedRun(lit.model, lit, cfg, dm, ckpt_path, int(state["global_step"]))


# ----------------------------------------------------------------------------- KV-cache format


def kv_format_of(run: LoadedRun, args: argparse.Namespace):
    """The KV-cache format from the command line, else the run's `inference` section, else the defaults;
    checked (one-line ConfigError naming the flag). Not fp32: decoder LMs with an mha / gqa / mqa layer."""

    own = InferenceConfig(**(run.config.get("inference") or {}))  # a run from before the section: the defaults
    fmt = KVFormat(args.kv_cache_dtype or own.kv_cache_dtype,
                   own.kv_group_size if args.kv_group_size is None else args.kv_group_size,
                   own.kv_residual if args.kv_residual is None else args.kv_residual)
    decoder = family_of(run.config["model"]).decoder_only
    fmt.check(head_dims=[m.head_dim for m in run.model.mixers if quantizes(m)] if decoder else [], fields=KV_FLAGS)
    if fmt.dtype != "fp32" and not decoder:
        raise ConfigError(f"KV-cache formats are for decoder LMs; allowed with this "
                          f"{family_of(run.config['model']).name} model: fp32", field="--kv-cache-dtype")
    if decoder:  # a layer it applies to (the length is checked where it is known: attnzoo-eval)
        coverage(fmt, [m.name for m in run.model.layer_mixers], None, fields=KV_FLAGS)
    return fmt


# ----------------------------------------------------------------------------- command-line checks (before any work)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str, field: str = "--device") -> None:
    """A device torch knows and this machine has: one line, before the checkpoint is read."""
    allowed = "cpu" + (", cuda, cuda:N" if torch.cuda.is_available() else "") + (
        ", mps" if torch.backends.mps.is_available() else "")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"unknown device {device!r}; allowed: {allowed}", field=field) from None
    if dev.type == "cpu":
        return
    if dev.type == "cuda" and torch.cuda.is_available():
        if dev.index is None or dev.index < torch.cuda.device_count():
            return
        raise ConfigError(f"{device}: this machine has {torch.cuda.device_count()} CUDA device(s); allowed: {allowed}",
                          field=field)
    if dev.type == "mps" and torch.backends.mps.is_available():
        return
    raise ConfigError(f"{device}: no such device on this machine; allowed: {allowed}", field=field)


# ----------------------------------------------------------------------------- generate


@torch.no_grad()
def stream(run: LoadedRun, prompt: str, max_new_tokens: int, temperature: float, top_k: Optional[int],
           top_p: Optional[float], seed: int, write: Callable[[str], Any], kv_format=None,
           decoder: Optional[Decoder] = None) -> str:
    """Sample a completion token by token (`decoder`, a batch-1 attnzoo.models.decoding.Decoder; default: the
    static cache, eager, keys/values in `kv_format`), writing each decoded piece as
    it comes: whole characters only (`complete_text`), so a byte-level BPE token that ends inside a UTF-8
    character is held back until the token that completes it. Returns the text written."""

    ids = run.encode(prompt)
    if not ids:
        raise ConfigError("the prompt encodes to no tokens", field="prompt")
    dec = decoder or Decoder(run.model, 1, len(ids) + max_new_tokens, compile=False, kv_format=kv_format)
    g = torch.Generator(device=next(run.model.parameters()).device).manual_seed(seed)
    out: list = []
    shown = ""

    def on_tokens(row: list) -> None:
        nonlocal shown
        out.append(row[0])
        text = complete_text(run.decode(out))
        if len(text) > len(shown) and text.startswith(shown):
            write(text[len(shown):])
            shown = text

    dec.generate([ids], max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, generator=g,
                 on_tokens=on_tokens)
    return shown


def complete_text(decoded: str) -> str:
    """`decoded` without a trailing run of U+FFFD: the bytes of a UTF-8 character whose last byte has not been
    generated yet decode (errors=replace, as HF's byte-level decoder does) to U+FFFD; once the token that
    completes it comes, the whole ids decode to the character. A U+FFFD that stays (bytes that never form a
    character) is written as soon as any character follows it; one the generation ends on is dropped."""
    return decoded.rstrip("\ufffd")


def run_generate(args: argparse.Namespace, prompts: list[str]) -> None:
    """attnzoo-generate's work, after its command line was checked (inference/commands.py)."""
    check_device(args.device)
    run = load(args.run, best=args.best, device=args.device)

    if not family_of(run.config["model"]).decoder_only:
        raise ConfigError(f"{run.checkpoint} is a {family_of(run.config['model']).name} model; allowed: a decoder LM",
                          field="checkpoint")
    fmt = kv_format_of(run, args)
    _check_prompts(run, prompts, args.max_new_tokens, extrapolate=args.extrapolate)
    ids = [run.encode(p) for p in prompts]
    batch = min(args.batch_size, len(prompts))
    compiled = args.device.startswith("cuda") if args.compile == "auto" else args.compile == "true"
    dec = Decoder(run.model, batch, max(map(len, ids)) + args.max_new_tokens, compile=compiled, kv_format=fmt)
    if len(prompts) == 1:  # streamed as it comes
        print(prompts[0], end="", flush=True)
        stream(run, prompts[0], args.max_new_tokens, args.temperature, args.top_k or None, args.top_p, args.seed,
               lambda s: print(s, end="", flush=True), decoder=dec)
        print(flush=True)
        return
    g = torch.Generator(device=args.device).manual_seed(args.seed)
    for start in range(0, len(prompts), batch):  # `batch` prompts decoded together, each at its own position
        gen = dec.generate(ids[start:start + batch], args.max_new_tokens, temperature=args.temperature,
                           top_k=args.top_k or None, top_p=args.top_p, generator=g, decode=run.decode)
        for i, text in enumerate(gen.text):
            print(f"--- prompt {start + i + 1}: {prompts[start + i]!r}", flush=True)
            print(prompts[start + i] + complete_text(text), flush=True)


def _check_prompts(run: LoadedRun, prompts: list, max_new_tokens: int, extrapolate: bool = False) -> None:
    """inference/commands.py check_prompt_fit on the loaded run (its model's positions, its tokenizer)."""
    cfg = run.model.cfg
    check_prompt_fit(prompts, run.encode, getattr(getattr(cfg, "position", None), "name", "none"), cfg.max_seq_len,
                     max_new_tokens, extrapolate)


# ----------------------------------------------------------------------------- eval


def evaluate(run: LoadedRun, loader, max_batches: Optional[int] = None) -> dict:
    """val/loss, val/ppl (/ val/acc) of a loaded decoder LM over a loader (attnzoo.analysis.extrapolation)."""

    return evaluate_loader(run.lit, loader, max_batches)


def scored_batches(loader, max_batches: Optional[int], run_trainer: Optional[dict]) -> dict:
    """How many batches attnzoo-eval scores of `loader` and, for the run's own validation split
    (`run_trainer`: its trainer section), how many its validation scored (trainer.limit_val_batches, with
    Lightning's meaning: an int counts batches, a float is a fraction), in one line for the output."""
    try:
        total = len(loader)
    except TypeError:  # an iterable dataset: no length to compare with
        return {"batches": max_batches, "line": f"scored {max_batches or 'every'} batch(es)"}
    n = min(total, max_batches) if max_batches else total
    line = f"scored {n} of {total} batches"
    out = {"batches": n, "of": total}
    if run_trainer is not None:
        limit = run_trainer.get("limit_val_batches", 1.0)
        limit = 1.0 if limit is None else limit
        own = min(total, limit) if isinstance(limit, int) and not isinstance(limit, bool) else int(total * float(limit))
        out.update(run_limit_val_batches=limit, run_batches=own)
        line += f" of the validation split; the run's own validation scored {own} (trainer.limit_val_batches={limit})"
        if own != n:
            line += f", so val/loss can differ from its summary's; --max-batches {own} matches it"
    out["line"] = line
    return out


def run_eval(args: argparse.Namespace) -> None:
    """attnzoo-eval's work, after its command line was checked (inference/commands.py)."""
    check_device(args.device)
    run = load(args.run, best=args.best, device=args.device)

    if getattr(args, "task", "lm") == "niah":
        return _run_niah(args, run)
    family = family_of(run.config["model"])
    fmt = kv_format_of(run, args)
    kv_quant = ""
    if family.decoder_only:  # what the format stores at the run's length; refused where it stores nothing

        kv_quant = coverage(fmt, [m.name for m in run.model.layer_mixers], run.config["data"]["seq_len"],
                            fields=KV_FLAGS, seq_field="the run's data.seq_len")
    if args.text is not None:
        if not hasattr(run.datamodule, "encode"):
            raise ConfigError(f"the run trained on data={run.config['data'].get('name')}; allowed with --text: a "
                              f"text run", field="--text")


        text, _ = load_corpus(str(args.text), None)
        ids = torch.tensor(run.encode(text), dtype=torch.int32)
        seq = run.config["data"]["seq_len"]
        blocks = Blocks(ids, seq)
        if len(blocks) == 0:
            raise ConfigError(f"{args.text} holds {len(ids)} tokens, fewer than one {seq}-token block", field="--text")
        loader = DataLoader(blocks, batch_size=run.config["data"].get("batch_size", 8))
        source = str(args.text)
    else:
        loader = run.datamodule.val_dataloader()
        source = f"the run's validation split (data={run.config['data'].get('name')})"
    if family.decoder_only:
        metrics = evaluate(run, loader, args.max_batches)
        # analytic cache bytes per token at the run's length, in the chosen format (kv_quant.KVFormat.kv_bytes)
        seq = run.config["data"]["seq_len"]
        dtype = next(run.model.parameters()).dtype
        metrics["cache/bytes_per_token"] = run.model.cache_bytes(seq, 1, dtype, kv_format=fmt) / seq
        if fmt.dtype != "fp32":  # val/loss_kvq(_delta): the same batches through a cache in that format

            metrics.update(evaluate_kv_format(run.lit, loader, fmt, args.max_batches))
    else:  # the other families' own validation (exact match for seq2seq, masked-token accuracy for MLM)

        res = L.Trainer(accelerator="cpu" if args.device == "cpu" else "auto", logger=False,
                        enable_progress_bar=False, limit_val_batches=args.max_batches or 1.0).validate(
            run.lit, dataloaders=loader, verbose=False)
        metrics = {k: float(v) for k, v in res[0].items()}
    if args.context_lengths:
        if not family.decoder_only:
            raise ConfigError("length evaluation is for decoder LMs", field="--context-lengths")

        data_cfg = tagged(DATAMODULES, run.config["data"], "data", default_name="text")
        metrics.update(evaluate_lengths(run.lit, run.datamodule, data_cfg, args.context_lengths, args.max_batches or 8))
    scored = scored_batches(loader, args.max_batches, None if args.text else run.config.get("trainer") or {})
    result = {"checkpoint": str(run.checkpoint), "global_step": run.global_step, "source": source,
              "kv_format": dataclasses.asdict(fmt), **({"kv_quant": kv_quant} if kv_quant else {}),
              "scored": scored, "metrics": metrics}
    out = args.out or beside_run(run, "eval")
    out.write_text(json.dumps(result, indent=2))
    print(scored["line"] + (f" (tokens {int(metrics['tokens']):,})" if "tokens" in metrics else ""))
    if kv_quant:
        print(f"kv-quant: {kv_quant}")
    for k, v in metrics.items():
        print(f"{k:28s} {v:.6g}")
    print(f"wrote {out}")


def beside_run(run: LoadedRun, name: str) -> Path:
    """attnzoo-eval's default output: <run dir>/<name>.json, or <ckpt>.<name>.json beside a checkpoint elsewhere."""
    ckpt = run.checkpoint
    return ckpt.parent.parent / f"{name}.json" if ckpt.parent.name == "checkpoints" else ckpt.with_suffix(f".{name}.json")


def _run_niah(args: argparse.Namespace, run: LoadedRun) -> None:
    """attnzoo-eval --task niah (inference/niah.py): accuracy per task, length and depth; JSON and heatmap."""
    from attnzoo.inference.niah import run_niah, write

    if not args.lengths:  # the run's training length and beyond it
        seq = int(run.config["data"]["seq_len"])
        args.lengths = [seq, 2 * seq, 4 * seq]
    result = run_niah(args, run)
    out = args.out or beside_run(run, "niah")
    png = write(result, out)
    for task, acc in result["by_task"].items():
        per_length = "  ".join(f"{L}: {v:.2f}" for L, v in result["by_length"][task].items())
        print(f"{task:18s} {acc:.3f}   by length  {per_length}")
    print(f"wrote {out} and {png}")


from attnzoo.inference.commands import (KV_FLAGS, check_out_file, check_prompt_fit, check_sampling,  # noqa: E402,F401
                                        eval_main, generate_main, kv_format_args, resolve_checkpoint)
