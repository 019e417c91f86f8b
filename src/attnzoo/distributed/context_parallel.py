"""Context (sequence) parallelism: one sequence split over the N ranks of a process group.

`trainer.context_parallel=N` splits every training / validation sequence of length L into N shards; the
world is DP x CP (ranks r*N .. r*N+N-1 form one context-parallel group and see the same batch; the data
sampler shards over the DP groups only). Every layer sees only its rank's tokens, with their global
positions (RoPE, ALiBi and absolute embeddings use them), and the mixers exchange what crosses a shard
boundary through `torch.distributed` (gloo on CPU, NCCL on GPU):

- softmax attention (mha / gqa / mqa, sliding window with or without sinks, ALiBi, MLA): ring attention
  (Liu et al. 2023): each rank keeps its queries, K/V blocks travel round the ring, partial results merge
  by their log-sum-exp (the online softmax); backward sends the K/V blocks round again with their
  gradient accumulators and returns the accumulators home. Blocks that no local query can see are not
  computed, and the ring stops after the last hop any rank needs (a sliding window with the contiguous
  layout needs one hop when W <= L/N).
- linear attention, DeltaNet, Gated DeltaNet: state passing (LASP, Sun et al. 2024). The state after a
  shard is affine in the state before it, S_out = M S_in + B. One chunked pass per shard with values
  [v | 0] from state [0 | I] yields [B | M]; the (M, B) of every shard are all-gathered, each rank folds
  those before its shards into its initial state, then runs its chunks from that state. The all-gather's
  backward sums the gradients, so the backward pass needs nothing more.
- the short convolutions take their K-1 inputs before a shard from the shard before it.

Layouts: `contiguous` (rank r holds tokens [r L/N, (r+1) L/N)) or `zigzag` (L split into 2N segments;
rank r holds segments r and 2N-1-r, so with causal attention every rank does the same work). Mixers find
the active context with `active()` inside `sharded(cp)`; outside it (generation, single-process runs)
nothing changes.

`ContextParallel.comm_seconds` accumulates the exposed communication time (time spent issuing and
waiting, not the part overlapped with computation), for the benchmark's communication share.

This module: layouts, process groups, the active split, and `ContextParallel` (transport, segments, the short
conv and the state-passing scan); the ring attention's blocks and autograd function are in
context_parallel_ring.py (`MaskSpec` is importable from here too).
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from attnzoo.config.errors import ConfigError
from attnzoo.distributed.context_parallel_ring import MaskSpec, _RingAttention
from attnzoo.distributed.cp_layout import LAYOUTS, Layout, check_layout, resolve_layout  # noqa: F401 (torch-free)

# ----------------------------------------------------------------------------- the process groups
_TOPOLOGY: dict = {}  # set by init_groups: the data-parallel rank / world the sampler shards over
_ACTIVE: Optional["ContextParallel"] = None


def init_groups(cp_size: int):
    """Split the default process group into DP x CP: groups of `cp_size` consecutive ranks. Every rank
    calls this (new_group is collective). Returns this rank's context-parallel group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % cp_size:
        raise ConfigError(f"{world} processes do not split into groups of {cp_size}; allowed: a divisor of the "
                          f"world size (devices x num_nodes = {world})", field="trainer.context_parallel")
    mine = None
    for g in range(world // cp_size):
        ranks = list(range(g * cp_size, (g + 1) * cp_size))
        group = dist.new_group(ranks)  # its own group even when it is the world: never interleaves with DDP's
        if rank in ranks:
            mine = group
    _TOPOLOGY.update(cp=cp_size, dp_rank=rank // cp_size, dp_world=world // cp_size)
    return mine


def data_rank_world() -> Optional[tuple[int, int]]:
    """(DP rank, DP world) when context parallelism split the world, else None (shard over every rank)."""
    return (_TOPOLOGY["dp_rank"], _TOPOLOGY["dp_world"]) if _TOPOLOGY else None


def active() -> Optional["ContextParallel"]:
    """The context-parallel split the current forward runs under, or None."""
    return _ACTIVE


@contextlib.contextmanager
def sharded(cp: Optional["ContextParallel"]) -> Iterator[None]:
    global _ACTIVE
    prev, _ACTIVE = _ACTIVE, cp
    try:
        yield
    finally:
        _ACTIVE = prev


class _Pending:
    def __init__(self, reqs, bufs, cp: "ContextParallel"):
        self.reqs, self.bufs, self.cp = reqs, bufs, cp

    def wait(self) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        for r in self.reqs:
            r.wait()
        self.cp.comm_seconds += time.perf_counter() - t0
        return self.bufs


class ContextParallel:
    """This rank's place in a context-parallel group and the exchanges the mixers use."""

    def __init__(self, group, layout: Layout):
        self.group, self.layout = group, layout
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        if self.size != layout.size:
            raise ValueError(f"layout for {layout.size} ranks, group of {self.size}")
        self.ranks = dist.get_process_group_ranks(group)
        self.comm_seconds = 0.0
        self._hops: dict = {}
        # "fast": each block through ATen's fused CPU flash-attention kernel (fwd and bwd, with its log-sum-exp);
        # "reference": the same blocks written out in einsums (also the path on other devices)
        self.impl = "fast"

    # -------------------------------------------------------------- transport (torch.distributed only)
    def exchange(self, tensors: list[torch.Tensor], offset: int) -> _Pending:
        """Start sending each tensor to rank + offset and receiving same-shaped ones from rank - offset."""
        t0 = time.perf_counter()
        dst = self.ranks[(self.rank + offset) % self.size]
        src = self.ranks[(self.rank - offset) % self.size]
        sends = [t.contiguous() for t in tensors]
        bufs = [torch.empty_like(t) for t in sends]
        ops = [dist.P2POp(dist.isend, t, dst, self.group) for t in sends]
        ops += [dist.P2POp(dist.irecv, b, src, self.group) for b in bufs]
        reqs = dist.batch_isend_irecv(ops)
        self.comm_seconds += time.perf_counter() - t0
        return _Pending(reqs, bufs, self)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """(size, *x.shape), differentiable: the backward sums every rank's gradient for this rank's slot."""
        return _AllGather.apply(x, self)

    # -------------------------------------------------------------- segments on this rank
    @property
    def n_local(self) -> int:
        return len(self.layout.segments(self.rank))

    def to_segments(self, t: Optional[torch.Tensor], dim: int) -> Optional[torch.Tensor]:
        """(B, ..., n_local * S, ...) -> (n_local * B, ..., S, ...): each local segment its own batch row."""
        if t is None:
            return None
        n = self.n_local
        t = t.unflatten(dim, (n, t.shape[dim] // n)).movedim(dim, 0)
        return t.flatten(0, 1)

    def from_segments(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        n = self.n_local
        t = t.unflatten(0, (n, t.shape[0] // n)).movedim(0, dim)
        return t.flatten(dim, dim + 1)

    # -------------------------------------------------------------- the three mixer paths
    def conv(self, conv, x: torch.Tensor) -> torch.Tensor:
        """A `ShortConvolution` over this rank's tokens x (B, T, C), each segment continuing from the last
        K-1 inputs of the segment before it (zeros before the first)."""
        K1 = conv.kernel_size - 1
        xs = self.to_segments(x, 1)  # (n*B, S, C)
        if K1 == 0:
            return self.from_segments(conv(xs)[0], 1)
        tails = self.all_gather(xs[:, -K1:].transpose(1, 2))  # (size, n*B, C, K-1)
        n, B = self.n_local, x.shape[0]
        prev = []
        for seg in self.layout.segments(self.rank):
            if seg == 0:
                prev.append(torch.zeros_like(tails[0, :B]))
            else:
                r, i = self.layout.owner(seg - 1)
                prev.append(tails[r, i * B:(i + 1) * B])
        y, _ = conv(xs, _uses(torch.cat(prev, dim=0), tails))
        return self.from_segments(y, 1)

    def scan(self, run: Callable, v: torch.Tensor, *inputs: Optional[torch.Tensor]) -> torch.Tensor:
        """A linear recurrence S_t = M_t S_{t-1} + (write of token t) with state (Dk, Dv) per head, over
        this rank's tokens. `run(v, initial_state, *inputs)` runs it on (B, H, T, .) tensors (time at dim 2)
        and returns (o, final state (B, H, Dk, Dv)); v (B, H, T, Dv); inputs: q, k, ... at dim 2 (or None).
        Returns o (B, H, T, Dv) as if the whole sequence had run on one rank from a zero state."""
        vs = self.to_segments(v, 2)
        segs = [self.to_segments(t, 2) for t in inputs]
        nB, H, _, Dv = vs.shape
        Dk = next(t for t in segs if t is not None and t.dim() == 4).shape[-1]  # the key size: q's
        eye = torch.eye(Dk, dtype=vs.dtype, device=vs.device).expand(nB, H, Dk, Dk)
        s0 = torch.cat([vs.new_zeros(nB, H, Dk, Dv), eye], dim=-1)
        _, fin = run(torch.cat([vs, vs.new_zeros(*vs.shape[:-1], Dk)], dim=-1), s0, *segs)
        summaries = self.all_gather(fin)  # (size, n*B, H, Dk, Dv + Dk): [B | M] per local segment
        B = v.shape[0]
        starts, S = {}, vs.new_zeros(B, H, Dk, Dv)
        for seg in range(max(self.layout.segments(self.rank)) + 1):
            starts[seg] = S
            r, i = self.layout.owner(seg)
            summ = summaries[r, i * B:(i + 1) * B]
            S = summ[..., Dv:] @ S + summ[..., :Dv]
        init = _uses(torch.cat([starts[seg] for seg in self.layout.segments(self.rank)], dim=0), summaries)
        o, _ = run(vs, init, *segs)
        return self.from_segments(o, 2)

    def attention(self, q, k, v, *, causal: bool, scale: Optional[float] = None, window: Optional[int] = None,
                  sinks: int = 0, alibi: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Ring attention: q (B, H, T, D) of this rank's tokens, k/v (B, Hkv, T, D/Dv) -> (B, H, T, Dv)."""
        spec = MaskSpec(causal, window, sinks, q.shape[-1] ** -0.5 if scale is None else scale)
        return _RingAttention.apply(q, k, v, alibi, self, spec)

    def n_hops(self, spec: "MaskSpec") -> int:
        """Ring steps so that every rank has seen every K/V block any of its queries can see."""
        if spec not in self._hops:
            lay, far = self.layout, 0
            for r in range(self.size):
                for s in range(self.size):
                    if any(spec.visibility(qr, kr) != "none" for qr in lay.ranges(r) for kr in lay.ranges(s)):
                        far = max(far, (r - s) % self.size)
            self._hops[spec] = far + 1
        return self._hops[spec]


def _uses(x: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
    """x, made to depend on an all-gathered tensor. The gather's backward is a collective: every rank must run
    it, also a rank whose result does not need the gather (rank 0 of the contiguous layout), or the others
    wait for it forever."""
    return x + 0.0 * gathered.sum()


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        t0 = time.perf_counter()
        out = [torch.empty_like(x) for _ in range(cp.size)]
        dist.all_gather(out, x.contiguous(), group=cp.group)
        cp.comm_seconds += time.perf_counter() - t0
        return torch.stack(out)

    @staticmethod
    def backward(ctx, g):
        cp = ctx.cp
        t0 = time.perf_counter()
        g = g.contiguous()
        dist.all_reduce(g, group=cp.group)
        cp.comm_seconds += time.perf_counter() - t0
        return g[cp.rank], None
