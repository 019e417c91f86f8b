"""`train(cfg)`: one training run from a composed config, start to end; returns its final metrics.

The command line over it is `attnzoo-train` (attnzoo/cli/train.py); tests and `attnzoo.api` users call `train()`
directly. A run reads top-down: accept (the config's checks, the run dir's lock), build (training/build.py,
training/trainer.py), fit, measure (training/measure.py), summarise (training/summary.py).
"""
from __future__ import annotations

import contextlib
import errno
import json
import time
from pathlib import Path

import lightning as L
from omegaconf import DictConfig, OmegaConf

from attnzoo.config.errors import ConfigError
from attnzoo.interop.hf import apply_init_from, check_init_vocab
from attnzoo.ops.dispatch import gate_notices, run_compute_dtype
from attnzoo.training.callbacks import command_start
from attnzoo.training.build import (build_module, check_kernels_present, check_schedule_continues, measured_length,
                                    prepare_data, resolve_ckpt, resolve_run_length, run_device_type)
from attnzoo.training.checkpoint_io import check_resume_compatible, flatten
from attnzoo.training.config_checks import check_devices_present, validate
from attnzoo.training.console import ConsoleLog
from attnzoo.training.launch import check_launchable, launch_workers, processes_to_launch, warm_workers
from attnzoo.training.linearize import apply_linearize
from attnzoo.training.eval_checks import check_niah_prompts, niah_haystack
from attnzoo.training.measure import final_metrics
from attnzoo.training.recipe_checks import run_checkpoint
from attnzoo.training.rundir import run_dir_lock
from attnzoo.training.summary import finish, run_summary
from attnzoo.training.trainer import build_loggers, build_trainer, fit, is_rank_zero


def train(cfg: DictConfig, on_accept=None) -> dict:
    """Train one run; returns its final metrics (`val/loss`, `perf/tokens_per_sec`, ... as in summary.json), or
    `{"status": "preempted", "global_step": N}` when a SIGTERM stopped it (last.ckpt saved; resume it).

    cfg: conf/train.yaml composed with overrides (by Hydra, `attnzoo.load_config`, or a DDP worker's resolved
    job.yaml). `model.init_from` and `experiment=linearize` are applied to it first.

    Writes into `paths.output_dir`: `.attnzoo.lock` while it runs, `train.log` (what it printed), `csv/`,
    `tensorboard/` (the configured loggers), `checkpoints/last.ckpt` (and `best.ckpt`), `summary.json`. With
    `ckpt_path` (`last` or a .ckpt path) it resumes: the same run continues, its logs continue from the
    checkpoint's step. With several devices on this node it launches DDP worker processes, which do the above.

    Refuses, with a one-line `ConfigError` and before anything is written: an invalid config, devices or
    kernels (`model.impl`) not present, a run dir another live run holds, a missing / incomplete checkpoint
    or one whose model differs, an imported model whose vocabulary does not fit the data. A disk that fills up
    during the run is also reported in one line (the last complete checkpoint is kept).

    `on_accept()` is called once the run is accepted (config valid, run dir free, resume compatible),
    before anything is written to the run dir (the CLI writes `.hydra/` there then)."""
    t_start = time.perf_counter()
    cfg = apply_init_from(cfg)  # model.init_from: the model section from that transformers config.json
    cfg = apply_linearize(cfg)  # experiment=linearize: that section becomes the student's (chosen layers linear)
    parts = validate(cfg)  # every config error surfaces here, before any work
    check_devices_present(parts["run"].trainer)
    check_launchable(parts["run"].trainer)  # several devices: through attnzoo's DDP launcher only
    check_kernels_present(parts)
    out = Path(parts["run"].paths.output_dir).expanduser()
    console = ConsoleLog(out / "train.log") if is_rank_zero() else contextlib.nullcontext()

    def accepted() -> None:  # train.log: what the run printed, from its start; nothing for a refused run
        if on_accept is not None:
            on_accept()
        if isinstance(console, ConsoleLog):
            console.start()

    try:
        with run_dir_lock(out), console:  # one live run per run dir (refused in one line before anything is written)
            return _train(cfg, parts, out, t_start, accepted)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO) and (e.errno != errno.EIO or e.filename):
            # the disk filled up during the run (or a checkpoint write failed otherwise): one line, not a traceback
            from attnzoo.training.rundir import holds_checkpoints

            what = "no space left writing" if e.errno != errno.EIO else "could not write"
            then = (f"the last complete checkpoint is kept; allowed: free space, then resume with --resume {out}"
                    if holds_checkpoints(out) else "no checkpoint was complete yet; allowed: free space, then start "
                    "the run again")
            raise ConfigError(f"{what} {e.filename or out} ({e.strerror}); {then}",
                              field="paths.output_dir") from e
        raise


