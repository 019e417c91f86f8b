"""The parts of one run, built from its validated config: the checkpoint it resumes from, the data module and
matched budget, the LightningModule of its model family, and the run's length in steps."""
from __future__ import annotations

from pathlib import Path


from attnzoo.config.schema import resolve_model
from attnzoo.config.stops import Spent, run_length, tokens_per_step
from attnzoo.data import build_datamodule
from attnzoo.interop.hf import init_weights_from
from attnzoo.models.flops import train_flops_per_token
from attnzoo.training.budget import apply_budget
# the kernel checks live with the config checks (no Lightning there: the CLI refuses before its import)
from attnzoo.training.config_checks import check_kernels_present, fla_kernels_of, run_device_type  # noqa: F401
from attnzoo.distributed.checkpoint_files import checkpoint_file
from attnzoo.training.checkpoint_io import check_checkpoint
from attnzoo.training.families import family_of
from attnzoo.training.launch import requested_devices


def resolve_ckpt(ckpt_path: str | None, out: Path) -> tuple[str | None, dict | None]:
    """`last` -> <out>/checkpoints/last.ckpt; check the file is a complete, loadable checkpoint.
    Returns (path, checkpoint) — the checkpoint memory-mapped — or (None, None)."""
    p = checkpoint_file(ckpt_path, out)
    if p is None:
        return None, None
    return str(p), check_checkpoint(p, weights=False)


def prepare_data(parts: dict, container: dict):
    """The data module (tokenizer trained and cached once, before any worker starts) and the matched
    parameter budget, which may set a width in container["model"] (in place)."""
    run = parts["run"]
    dm = build_datamodule(parts["data"], cache_dir=run.paths.cache_dir, seed=run.seed)
    dm.setup("fit")
    return dm, apply_budget(container, dm.vocab_size)


def build_module(container: dict, dm, run):
    """(family, LightningModule). The model config is resolved once, after its last change (the budget's
    width), and every part of the run reads that one object."""
    family = family_of(container["model"])
    lit = family.build_lit(container, resolve_model(container["model"], vocab_size=dm.vocab_size), dm)
    if container["model"].get("init_from"):  # the imported weights (a resume has the model's own in its checkpoint)
        lit.load_pretrained(lambda module: init_weights_from(module, container["model"]),
                            resuming=run.ckpt_path is not None)
    if run.compile:
        lit.compile_model()
    return family, lit


def resolve_run_length(run, data_cfg, lit, family, container: dict, ckpt: dict | None = None):
    """trainer.max_steps / max_tokens / max_flops -> the run's steps (attnzoo/config/stops.py), written where the
    Trainer, the learning-rate schedule and the saved config read them; a resumed run counts on from what its
    checkpoint had spent. None for families other than the decoder LM (their length is max_steps; no token or
    FLOP budget)."""
    t = run.trainer
    if family.name != "decoder":
        return None
    length = measured_length(run, data_cfg, lit, ckpt)
    if length.limit != "trainer.max_steps" or t.max_steps is None:
        t.max_steps = container["trainer"]["max_steps"] = lit.max_steps = length.steps
        print(f"attnzoo: {length.limit}={getattr(t, length.limit.split('.')[1]):.4g} -> {length.steps} steps of "
              f"{length.tokens_per_step:,} tokens ({length.flops_per_step:.3g} FLOPs) each", flush=True)
    return length


def measured_length(run, data_cfg, lit, ckpt: dict | None = None, max_flops: float | None = None):
    """The RunLength of this run's limits (or of `max_flops` alone) at its model's per-step cost; nothing changed."""
    t = run.trainer
    data_parallel = max(1, requested_devices(t) * t.num_nodes // t.context_parallel)
    per_step = tokens_per_step(data_cfg.batch_size, data_cfg.seq_len, t.accumulate_grad_batches, data_parallel)
    per_token = train_flops_per_token(lit.model, data_cfg.seq_len)
    if max_flops is not None:
        return run_length(None, None, max_flops, per_step, per_token)
    return run_length(t.max_steps, t.max_tokens, t.max_flops, per_step, per_token, spent_in(ckpt, per_step, per_token))


def spent_in(ckpt: dict | None, per_step: int, per_token: float) -> Spent:
    """What a checkpoint's run had trained on (TrainingSpend's count; a checkpoint without it: its steps at this
    run's per-step cost). Nothing for a fresh run."""
    if ckpt is None:
        return Spent()
    state = (ckpt.get("callbacks") or {}).get("TrainingSpend")
    if state:
        return Spent(int(state["steps"]), int(state["tokens"]), float(state["flops"]))
    step = int(ckpt.get("global_step", 0))
    return Spent(step, step * per_step, step * per_step * per_token)


def check_schedule_continues(lit, ckpt: dict | None, ckpt_path: str | None) -> None:
    """A resume (say, a finished run extended with a larger trainer.max_steps) must give the steps its checkpoint
    already took the learning rates they were taken with, or the run is not the longer run it claims to be: a
    cosine schedule stretched to the new length raises the rate of every step already taken. Refused in one line,
    before anything is written. Checkpoints written before the record was kept are not checked."""
    record = (ckpt or {}).get("lr_schedule")
    if not record or not hasattr(lit, "schedule_record"):
        return
    from attnzoo.config.errors import ConfigError

    mine = lit.schedule_record(int(record["steps"]))
    if mine["digest"] == record["digest"]:
        return
    raise ConfigError(
        f"{ckpt_path} took its {record['steps']} steps on the {record['scheduler']} schedule of a "
        f"{record['max_steps']}-step run; this run's schedule ({mine['scheduler']}, {mine['max_steps']} steps) gives "
        f"those steps other learning rates, so it would not equal a {mine['max_steps']}-step run; allowed: the "
        f"checkpoint's trainer.max_steps={record['max_steps']} and scheduler (or a new run of the longer length; a "
        f"schedule that does not depend on the length, scheduler=constant or noam, extends exactly)",
        field="trainer.max_steps")
