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
    wsd:      warmup-stable-decay (MiniCPM, Hu et al. 2024; Hägele et al. 2024, arXiv:2405.18392): warmup, 1 until
              the decay starts at max_steps - D (D = decay_steps, or round(decay_fraction * max_steps)), then down to
              min_lr_ratio over the last D steps in `decay_shape` (linear, cosine, or 1-sqrt, the paper's best). The
              steps before the decay do not depend on max_steps: a run branched from a stable run's checkpoint with
              its own shorter decay continues that run exactly (a cooldown, docs/recipes.md).
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

    def wsd(s: int) -> float:
        start = max_steps - decay_steps(sched, max_steps)
        if s < start:
            return constant(s)
        x = min(1.0, (s - start + 1) / max(1, max_steps - start))  # 1/D at the decay's first step, 1 at the last
        return sched.min_lr_ratio + (1 - sched.min_lr_ratio) * DECAY_SHAPES[sched.decay_shape](x)

    return {"cosine": cosine, "noam": noam, "constant": constant, "wsd": wsd}[sched.name]


# the cooldown's shape: the fraction of the way from the peak to the floor left at progress x in [0, 1]
# (Hägele et al. 2024, Fig. 3: 1-sqrt beats linear; cosine as the long-run schedule's own)
DECAY_SHAPES = {
    "linear": lambda x: 1.0 - x,
    "cosine": lambda x: 0.5 * (1.0 + math.cos(math.pi * x)),
    "1-sqrt": lambda x: 1.0 - math.sqrt(x),
}


def decay_steps(sched: SchedulerConfig, max_steps: int) -> int:
    """scheduler=wsd: the steps of the final decay in a run of `max_steps`."""
    if sched.decay_steps is not None:
        return int(sched.decay_steps)
    return int(round(sched.decay_fraction * max_steps))


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
