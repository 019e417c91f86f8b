"""How long a run trains: `trainer.max_steps`, `trainer.max_tokens` and `trainer.max_flops`, whichever comes first.

A token or compute budget becomes a step count once the model is built, since every optimizer step trains on
the same number of tokens and costs the same FLOPs:

    tokens per step = data.batch_size x data.seq_len x trainer.accumulate_grad_batches x data-parallel ranks
    FLOPs per step  = tokens per step x the model's training FLOPs per token at data.seq_len
                      (3x its own analytic forward count, docs/benchmarks.md; the same number as perf/flops_per_token)

so a run stopped by a budget trains on ceil(budget / per-step) steps - at least the budget, less than one step
over - and its learning-rate schedule decays over those steps. `train/tokens` and `train/flops` are logged
as the run goes (cumulative, all ranks) and the summary records the budget, the steps and which limit
decided. A sequence-packed step counts its whole rows (padding is computed, so it is spent).
`trainer.max_steps=null` leaves the length to the budget alone.

What a run has spent is counted as it goes (training/callbacks.py TrainingSpend) and kept in its checkpoint, so
a resumed run continues the count and spends what is left of its budget: with the same tokens per step that is
the uninterrupted run's step count; resumed on more (or fewer) ranks, or with another accumulation, the
remaining budget at the new per-step cost. A FLOP budget below one optimizer step is refused (as a token budget
below one batch is), since its one step would overshoot it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from attnzoo.config.errors import ConfigError


@dataclass(frozen=True)
class Spent:
    """What a run has trained on so far: after `steps` optimizer steps, `tokens` tokens and `flops` FLOPs."""
    steps: int = 0
    tokens: int = 0
    flops: float = 0.0


@dataclass(frozen=True)
class RunLength:
    steps: int  # optimizer steps the run trains for
    limit: str  # the config key that decided: trainer.max_steps | trainer.max_tokens | trainer.max_flops
    tokens_per_step: int
    flops_per_token: float
    start: Spent = Spent()  # what the run had spent when this part of it started (a resume: its checkpoint's)

    @property
    def flops_per_step(self) -> float:
        return self.tokens_per_step * self.flops_per_token

    def spent_at(self, step: int) -> Spent:
        """What the run has spent after `step` optimizer steps (the steps since its start at this per-step cost)."""
        n = step - self.start.steps
        return Spent(step, self.start.tokens + n * self.tokens_per_step, self.start.flops + n * self.flops_per_step)

    def summary(self, max_tokens: Optional[float], max_flops: Optional[float]) -> dict:
        end = self.spent_at(self.steps)
        return {"steps": self.steps, "limit": self.limit, "tokens_per_step": self.tokens_per_step,
                "flops_per_token": self.flops_per_token, "max_tokens": max_tokens, "max_flops": max_flops,
                "tokens": end.tokens, "flops": end.flops}


def tokens_per_step(batch_size: int, seq_len: int, accumulate: int, data_parallel: int) -> int:
    """Tokens one optimizer step trains on, all ranks together (a context-parallel group shares one sequence,
    so it counts as one data-parallel rank)."""
    return batch_size * seq_len * accumulate * data_parallel


def run_length(max_steps: Optional[int], max_tokens: Optional[float], max_flops: Optional[float],
               per_step_tokens: int, flops_per_token: float, start: Spent = Spent()) -> RunLength:
    """The smallest of the limits given (at least one is; validation checks). `start`: what a resumed run had
    spent (its checkpoint's count); a budget then adds the steps its remainder needs at this per-step cost."""
    per_step_flops = per_step_tokens * flops_per_token
    if max_flops is not None and start.steps == 0 and max_flops < per_step_flops:
        raise ConfigError(f"{max_flops:.4g} is below one optimizer step ({per_step_flops:.4g} FLOPs: "
                          f"{per_step_tokens:,} tokens x {flops_per_token:.4g} training FLOPs per token); allowed: "
                          f">= {per_step_flops:.4g}, or a smaller model / batch", field="trainer.max_flops")

    def steps_for(budget: float, spent: float, per_step: float) -> int:
        return start.steps + max(0 if start.steps else 1, math.ceil((budget - spent) / per_step))

    limits = {}
    if max_steps is not None:
        limits["trainer.max_steps"] = int(max_steps)
    if max_tokens is not None:
        limits["trainer.max_tokens"] = steps_for(max_tokens, start.tokens, per_step_tokens)
    if max_flops is not None:
        limits["trainer.max_flops"] = steps_for(max_flops, start.flops, per_step_flops)
    limit = min(limits, key=lambda k: limits[k])
    return RunLength(limits[limit], limit, per_step_tokens, flops_per_token, start)
