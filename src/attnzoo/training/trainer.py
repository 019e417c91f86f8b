"""The Lightning side of one run: its loggers (csv, tensorboard, wandb), its callbacks and Trainer, and the fit
itself (a SIGTERM ends it with a resumable last.ckpt and a `preempted` summary.json)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from attnzoo.data.sampling import DataPositionCallback
from attnzoo.distributed.checkpoint_files import STEP_PREFIX
from attnzoo.config.stops import run_length
from attnzoo.training.callbacks import KeepSteps, PreemptionCheckpoint, RunCheckpoint, ThroughputMonitor, TrainingSpend
from attnzoo.training.recipe_checks import branch_budget_steps
from attnzoo.ops.dispatch import run_compute_dtype
from attnzoo.training.build import run_device_type
from attnzoo.training.checkpoint_io import AtomicCheckpointIO
from attnzoo.training.console import RunHeader, RunProgressBar, quiet_lightning
from attnzoo.training.fsdp import FSDPStrategy
from attnzoo.training.launch import global_rank
from attnzoo.training.profiling import ProfileWindow
from attnzoo.training.csv_logger import ResumableCSVLogger, RowBeforeCheckpoint, RunTensorBoardLogger
from attnzoo.training.summary import describe_model
from attnzoo.training.wandb_logger import make_wandb_logger  # imports wandb only when a run asks for it


def is_rank_zero() -> bool:
    """Global rank 0 of this job (or no distributed launch at all): attnzoo's launcher and torchrun set RANK,
    srun sets SLURM_PROCID (a multi-task step)."""
    return global_rank() == 0


def run_label(max_len: int = 120) -> str:
    """The job's own overrides as a name (`mixer=gqa,num_kv_pairs=8,lr=0.003`), '' outside Hydra."""
    try:
        task = HydraConfig.get().overrides.task
    except Exception:  # noqa: BLE001 - not under Hydra
        return ""
    keep = [o for o in task if not o.startswith(("hydra.", "paths.", "+sweeps=", "sweeps=", "ckpt_path=", "logger="))]
    return ",".join(short_override(o) for o in keep)[:max_len]


def short_override(override: str) -> str:
    """`optim.lr=0.003` -> `lr=0.003`, `model/mixer=gqa` -> `mixer=gqa`: the key's last part, the value as
    given (only the characters a folder name cannot hold, `/` and NUL, become `-`)."""
    key, eq, value = override.lstrip("+~").partition("=")
    key = key.split("/")[-1].split(".")[-1]
    return f"{key}{eq}{value}".replace("/", "-").replace("\0", "-")


def build_loggers(logger_cfg: dict, out: Path, container: dict, resume_step: int | None = None) -> list:
    """The configured loggers; `resume_step` (a resumed run's checkpoint step) continues csv/metrics.csv."""
    loggers = []
    for name, opts in (logger_cfg or {}).items():
        opts = dict(opts or {})
        if name == "csv":
            loggers.append(ResumableCSVLogger(save_dir=str(out), name="csv", version="", resume_step=resume_step))
        elif name == "tensorboard":
            # <run>/tensorboard/<overrides>: `tensorboard --logdir <sweep dir>` names each run by its overrides
            # a resume continues the run's own event folder (its label may differ: a larger max_steps) and drops
            # the events logged after the checkpoint step (SummaryWriter's purge_step)
            tb_root, version, extra = out / "tensorboard", run_label(), {}
            if resume_step is not None and tb_root.is_dir():
                earlier = sorted(p.name for p in tb_root.iterdir() if p.is_dir())
                version, extra = (earlier[0] if earlier else version), {"purge_step": resume_step}
            loggers.append(RunTensorBoardLogger(save_dir=str(out), name="tensorboard", version=version,
                                                default_hp_metric=False, **extra))
        elif name == "wandb" and is_rank_zero():  # one wandb run per job, not one per rank
            wb = make_wandb_logger(opts, out, container, resume=resume_step is not None)
            if wb is not None:
                loggers.append(wb)
    return loggers


def matmul_precision(tf32: bool, device_type: str) -> str | None:
    """torch.set_float32_matmul_precision's setting for a run (trainer.tf32): on CUDA "high" (fp32 matmuls in TF32,
    ~8x the fp32 rate on tensor cores, 10 mantissa bits per product) or "highest" (full fp32); None on a CPU, which
    this setting does not touch (left as it is)."""
    if device_type != "cuda":
        return None
    return "high" if tf32 else "highest"


