"""The synthetic tasks' shared config fields (`SyntheticConfig`) and the needle task's config, torch-free (data/configs.py
re-exports them with the other data modules' configs; kept apart to keep that file readable)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from attnzoo.config.errors import check


@dataclass
class SyntheticConfig:
    """Fields every synthetic task has; a task's config subclasses it (its `name` first)."""

    name: str = "synthetic"
    vocab_size: int = 8192
    seq_len: int = 256
    batch_size: int = 64
    train_size: int = 20_000  # training examples (drawn once, reshuffled every epoch)
    val_size: int = 1_000  # held-out examples, disjoint from the training ones
    seed: Optional[int] = None  # data seed; null: the run's seed
    num_workers: int = 0

    def validate(self, model, field: str) -> None:
        check(self.seq_len > 1, f"{field}.seq_len", f"must be > 1, got {self.seq_len}")
        check(self.batch_size > 0, f"{field}.batch_size", "must be positive")
        check(self.train_size >= self.batch_size, f"{field}.train_size",
              f"{self.train_size} is smaller than batch_size={self.batch_size}; allowed: >= batch_size")
        check(self.val_size > 0, f"{field}.val_size", "must be positive")
        check(self.vocab_size >= 4, f"{field}.vocab_size", f"must be >= 4, got {self.vocab_size}")


# ----------------------------------------------------------------------------- needle (data/needle.py)

@dataclass
class NeedleConfig(SyntheticConfig):
    """data=needle: needle-in-a-haystack as a token task a small model is trained on (as MQAR is; issue 48 item 3):
    a haystack of noise tokens holding `num_needles` needles [NEEDLE, key, value] with distinct keys, then
    [QUERY, key] of one of them, whose value the model must emit (data/needle.py)."""
    name: str = "needle"
    vocab_size: int = 256
    seq_len: int = 256
    key_len: int = 2  # tokens of a key
    value_len: int = 2  # tokens of a value (the answer: value_len masked positions)
    num_needles: int = 1  # needles with distinct keys; one is asked (the others distract: RULER's multi-key)
    depth: Optional[float] = None  # where the asked needle starts, a fraction of the haystack; null: uniform per example

    def validate(self, model, field: str) -> None:
        super().validate(model, field)
        for key in ("key_len", "value_len", "num_needles"):
            check(getattr(self, key) >= 1, f"{field}.{key}", f"must be >= 1, got {getattr(self, key)}")
        check(self.depth is None or 0.0 <= self.depth <= 1.0, f"{field}.depth",
              f"got {self.depth}; allowed: a fraction of the haystack in [0, 1], or null (uniform)")
        need = needle_tokens(self) * self.num_needles + 1 + self.key_len + self.value_len
        check(self.seq_len >= need, f"{field}.seq_len", f"{self.seq_len} cannot hold {self.num_needles} needle(s) of "
              f"{needle_tokens(self)} tokens and the query ({1 + self.key_len + self.value_len}); allowed: >= {need}")
        check(self.vocab_size >= 2 * NEEDLE_SPECIALS + 2, f"{field}.vocab_size",
              f"{self.vocab_size} leaves no noise / key tokens; allowed: >= {2 * NEEDLE_SPECIALS + 2}")


NEEDLE_SPECIALS = 2  # token 0: NEEDLE (a needle starts), token 1: QUERY (the question starts)


def needle_tokens(cfg) -> int:
    return 1 + cfg.key_len + cfg.value_len
