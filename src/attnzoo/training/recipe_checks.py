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


def run_checkpoint(run, steps: int | None = None) -> str | None:
    """The checkpoint a run starts from: `ckpt_path` when set (a resume, `last`, `step:N`, a file); else, with
    `branch_from` (a cooldown of warmup-stable-decay, docs/recipes.md), that run's step checkpoint where this run's
    decay starts: its steps - the decay's steps. The steps: trainer.max_steps, or `steps` (a run sized by
    trainer.max_flops / max_tokens knows them once its model is built: None until then). Refused in one line when
    that step was not kept."""
    if run.ckpt_path is not None or not run.branch_from:
        return run.ckpt_path
    from attnzoo.distributed.checkpoint_files import existing_step
    from attnzoo.training.schedules import decay_steps

    check(run.scheduler.name == "wsd", "branch_from", f"a cooldown branches a warmup-stable-decay run; allowed: "
          f"scheduler=wsd (got scheduler={run.scheduler.name})")
    check(Path(run.branch_from).expanduser().is_dir(), "branch_from", f"{run.branch_from} is not a run directory")
    if steps is None and (run.trainer.max_flops is not None or run.trainer.max_tokens is not None):
        return None  # a budget's steps: resolved once the model's per-step cost is known (training/run.py)
    steps = steps or run.trainer.max_steps
    check(steps is not None and steps > 0, "branch_from",
          "needs the budget whose cooldown this is: trainer.max_steps, max_flops or max_tokens")
    start = steps - decay_steps(run.scheduler, steps)
    return str(existing_step(run.branch_from, start, "branch_from"))


def branch_budget_steps(sched, steps: int) -> int:
    """callbacks.branch_budgets: the step where a budget of `steps` steps starts its cooldown, by this run's
    scheduler.decay_fraction (a stable run has no decay of its own, decay_steps 0: the cooldown's is the fraction's)."""
    import dataclasses

    from attnzoo.training.schedules import decay_steps

    return steps - decay_steps(dataclasses.replace(sched, decay_steps=None), steps)


def check_checkpoints(cb: dict) -> None:
    """callbacks.*'s checkpoint keys: the interval, step checkpoints kept, the stable run's branch budgets."""
    every = cb.get("checkpoint_every_n_steps")
    check(every is None or (isinstance(every, int) and every >= 0), "callbacks.checkpoint_every_n_steps",
          f"got {every!r}; allowed: null (every val_check_interval), 0 (same) or a positive number of steps")
    check(cb.get("step_checkpoints", False) in (True, False), "callbacks.step_checkpoints",
          f"got {cb.get('step_checkpoints')!r}; allowed: true (keep checkpoints/step-<N>.ckpt) or false")
    budgets = cb.get("branch_budgets")
    check(budgets is None or (isinstance(budgets, list) and all(isinstance(c, (int, float)) and not isinstance(c, bool)
                                                                and c > 0 for c in budgets)), "callbacks.branch_budgets",
          f"got {budgets!r}; allowed: null or a list of training-FLOP budgets > 0, e.g. [2.5e11, 5e11]")
    keep = cb.get("keep_latest")
    check(keep is None or (isinstance(keep, int) and not isinstance(keep, bool) and keep >= 1), "callbacks.keep_latest",
          f"got {keep!r}; allowed: null (keep every step checkpoint) or a number >= 1")
