"""`data=copying` (Arjovsky et al. 2016, arXiv:1511.06464) and `data=selective_copying` (Gu & Dao 2023,
Mamba, arXiv:2312.00752), as decoder-only LM tasks with the loss on the copied tokens only.

Token 0 is the blank, 1 the separator, data tokens come from [2, V). One example is a stream of
seq_len + 1 tokens, x = stream[:-1] and y = stream[1:]; with n = copy_len:

    copying:            d_1 .. d_n  0 0 .. 0  SEP  d_1 .. d_n      (the blanks are the lag, seq_len - 2n)
    selective_copying:  0 d_1 0 0 d_2 .. 0 d_n 0  SEP  d_1 .. d_n  (d_i at random ordered positions)

The answer positions are the last n of y.
"""
from __future__ import annotations


import numpy as np

from attnzoo.data import register_data
from attnzoo.data.synthetic import SyntheticDataModule, sample_distinct
from attnzoo.data.configs import CopyingConfig, SelectiveCopyingConfig  # noqa: F401 (torch-free: config checks)

BLANK, SEP, FIRST_DATA = 0, 1, 2


def _answer_tail(stream: np.ndarray, n: int):
    """x, y, mask from a (rows, seq_len + 1) stream whose last n tokens are the answers."""
    x, y = stream[:, :-1], stream[:, 1:].copy()
    mask = np.zeros(x.shape, dtype=bool)
    mask[:, -n:] = True
    y[~mask] = 0
    return np.ascontiguousarray(x), y, mask


def generate_copying(cfg, n_examples: int, rng: np.random.Generator):
    L, n = cfg.seq_len, cfg.copy_len
    data = rng.integers(FIRST_DATA, cfg.vocab_size, size=(n_examples, n))
    stream = np.full((n_examples, L + 1), BLANK, dtype=np.int64)
    stream[:, :n] = data
    stream[:, L - n] = SEP
    stream[:, L + 1 - n :] = data
    return _answer_tail(stream, n)


def generate_selective_copying(cfg, n_examples: int, rng: np.random.Generator):
    L, n = cfg.seq_len, cfg.copy_len
    ctx = L - n  # context tokens before the separator
    data = rng.integers(FIRST_DATA, cfg.vocab_size, size=(n_examples, n))
    pos = np.sort(sample_distinct(rng, n_examples, 0, ctx, n), axis=1)
    stream = np.full((n_examples, L + 1), BLANK, dtype=np.int64)
    stream[np.arange(n_examples)[:, None], pos] = data
    stream[:, ctx] = SEP
    stream[:, ctx + 1 :] = data
    return _answer_tail(stream, n)


class _CopyModule(SyntheticDataModule):
    def task_info(self, cfg) -> dict:
        return {"copy_len": cfg.copy_len, "seq_len": cfg.seq_len}


@register_data("copying", CopyingConfig)
class CopyingDataModule(_CopyModule):
    generate = staticmethod(generate_copying)


@register_data("selective_copying", SelectiveCopyingConfig)
class SelectiveCopyingDataModule(_CopyModule):
    generate = staticmethod(generate_selective_copying)
