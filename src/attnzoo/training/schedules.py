"""Learning-rate schedules: optimizer step -> multiplier on optim.lr (`scheduler.*`), and the fingerprint a resume
checks its schedule against. Torch-free."""
from __future__ import annotations

import math

from attnzoo.config.schema import SchedulerConfig


def lr_lambda(sched: SchedulerConfig, max_steps: int, d_model: int):
    """Multiplier on optim.lr at optimizer step `s` (0-based).

    cosine:   linear warmup to 1 over warmup_steps, then cosine decay to min_lr_ratio at max_steps.
    noam:     d_model^-0.5 * min(s^-0.5, s * warmup^-1.5) (Vaswani et al. 2017), rescaled so the peak
              (at s = warmup) is 1: then optim.lr is the peak learning rate.
    constant: warmup then 1.
    """
    w = max(1, sched.warmup_steps)

    def cosine(s: int) -> float:
        if s < w:
            return (s + 1) / w
        progress = min(1.0, (s - w) / max(1, max_steps - w))
        return sched.min_lr_ratio + (1 - sched.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def noam(s: int) -> float:
        step = s + 1
        return min(step**-0.5, step * w**-1.5) / (w**-0.5)

    def constant(s: int) -> float:
        return min(1.0, (s + 1) / w)

    return {"cosine": cosine, "noam": noam, "constant": constant}[sched.name]


def schedule_digest(multiplier, steps: int) -> str:
    """A fingerprint of the learning-rate multipliers of optimizer steps 0..steps-1 (their exact float64 values): a
    resumed run's schedule continues the checkpoint's exactly iff its own steps before the checkpoint hash alike."""
    import hashlib
    import struct

    h = hashlib.sha256()
    for s in range(steps):
        h.update(struct.pack("<d", float(multiplier(s))))
    return h.hexdigest()


def noam_lr(step: int, d_model: int, warmup: int, factor: float = 1.0) -> float:
    """The paper's formula, lrate = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (1-based)."""
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
