"""`data=induction_heads` (Olsson et al. 2022; the synthetic form of Gu & Dao 2023, Mamba, arXiv:2312.00752):
a random sequence in which a trigger token appears once followed by an answer token; the last input is the
trigger again and the model must emit the token that followed it the first time:

    t t t TRIG a t t t ... t TRIG  -> a

Token 0 is the trigger (it appears nowhere else); the other tokens come from [1, V). One answer position
(the last) per example.
"""
from __future__ import annotations


import numpy as np

from attnzoo.data import register_data
from attnzoo.data.synthetic import SyntheticDataModule
from attnzoo.data.configs import InductionConfig  # noqa: F401 (torch-free: config checks)

TRIGGER = 0


def generate_induction(cfg, n: int, rng: np.random.Generator):
    L, V = cfg.seq_len, cfg.vocab_size
    x = rng.integers(1, V, size=(n, L))
    p = rng.integers(0, L - 2, size=n)  # first trigger; its answer at p + 1 <= L - 2, before the final trigger
    rows = np.arange(n)
    x[rows, p] = TRIGGER
    x[:, -1] = TRIGGER
    answer = x[rows, p + 1]
    y = np.zeros_like(x)
    y[:, -1] = answer
    mask = np.zeros(x.shape, dtype=bool)
    mask[:, -1] = True
    return x, y, mask


@register_data("induction_heads", InductionConfig)
class InductionDataModule(SyntheticDataModule):
    generate = staticmethod(generate_induction)

    def task_info(self, cfg) -> dict:
        return {"seq_len": cfg.seq_len}