def _train(cfg: DictConfig, parts: dict, out: Path, t_start: float, on_accept=None) -> dict:
    """The steps of one run, in order: build, fit, measure, summarise."""
    run = parts["run"]
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    ckpt_path, ckpt = resolve_ckpt(run_checkpoint(run), out)  # a resume, or a cooldown's branch point
    L.seed_everything(run.seed, workers=True, verbose=False)
    n_workers = processes_to_launch(run.trainer)
    if n_workers:  # the workers' fork server imports the training stack while the data is prepared here
        warm_workers()
    dm, budget = prepare_data(parts, container)
    check_init_vocab(container["model"], dm.vocab_size)  # an imported model's embedding fits the data's ids
    if run.eval.niah_tasks:  # the end of the run's needle prompts fit its lengths (in the data's own tokens)
        check_niah_prompts(run.eval, parts["data"], dm.encode, niah_haystack(parts["data"])[0])
    if ckpt is not None:  # before anything is built or written: a refused resume leaves the run dir as it was
        check_resume_compatible((ckpt.get("hyper_parameters") or {}).get("cfg"), container, ckpt_path)
    if n_workers:  # DDP on this node: fresh worker processes on this job's resolved config
        if on_accept is not None:
            on_accept()
        return _train_in_workers(container, out, n_workers, t_start)
    family, lit = build_module(container, dm, run)  # the model's own checks (e.g. a causal decoder) refuse here
    if is_rank_zero():  # fla refuses a kernel on this device (ops/dispatch.py fla_gates): auto runs torch, and says so
        for line in gate_notices(lit.model, run_device_type(run.trainer), run_compute_dtype(run.trainer)[0]):
            print(line, flush=True)
    if ckpt is None and run.branch_from and run.ckpt_path is None and family.name == "decoder":
        # a cooldown sized by trainer.max_flops / max_tokens: its steps at this model's cost give the branch point
        ckpt_path, ckpt = resolve_ckpt(run_checkpoint(run, measured_length(run, parts["data"], lit).steps), out)
        check_resume_compatible((ckpt.get("hyper_parameters") or {}).get("cfg"), container, ckpt_path)
    parts["length"] = resolve_run_length(run, parts["data"], lit, family, container, ckpt)
    check_schedule_continues(lit, ckpt, ckpt_path)  # an extended run equals the longer run, or is refused
    if on_accept is not None:
        on_accept()
    out.mkdir(parents=True, exist_ok=True)
    loggers = build_loggers(parts["logger"], out, container, None if ckpt is None else int(ckpt["global_step"]))
    trainer, throughput = build_trainer(parts, out, loggers)
    for lg in loggers:
        lg.log_hyperparams(flatten(container))
    preempted = fit(trainer, lit, dm, ckpt_path, out)
    if preempted is not None:
        return preempted
    metrics = final_metrics(trainer, lit, dm, parts, budget, throughput, family)
    summary = run_summary(trainer, lit, dm, parts, metrics, throughput, family, container, out, t_start)
    finish(trainer, out, summary, loggers)
    return metrics


def _train_in_workers(container: dict, out: Path, n_workers: int, t_start: float) -> dict:
    """DDP on this node: `n_workers` worker processes train the resolved config (each calls train() as its
    rank); their rank 0 writes summary.json, read back here. Their first_step_seconds count from this command's
    start, or from this train() call in a library process."""
    kind, since = command_start()
    launch_workers(container, out, n_workers, origin=(kind, since if kind == "command" else t_start))
    summary = json.loads((out / "summary.json").read_text())
    if summary.get("status") == "preempted":  # SIGTERM passed on to the workers: they saved last.ckpt
        return {"status": "preempted", "global_step": summary["global_step"]}
    return summary["metrics"]
