"""Sequence packing with document masks: which document each token of a packed batch belongs to.

A packed row holds several documents back to back, without padding. Training on it must equal training on
each document alone:

- softmax attention never crosses a document boundary (a block-diagonal causal mask; `Documents.mask`);
- recurrent mixers (linear attention, DeltaNet, Gated DeltaNet) start every document from a zero state and
  short convolutions never read the previous document's tokens (the state leak other libraries shipped);
- positions restart at 0 in every document (`Documents.positions`).

Two execution strategies, equal to each other and to running the documents alone: a batch of few documents
(long ones, up to SPLIT_MAX_DOCUMENTS) runs each document by its own call on its slice (`per_document`: the
causal kernels at the cost of the tokens, no mask); a batch of many documents runs one batched call (a dense
block-diagonal mask for attention, one padded row per document for recurrences).

`Documents.gather` / `scatter` move between the packed layout (B, T, ...) and one padded row per document
(N, L, ...) with the padding at the end: a causal mixer run on the gathered rows is each document run alone,
and is the default (`Mixer.forward_packed`) for mixers without a native packed form.
"""
from __future__ import annotations

from typing import Optional

import torch

# documents per batch up to which each runs by its own call (Documents.split): above it, the batched forms
SPLIT_MAX_DOCUMENTS = 64


