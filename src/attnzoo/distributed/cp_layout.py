"""How a sequence is split over a context-parallel group (`Layout`: contiguous or zigzag segments) and the checks of
`trainer.context_parallel_layout` against `data.seq_len`, torch-free: the config checks read them before torch is
imported (issue 45). The groups and the sharded forward are in distributed/context_parallel.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from attnzoo.config.errors import ConfigError
from attnzoo.config.registry import MIXERS

if TYPE_CHECKING:
    import torch

LAYOUTS = ("auto", "zigzag", "contiguous")


# ----------------------------------------------------------------------------- how a sequence is split
@dataclass(frozen=True)
class Layout:
    seq_len: int
    size: int
    zigzag: bool

    @property
    def n_segments(self) -> int:
        return 2 * self.size if self.zigzag else self.size

    @property
    def seg_len(self) -> int:
        return self.seq_len // self.n_segments

    def segments(self, rank: int) -> tuple[int, ...]:
        """Global segment indices rank `rank` holds, in its local order."""
        return (rank, 2 * self.size - 1 - rank) if self.zigzag else (rank,)

    def owner(self, segment: int) -> tuple[int, int]:
        """(rank, local index) of a global segment."""
        for r in range(self.size):
            if segment in self.segments(r):
                return r, self.segments(r).index(segment)
        raise IndexError(segment)

    def ranges(self, rank: int) -> list[tuple[int, int]]:
        S = self.seg_len
        return [(s * S, (s + 1) * S) for s in self.segments(rank)]

    def positions(self, rank: int, device=None) -> "torch.Tensor":
        import torch

        return torch.cat([torch.arange(a, b, device=device) for a, b in self.ranges(rank)])

    def shard(self, t: "torch.Tensor", rank: int, dim: int = 1) -> "torch.Tensor":
        """Rank `rank`'s tokens of a full-sequence tensor (time at `dim`)."""
        import torch

        return torch.cat([t.narrow(dim, a, b - a) for a, b in self.ranges(rank)], dim=dim)

    def unshard(self, parts: list["torch.Tensor"], dim: int = 1) -> "torch.Tensor":
        """The full sequence back from every rank's shard (tests, gathering outputs)."""
        import torch

        S, pieces = self.seg_len, [None] * self.n_segments
        for r, part in enumerate(parts):
            for i, s in enumerate(self.segments(r)):
                pieces[s] = part.narrow(dim, i * S, S)
        return torch.cat(pieces, dim=dim)


def resolve_layout(layout: str, mixer_names: list[str]) -> str:
    """`auto` -> zigzag when some layer is full causal attention (its mixer class sets `full_causal_attention`:
    causal softmax over the whole past, unequal work per contiguous shard; zigzag gives every rank the same
    work), else contiguous (windows and recurrences are balanced already, and a window then needs a single
    ring hop)."""
    if layout != "auto":
        return layout
    return "zigzag" if any(MIXERS.get(n).fact("full_causal_attention") for n in mixer_names) else "contiguous"


def check_layout(seq_len: int, size: int, layout: str, min_segment: int = 1) -> Layout:
    """The split of `seq_len` tokens over `size` ranks, or one line naming the field and what is allowed."""
    if layout not in ("zigzag", "contiguous"):
        raise ConfigError(f"got {layout!r}; allowed: {', '.join(LAYOUTS)}", field="trainer.context_parallel_layout")
    lay = Layout(seq_len, size, layout == "zigzag")
    n = lay.n_segments
    if seq_len % n:
        raise ConfigError(f"{seq_len} does not split into {n} equal segments (context_parallel={size}, "
                          f"{layout} layout); allowed: a multiple of {n}", field="data.seq_len")
    if lay.seg_len < min_segment:
        raise ConfigError(f"segments of {lay.seg_len} tokens (seq_len {seq_len} / {n}) are shorter than the short "
                          f"convolution's {min_segment} tail tokens; allowed: seq_len >= {n * min_segment}",
                          field="data.seq_len")
    return lay
