"""The training recipe's checks: optimizer (`optim.*`) and learning-rate schedule (`scheduler.*`), refused in one
line naming the field before any work. Torch-free (called by config_checks.validate before the heavy imports)."""
from __future__ import annotations

from pathlib import Path

from attnzoo.config.errors import check, check_choice


def check_optim(optim) -> None:
    """optim.* (config/schema.OptimConfig)."""
    check_choice(optim.name, "optim.name", ("adamw", "muon"))
    check(optim.lr > 0, "optim.lr", f"must be positive, got {optim.lr}")
    check(len(optim.betas) == 2 and all(0 <= b < 1 for b in optim.betas), "optim.betas",
          f"got {list(optim.betas)}; allowed: two values in [0, 1), e.g. [0.9, 0.95]")
    check(optim.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {optim.weight_decay}")
    check(optim.eps > 0, "optim.eps", f"must be positive, got {optim.eps}")
    if optim.name == "muon":  # the fields only Muon reads (training/optimizers.py)
        check(0 <= optim.momentum < 1, "optim.momentum", f"got {optim.momentum}; allowed: [0, 1), e.g. 0.95")
        check(optim.ns_steps >= 1, "optim.ns_steps", f"got {optim.ns_steps}; allowed: an integer >= 1, e.g. 5")
        check_choice(optim.ns_dtype, "optim.ns_dtype", ("auto", "bf16", "fp32", "fp64"))


def check_scheduler(sched, trainer) -> None:
    """scheduler.* (config/schema.SchedulerConfig) against the run's length."""
    check_choice(sched.name, "scheduler.name", ("cosine", "noam", "constant", "wsd"))
    check(sched.warmup_steps >= 0, "scheduler.warmup_steps", f"must be >= 0, got {sched.warmup_steps}")
    check(0 <= sched.min_lr_ratio <= 1, "scheduler.min_lr_ratio",
          f"must be in [0, 1] (a fraction of optim.lr), got {sched.min_lr_ratio}")
    if sched.name != "wsd":
        return
    from attnzoo.training.schedules import DECAY_SHAPES, decay_steps

    check_choice(sched.decay_shape, "scheduler.decay_shape", tuple(DECAY_SHAPES))
    check(0 <= sched.decay_fraction <= 1, "scheduler.decay_fraction",
          f"must be in [0, 1] (a fraction of trainer.max_steps), got {sched.decay_fraction}")
    check(sched.decay_steps is None or sched.decay_steps >= 0, "scheduler.decay_steps",
          f"must be >= 0 or null (decay_fraction of the run), got {sched.decay_steps}")
    steps = trainer.max_steps
    if steps is not None and steps > 0:  # a token / FLOP budget's length is checked once it is known (LitLM)
        decay = decay_steps(sched, steps)
        check(sched.warmup_steps + decay <= steps, "scheduler.decay_steps",
              f"the warmup ({sched.warmup_steps}) and the decay ({decay}) take more than trainer.max_steps={steps}; "
              f"allowed: warmup_steps + decay <= max_steps")


def run_checkpoint(run) -> str | None:
    """The checkpoint a run starts from: `ckpt_path` when set (a resume, `last`, `step:N`, a file); else, with
    `branch_from` (a cooldown of warmup-stable-decay, docs/recipes.md), that run's step checkpoint where this run's
    decay starts: trainer.max_steps - the decay's steps. Refused in one line when that step was not kept."""
    if run.ckpt_path is not None or not run.branch_from:
        return run.ckpt_path
    from attnzoo.distributed.checkpoint_files import existing_step
    from attnzoo.training.schedules import decay_steps

    check(run.scheduler.name == "wsd", "branch_from", f"a cooldown branches a warmup-stable-decay run; allowed: "
          f"scheduler=wsd (got scheduler={run.scheduler.name})")
    steps = run.trainer.max_steps
    check(steps is not None and steps > 0, "branch_from", "needs trainer.max_steps (the budget whose cooldown this is)")
    check(Path(run.branch_from).expanduser().is_dir(), "branch_from", f"{run.branch_from} is not a run directory")
    start = steps - decay_steps(run.scheduler, steps)
    return str(existing_step(run.branch_from, start, "branch_from"))
