"""The training recipe's checks: optimizer (`optim.*`) and learning-rate schedule (`scheduler.*`), refused in one
line naming the field before any work. Torch-free (called by config_checks.validate before the heavy imports)."""
from __future__ import annotations

from attnzoo.config.errors import check, check_choice


def check_optim(optim) -> None:
    """optim.* (config/schema.OptimConfig)."""
    check_choice(optim.name, "optim.name", ("adamw",))
    check(optim.lr > 0, "optim.lr", f"must be positive, got {optim.lr}")
    check(len(optim.betas) == 2 and all(0 <= b < 1 for b in optim.betas), "optim.betas",
          f"got {list(optim.betas)}; allowed: two values in [0, 1), e.g. [0.9, 0.95]")
    check(optim.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {optim.weight_decay}")
    check(optim.eps > 0, "optim.eps", f"must be positive, got {optim.eps}")


def check_scheduler(sched, trainer) -> None:
    """scheduler.* (config/schema.SchedulerConfig) against the run's length."""
    check_choice(sched.name, "scheduler.name", ("cosine", "noam", "constant"))
    check(sched.warmup_steps >= 0, "scheduler.warmup_steps", f"must be >= 0, got {sched.warmup_steps}")
    check(0 <= sched.min_lr_ratio <= 1, "scheduler.min_lr_ratio",
          f"must be in [0, 1] (a fraction of optim.lr), got {sched.min_lr_ratio}")