def build_trainer(parts: dict, out: Path, loggers: list):
    """The Lightning Trainer with the run's callbacks; returns (trainer, throughput monitor)."""
    run, data_cfg = parts["run"], parts["data"]
    cb_cfg = dict(parts["callbacks"] or {})
    ckpt_every = int(cb_cfg.get("checkpoint_every_n_steps") or 0) or run.trainer.val_check_interval
    throughput = ThroughputMonitor(data_cfg.seq_len, run_compute_dtype(run.trainer)[0], run.perf.peak_flops,
                                   cache_dir=run.paths.cache_dir)
    csv_loggers = [lg for lg in loggers if isinstance(lg, ResumableCSVLogger)]
    callbacks = [
        DataPositionCallback(),  # first: the data position must be current when checkpoints are written
        PreemptionCheckpoint(out / "checkpoints" / "last.ckpt"),
        throughput,
        *([TrainingSpend(parts["length"])] if parts.get("length") else []),  # train/tokens, train/flops
        *[RowBeforeCheckpoint(lg) for lg in csv_loggers],  # the step's CSV row (perf included) before its checkpoint
        # last.ckpt every `ckpt_every` steps (resume point) and at the final step; written to a temp file, renamed
        RunCheckpoint(dirpath=out / "checkpoints", save_last=True, save_top_k=0, every_n_train_steps=ckpt_every,
                      enable_version_counter=False),
    ]
    if cb_cfg.get("step_checkpoints"):  # checkpoints/step-<N>.ckpt kept every ckpt_every steps, the newest k of them
        keep = cb_cfg.get("keep_latest")
        callbacks.append(ModelCheckpoint(dirpath=out / "checkpoints", filename=STEP_PREFIX + "{step:08d}",
                                         monitor="step", mode="max", save_top_k=-1 if keep is None else int(keep),
                                         every_n_train_steps=ckpt_every, auto_insert_metric_name=False,
                                         enable_version_counter=False))
    budgets = cb_cfg.get("branch_budgets") or []
    if budgets and parts.get("length"):  # a stable run: keep the steps where cooldowns of these budgets start
        length = parts["length"]
        starts = {branch_budget_steps(parts["run"].scheduler,
                                      run_length(None, None, float(c), length.tokens_per_step, length.flops_per_token).steps)
                  for c in budgets}
        callbacks.append(KeepSteps(out, {s for s in starts if 0 < s <= length.steps}))
    if run.perf.profile and global_rank() == 0:  # a torch.profiler trace of a window of steps (training/profiling.py)
        callbacks.append(ProfileWindow(out, run.perf.profile_wait, run.perf.profile_steps))
    monitor = cb_cfg.get("monitor") or "val/loss"
    if cb_cfg.get("save_best", True):
        callbacks.append(
            RunCheckpoint(dirpath=out / "checkpoints", filename="best", monitor=monitor,
                          mode="max" if monitor.endswith("acc") else "min", save_top_k=1, auto_insert_metric_name=False,
                          enable_version_counter=False)
        )
    if cb_cfg.get("early_stop"):
        es = dict(cb_cfg["early_stop"])
        callbacks.append(EarlyStopping(monitor=es.get("monitor", monitor), mode=es.get("mode", "max"),
                                       stopping_threshold=es.get("threshold"), patience=es.get("patience", 10**9),
                                       check_on_train_epoch_end=False))
    callbacks.append(RunHeader(describe_model))  # in place of Lightning's module table (its FLOPs column reads 0)
    if run.trainer.enable_progress_bar:  # steps to max_steps, with the run's ETA
        callbacks.append(RunProgressBar(refresh_rate=1 if sys.stderr.isatty() else 20))  # also readable when piped
    quiet_lightning()
    precision = matmul_precision(run.trainer.tf32, run_device_type(run.trainer))
    if precision is not None:  # process-wide, before Lightning's device setup (it warns when left at "highest")
        torch.set_float32_matmul_precision(precision)
    trainer_kwargs = run.trainer.lightning_kwargs()
    if trainer_kwargs["strategy"] == "fsdp":  # FSDP2 (training/fsdp.py); the module shards itself in configure_model
        trainer_kwargs["strategy"] = FSDPStrategy(run.trainer.fsdp)
    trainer = L.Trainer(**trainer_kwargs, logger=loggers or False, callbacks=callbacks, default_root_dir=str(out),
                        plugins=[AtomicCheckpointIO()], use_distributed_sampler=False,  # our sampler shards
                        enable_model_summary=False)
    return trainer, throughput


def fit(trainer, lit, dm, ckpt_path, out: Path) -> dict | None:
    """trainer.fit; None when training finished, {"status": "preempted", ...} after a SIGTERM."""
    try:
        trainer.fit(lit, datamodule=dm, ckpt_path=ckpt_path)
    except SIGTERMException:
        # preempted (SLURM sends SIGTERM first): last.ckpt was written by PreemptionCheckpoint
        if trainer.is_global_zero:
            (out / "summary.json").write_text(json.dumps({"status": "preempted", "global_step": trainer.global_step,
                                                         "output_dir": str(out)}, indent=2))
            print(f"attnzoo: SIGTERM at step {trainer.global_step}; saved {out / 'checkpoints' / 'last.ckpt'}; "
                  f"resume with: attnzoo-train --resume {out}", flush=True)
        return {"status": "preempted", "global_step": trainer.global_step}
    return None
