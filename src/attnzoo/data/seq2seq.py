"""Sequence-to-sequence tasks for the encoder-decoder (`model=encdec`): `reversal`, `sorting`, `addition`.

Token ids: 0 = PAD, 1 = BOS, 2 = EOS; task symbols from 3. Sources have random lengths in
[min_len, seq_len] and are right-padded to seq_len; a batch is

    (src (B, S), tgt_in (B, T), tgt_out (B, T), src_mask (B, S) bool, tgt_mask (B, T) bool)

with tgt_in = [BOS, y_1 .. y_n, PAD ..], tgt_out = [y_1 .. y_n, EOS, PAD ..] (teacher forcing) and the masks
True on real tokens (tgt_mask: the n + 1 positions the loss and the exact match count, EOS included).

    reversal  3 7 5 4        -> 4 5 7 3
    sorting   3 7 5 4        -> 3 4 5 7
    addition  "47+805" (digits, '+') -> "852"   (multi-digit, most significant digit first; the seed's task)

Examples are drawn from `data.seed` (or the run's seed) with the validation split disjoint from training
(synthetic.make_splits), so a run is reproducible.
"""
from __future__ import annotations

from typing import Optional

import lightning as L
import numpy as np
import torch
from torch.utils.data import TensorDataset

from attnzoo.data import register_data
from attnzoo.data.sampling import ResumableDataMixin
from attnzoo.data.synthetic import make_splits
from attnzoo.data.configs import PAD, BOS, EOS, FIRST_SYMBOL, Seq2SeqConfig, AdditionConfig, SortingConfig  # noqa: F401 (torch-free: config checks)

def _random_sources(cfg, n: int, rng: np.random.Generator):
    lengths = rng.integers(cfg.min_len, cfg.seq_len + 1, size=n)
    mask = np.arange(cfg.seq_len)[None, :] < lengths[:, None]
    src = np.where(mask, rng.integers(FIRST_SYMBOL, cfg.vocab_size, size=(n, cfg.seq_len)), PAD)
    return src, mask, lengths


def _targets(rows: np.ndarray, lengths: np.ndarray, width: int) -> np.ndarray:
    """tgt_out (n, width): the first len of `rows`, then EOS, then PAD."""
    n = len(rows)
    j = np.arange(width)[None, :]
    tgt = np.where(j < lengths[:, None], np.pad(rows, ((0, 0), (0, width - rows.shape[1]))), PAD)
    tgt[np.arange(n), lengths] = EOS
    return tgt


def generate_reversal(cfg, n: int, rng: np.random.Generator):
    src, mask, lengths = _random_sources(cfg, n, rng)
    j = np.arange(cfg.seq_len)[None, :]
    rev = np.take_along_axis(src, np.clip(lengths[:, None] - 1 - j, 0, cfg.seq_len - 1), axis=1)
    return src, _targets(rev, lengths, cfg.seq_len + 1), mask


def generate_sorting(cfg, n: int, rng: np.random.Generator):
    src, mask, lengths = _random_sources(cfg, n, rng)
    big = np.iinfo(np.int64).max
    srt = np.sort(np.where(mask, src, big), axis=1)  # real symbols first, ascending
    return src, _targets(np.where(srt == big, PAD, srt), lengths, cfg.seq_len + 1), mask


PLUS = FIRST_SYMBOL + 10


def _digits(s: str) -> list[int]:
    return [FIRST_SYMBOL + int(c) for c in s]


def generate_addition(cfg, n: int, rng: np.random.Generator):
    D = cfg.max_digits
    nd = rng.integers(1, D + 1, size=(n, 2))  # digits of each operand: short and long sums both occur
    lo = np.where(nd == 1, 0, 10 ** (nd - 1))
    ops = lo + (rng.random((n, 2)) * (10**nd - lo)).astype(np.int64)
    src = np.full((n, cfg.seq_len), PAD, dtype=np.int64)
    tgt = np.full((n, D + 2), PAD, dtype=np.int64)  # the sum has at most D + 1 digits, then EOS
    for i, (a, b) in enumerate(ops):
        s = _digits(str(a)) + [PLUS] + _digits(str(b))
        t = _digits(str(a + b)) + [EOS]
        src[i, : len(s)], tgt[i, : len(t)] = s, t
    return src, tgt, src != PAD


class Seq2SeqDataModule(ResumableDataMixin, L.LightningDataModule):
    """In-memory seq2seq task; subclasses set `generate = staticmethod((cfg, n, rng) -> (src, tgt_out, src_mask))`."""

    generate = staticmethod(generate_reversal)
    pad_id, bos_id, eos_id = PAD, BOS, EOS

    def __init__(self, cfg, cache_dir: str = "~/.cache/attnzoo", seed: int = 0):
        super().__init__()
        self.cfg, self.cache_dir = cfg, cache_dir
        self.seed = cfg.seed if cfg.seed is not None else seed
        self.train_set = self.val_set = None
        self.info: dict = {}

    @staticmethod
    def to_tensors(src, tgt_out, src_mask) -> tuple:
        src, tgt_out = torch.from_numpy(np.asarray(src, dtype=np.int64)), torch.from_numpy(np.asarray(tgt_out, dtype=np.int64))
        tgt_in = torch.cat([torch.full_like(tgt_out[:, :1], BOS), tgt_out[:, :-1]], dim=1)
        tgt_in = tgt_in.masked_fill(tgt_in == EOS, PAD)  # EOS is only ever a target
        return src, tgt_in, tgt_out, torch.from_numpy(np.asarray(src_mask, dtype=bool)), tgt_out != PAD

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        splits = make_splits(type(self).generate, self.cfg, self.seed)
        self.train_set, self.val_set = (TensorDataset(*self.to_tensors(*splits[k])) for k in ("train", "val"))
        self.info = {"task": self.cfg.name, "vocab_size": self.vocab_size, "train_examples": len(self.train_set),
                     "val_examples": len(self.val_set), "data_seed": self.seed}

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size



@register_data("reversal", Seq2SeqConfig)
class ReversalDataModule(Seq2SeqDataModule):
    generate = staticmethod(generate_reversal)


@register_data("sorting", SortingConfig)
class SortingDataModule(Seq2SeqDataModule):
    generate = staticmethod(generate_sorting)


@register_data("addition", AdditionConfig)
class AdditionDataModule(Seq2SeqDataModule):
    generate = staticmethod(generate_addition)