class Documents:
    """`ids` (B, T) integers, non-decreasing along T: tokens with equal ids in one row form one document
    (a document cut by a row boundary continues as a new document in the next row)."""

    def __init__(self, ids: torch.Tensor) -> None:
        if ids.dim() != 2:
            raise ValueError(f"document ids: expected (batch, seq_len), got shape {tuple(ids.shape)}")
        self.ids = ids
        self._positions: Optional[torch.Tensor] = None
        self._bounds: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._segments: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._masks: dict = {}
        self._layouts: dict = {}
        self._lengths: Optional[list[int]] = None

    @property
    def starts(self) -> torch.Tensor:
        """(B, T) bool: True at the first token of each document."""
        first = torch.ones_like(self.ids[:, :1], dtype=torch.bool)
        return torch.cat([first, self.ids[:, 1:] != self.ids[:, :-1]], dim=1)

    def positions(self) -> torch.Tensor:
        """(B, T) int64: each token's position inside its document (0 at every document start)."""
        if self._positions is None:
            T = self.ids.shape[1]
            idx = torch.arange(T, device=self.ids.device).expand_as(self.ids)
            start = torch.where(self.starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
            self._positions = idx - start
        return self._positions

    def mask(self, *, causal: bool = True, window: Optional[int] = None, sinks: int = 0) -> torch.Tensor:
        """(B, 1, T, T) bool, True = query i may attend key j: same document, j <= i when causal, i - W < j with a
        window, or j among the document's first `sinks` tokens (attention sinks count per document)."""
        key = (causal, window, sinks)
        if key not in self._masks:
            T = self.ids.shape[1]
            same = self.ids[:, :, None] == self.ids[:, None, :]  # (B, T, T)
            i = torch.arange(T, device=self.ids.device)[:, None]
            j = torch.arange(T, device=self.ids.device)[None, :]
            band = torch.ones(T, T, dtype=torch.bool, device=self.ids.device)
            if causal:
                band = band & (j <= i)
            if window is not None:
                near = j > i - window
                if sinks:
                    near = near[None] | (self.positions()[:, None, :] < sinks)  # key j is a sink of its document
                band = band & near
            self._masks[key] = (same & band)[:, None]
        return self._masks[key]

    def bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(first (N,) flat index of each document's first token, lengths (N,)), documents in order."""
        if self._bounds is None:
            starts = self.starts.reshape(-1)
            first = starts.nonzero().squeeze(1)
            self._bounds = (first, torch.diff(first, append=first.new_tensor([starts.numel()])))
        return self._bounds

    def segments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(index (N, L) into the flattened B * T tokens, valid (N, L) bool): one row per document, in order,
        padded at the end to the longest document L. One host sync (L)."""
        if self._segments is None:
            first, lengths = self.bounds()
            L = int(lengths.max())
            offs = torch.arange(L, device=first.device)
            valid = offs[None, :] < lengths[:, None]
            index = torch.where(valid, first[:, None] + offs[None, :], torch.zeros_like(valid, dtype=first.dtype))
            self._segments = (index, valid)
        return self._segments

    @property
    def n_documents(self) -> int:
        return len(self.lengths())

    def lengths(self) -> list[int]:
        """Each document's token count, in order (row by row). One host sync."""
        if self._lengths is None:
            self._lengths = self.bounds()[1].tolist()
        return self._lengths

    def split(self) -> bool:
        """True: run each document by its own call (`per_document`): few documents, so the calls cost less than
        a dense (T, T) mask or the padding of gathered rows. False: one batched call (mask / gather)."""
        return self.n_documents <= SPLIT_MAX_DOCUMENTS

    def chunk_layout(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Documents laid out chunk-aligned in their own rows: each document starts at a multiple of `chunk`
        (zeros fill the rest of its last chunk), so every chunk holds one document's tokens and the chunked
        recurrences reset their state between chunks (like fla's varlen kernels). Returns (dest (B*T,) the
        flat (B, T') slot of every token, resets (B, T' / chunk) True where a document starts, T')."""
        if chunk not in self._layouts:
            B, T = self.ids.shape
            first, lengths = self.bounds()
            chunks = (lengths + chunk - 1) // chunk  # chunks per document
            row = first // T
            # aligned start (in chunks) of each document inside its row: chunks of the row's earlier documents
            before = torch.cumsum(chunks, 0) - chunks
            row_first = torch.zeros(B, dtype=torch.long, device=lengths.device).scatter_reduce(
                0, row, before, reduce="amin", include_self=False)
            start_chunk = before - row_first[row]
            per_row = torch.zeros(B, dtype=torch.long, device=lengths.device).scatter_add(0, row, chunks)
            n = int(per_row.max())
            doc = self.starts.reshape(-1).long().cumsum(0) - 1  # each token's document
            col = start_chunk[doc] * chunk + self.positions().reshape(-1)
            dest = (torch.arange(B * T, device=lengths.device) // T) * (n * chunk) + col
            resets = torch.zeros(B, n, dtype=torch.bool, device=lengths.device)
            resets[row, start_chunk] = True
            self._layouts[chunk] = (dest, resets, n * chunk)
        return self._layouts[chunk]

    def to_chunks(self, x: torch.Tensor, chunk: int) -> torch.Tensor:
        """(B, T, ...) -> (B, T', ...) in `chunk_layout` (zeros in the gaps)."""
        dest, _, Tc = self.chunk_layout(chunk)
        B, T = self.ids.shape
        flat = x.reshape(B * T, *x.shape[2:])
        out = flat.new_zeros(B * Tc, *x.shape[2:]).index_copy(0, dest, flat)
        return out.reshape(B, Tc, *x.shape[2:])

    def from_chunks(self, y: torch.Tensor, chunk: int) -> torch.Tensor:
        """(B, T', ...) in `chunk_layout` -> (B, T, ...)."""
        dest, _, Tc = self.chunk_layout(chunk)
        B, T = self.ids.shape
        return y.reshape(B * Tc, *y.shape[2:])[dest].reshape(B, T, *y.shape[2:])

    def per_document(self, fn, *xs: torch.Tensor) -> torch.Tensor:
        """fn(*(x_d (1, L_d, ...))) -> (1, L_d, ...) for each document d in turn; the outputs back in the packed
        layout (B, T, ...). The inputs are cut and the outputs joined by split / cat along the flattened tokens,
        whose backward passes are a cat / split (no full-size zero gradient per document)."""
        B, T = self.ids.shape
        parts = [x.reshape(B * T, *x.shape[2:]).split(self.lengths()) for x in xs]
        outs = [fn(*(p[None] for p in doc))[0] for doc in zip(*parts)]
        y = torch.cat(outs)
        return y.reshape(B, T, *y.shape[1:])

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (N, L, ...): one row per document, zeros after its end (zeros are a safe input to
        every mixer's padded tail; causal mixers never let the tail reach the document's tokens)."""
        index, valid = self.segments()
        flat = x.reshape(-1, *x.shape[2:])
        out = flat[index]
        return out * valid.view(*valid.shape, *([1] * (x.dim() - 2))).to(out.dtype)

    def scatter(self, y: torch.Tensor) -> torch.Tensor:
        """(N, L, ...) -> (B, T, ...): the inverse of gather (documents in order, so their valid tokens, read
        row by row, are the packed tokens in order)."""
        _, valid = self.segments()
        B, T = self.ids.shape
        return y[valid].reshape(B, T, *y.shape[2:])


def masked_conv(conv, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A `ShortConvolution` over packed documents: y_t = act(b + sum_d w_{K-1-d} x_{t-d}) over the taps d <= the
    token's position in its document (taps into the previous document read zeros, as at a sequence start).
    x (B, T, C), positions (B, T) -> (B, T, C)."""
    K = conv.kernel_size
    w = conv.weight.to(x.dtype)  # (C, K): w[:, K-1] multiplies x_t
    y = x * w[:, K - 1]
    for d in range(1, K):
        shifted = torch.nn.functional.pad(x, (0, 0, d, 0))[:, : x.shape[1]]
        y = y + shifted * (positions >= d)[..., None].to(x.dtype) * w[:, K - 1 - d]
    if conv.bias is not None:
        y = y + conv.bias.to(x.dtype)
    return conv._act(y)
