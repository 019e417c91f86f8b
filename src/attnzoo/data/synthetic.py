"""Shared machinery of the synthetic tasks (mqar, noisy_ar, copying, selective_copying, induction_heads).

A task is a generator `generate(cfg, n, rng) -> (x, y, mask)`: numpy int arrays x, y of shape (n, seq_len)
and a bool mask (n, seq_len) that is True exactly on the positions whose next token is an answer (`y` holds
it there; 0 elsewhere). LitLM counts the loss and `val/acc` on the masked positions only.

Splits are drawn from independent streams of one seed (`data.seed`, or the run's seed), so a run is
reproducible; the validation split is made disjoint from the training split by hashing whole examples
and redrawing any validation example whose hash is in the training set (tiny task spaces need this;
large ones almost never collide).
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import lightning as L
import numpy as np
import torch
from torch.utils.data import TensorDataset

from attnzoo.config.errors import ConfigError
from attnzoo.data.sampling import ResumableDataMixin
from attnzoo.data.configs import SyntheticConfig  # noqa: F401 (torch-free: config checks)

log = logging.getLogger("attnzoo")


# ----------------------------------------------------------------------------- sampling helpers


def sample_distinct(rng: np.random.Generator, rows: int, low: int, high: int, k: int) -> np.ndarray:
    """(rows, k) ints from [low, high), distinct within a row, each row a uniform k-subset in uniform
    random order (what `rng.choice(range(low, high), k, replace=False)` per row would give)."""
    span = high - low
    if k > span:
        raise ValueError(f"cannot draw {k} distinct values from [{low}, {high})")
    if k * k <= span:  # sparse: birthday repeats are rare, redraw the rows that have one
        out = rng.integers(low, high, size=(rows, k))
        while True:
            s = np.sort(out, axis=1)
            bad = (s[:, 1:] == s[:, :-1]).any(axis=1)
            if not bad.any():
                return out
            out[bad] = rng.integers(low, high, size=(int(bad.sum()), k))
    # dense: the k smallest of uniform noise per row, ordered by that noise (chunked to bound memory)
    out = np.empty((rows, k), dtype=np.int64)
    step = max(1, 4_000_000 // span)
    for i in range(0, rows, step):
        noise = rng.random((min(step, rows - i), span))
        idx = np.argpartition(noise, k - 1, axis=1)[:, :k]
        order = np.argsort(np.take_along_axis(noise, idx, axis=1), axis=1)
        out[i : i + len(noise)] = np.take_along_axis(idx, order, axis=1) + low
    return out


def sample_weighted_distinct(rng: np.random.Generator, rows: int, logp: np.ndarray, k: int) -> np.ndarray:
    """(rows, k) distinct indices into `logp`, drawn without replacement with probabilities ∝ exp(logp),
    in draw order (Gumbel top-k = sequential sampling without replacement, as `rng.choice(p=...)`)."""
    scores = logp[None, :] + rng.gumbel(size=(rows, len(logp)))
    idx = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(scores, idx, axis=1), axis=1)
    return np.take_along_axis(idx, order, axis=1)


def example_hashes(x: np.ndarray, y: np.ndarray, mask: np.ndarray) -> list[bytes]:
    """One 128-bit digest per example (row) of its inputs, targets and answer mask.

    Two random linear hashes mod 2^64 (vectorised: a 100k-example split hashes in well under a second);
    two different rows collide with probability < 2^-100, far below any split size here."""
    rows = np.concatenate([x, y, mask], axis=1).astype(np.uint64)
    w = np.random.default_rng(0xA77).integers(0, 2**63, size=(rows.shape[1], 2), dtype=np.uint64) | np.uint64(1)
    h = rows @ w  # (n, 2), wraps mod 2^64
    return [r.tobytes() for r in h]


Generator = Callable[[object, int, np.random.Generator], tuple]


def make_splits(gen: Generator, cfg, seed: int, field: str = "data", key: Optional[Callable] = None,
                hint: str = "a larger vocab_size/seq_len or a smaller train_size/val_size") -> dict:
    """Draw the train split, then a validation split of distinct examples none of which is in train.

    `key(parts) -> (a, b, c)`: the three (n, k) arrays an example is hashed by (default: the generated
    x, y, mask; the image tasks hash the image alone, so no validation image was seen in training).
    `hint`: what to change when the task has too few distinct examples (the error's `allowed:`)."""
    key = key or (lambda parts: parts[:3])
    base = np.random.SeedSequence([int(seed), 0x5EED])
    train_ss, val_ss = base.spawn(2)
    train = gen(cfg, cfg.train_size, np.random.default_rng(train_ss))
    seen = set(example_hashes(*key(train)))
    val_rng = np.random.default_rng(val_ss)
    parts, n_have = [], 0
    for _ in range(50):
        need = cfg.val_size - n_have
        if need <= 0:
            break
        cand = gen(cfg, max(16, int(need * 1.2)), val_rng)
        keep = []
        for i, h in enumerate(example_hashes(*key(cand))):
            if h not in seen:
                seen.add(h)
                keep.append(i)
        keep = np.array(keep[:need], dtype=np.int64)
        if len(keep):
            parts.append(tuple(a[keep] for a in cand))
            n_have += len(keep)
    if n_have < cfg.val_size:
        raise ConfigError(
            f"could draw only {n_have} of {cfg.val_size} validation examples not in the training set "
            f"(the task has too few distinct examples); allowed: {hint}",
            field=f"{field}.val_size",
        )
    val = tuple(np.concatenate([p[j] for p in parts]) for j in range(len(train)))
    return {"train": train, "val": val}


def _to_long(batch):
    """Collate: stacked (x, y, mask) with x, y as int64 (stored as int32 to halve memory)."""
    x, y, m = (torch.stack(t) for t in zip(*batch))
    return x.long(), y.long(), m


class SyntheticDataModule(ResumableDataMixin, L.LightningDataModule):
    """In-memory datamodule over a task generator; batches are (x, y, loss_mask).

    Subclasses set `generate` (a staticmethod `(cfg, n, rng) -> (x, y, mask)`) and may override
    `prepare_cfg()` to derive/clip sizes, and `task_info()` for fields recorded in summary.json."""

    generate: Generator
    collate_fn = staticmethod(_to_long)

    def __init__(self, cfg, cache_dir: str = "~/.cache/attnzoo", seed: int = 0):
        super().__init__()
        self.cfg, self.cache_dir = cfg, cache_dir
        self.seed = cfg.seed if cfg.seed is not None else seed
        self.info: dict = {}
        self.train_set = self.val_set = None

    def prepare_cfg(self):
        return self.cfg

    def task_info(self, cfg) -> dict:
        return {}

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        cfg = self.prepare_cfg()
        splits = make_splits(type(self).generate, cfg, self.seed)
        to_t = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a)).to(dt)  # noqa: E731
        self.train_set, self.val_set = (
            TensorDataset(to_t(x, torch.int32), to_t(y, torch.int32), to_t(m, torch.bool)) for x, y, m in (splits["train"], splits["val"])
        )
        answers = splits["train"][2].sum(axis=1)
        self.info = {
            "task": cfg.name, "vocab_size": cfg.vocab_size, "train_examples": len(self.train_set),
            "val_examples": len(self.val_set), "answers_per_example": float(answers.mean()), "data_seed": self.seed,
            **self.task_info(cfg),
        }

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

