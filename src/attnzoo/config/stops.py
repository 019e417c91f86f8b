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
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class RunLength:
    steps: int  # optimizer steps the run trains for
    limit: str  # the config key that decided: trainer.max_steps | trainer.max_tokens | trainer.max_flops
    tokens_per_step: int
    flops_per_token: float

    @property
    def flops_per_step(self) -> float:
        return self.tokens_per_step * self.flops_per_token

    def summary(self, max_tokens: Optional[float], max_flops: Optional[float]) -> dict:
        return {"steps": self.steps, "limit": self.limit, "tokens_per_step": self.tokens_per_step,
                "flops_per_token": self.flops_per_token, "max_tokens": max_tokens, "max_flops": max_flops,
                "tokens": self.steps * self.tokens_per_step, "flops": self.steps * self.flops_per_step}


def tokens_per_step(batch_size: int, seq_len: int, accumulate: int, data_parallel: int) -> int:
    """Tokens one optimizer step trains on, all ranks together (a context-parallel group shares one sequence,
    so it counts as one data-parallel rank)."""
    return batch_size * seq_len * accumulate * data_parallel


def run_length(max_steps: Optional[int], max_tokens: Optional[float], max_flops: Optional[float],
               per_step_tokens: int, flops_per_token: float) -> RunLength:
    """The smallest of the limits given (at least one is; validation checks)."""
    limits = {}
    if max_steps is not None:
        limits["trainer.max_steps"] = int(max_steps)
    if max_tokens is not None:
        limits["trainer.max_tokens"] = max(1, math.ceil(max_tokens / per_step_tokens))
    if max_flops is not None:
        limits["trainer.max_flops"] = max(1, math.ceil(max_flops / (per_step_tokens * flops_per_token)))
    limit = min(limits, key=lambda k: limits[k])
    return RunLength(limits[limit], limit, per_step_tokens, flops_per_token)
