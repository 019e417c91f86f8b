"""Hooks of stateful submodules (routed FFNs), collected from any model family by walking its modules.

A submodule may define any of: a tensor attribute `aux_loss` left by its last forward (added to the
training loss), `stats() -> {name: tensor}` (logged, averaged over layers under one name), and
`after_optimizer_step()` (called once per optimizer step, e.g. DeepSeek-V3's aux-loss-free bias) and
`set_train_step(step)` (called before every training batch with the optimizer steps taken so far, e.g. DSA's dense
warm-up) and `trains_only() -> list of parameters or None` (this step updates only those: DSA's frozen warm-up).
`DecoderLM`, the encoder-decoder and the LightningModules all use these, so no model family can
forget one (the MoE loss silently absent from the loss).

Activation checkpointing (`trainer.activation_checkpointing`) runs a block's forward a second time during
backward. A submodule with side effects (the MoE's aux loss, stats and load accumulator) asks `recomputing()`
and, when True, computes exactly what it computed the first time (the same saved tensors) but leaves its
state alone: the load is counted once and the stored aux loss stays the forward's, not a tensor holding the
recomputed graph.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn


_RECOMPUTING = 0  # depth of nested recomputations in progress (a counter: backward may run on another thread)


def recomputing() -> bool:
    """Whether the forward now running is activation checkpointing's recomputation during backward."""
    return _RECOMPUTING > 0


@contextlib.contextmanager
def recomputation() -> Iterator[None]:
    """Marks a checkpointed forward's recomputation (the recompute context of torch.utils.checkpoint)."""
    global _RECOMPUTING
    _RECOMPUTING += 1
    try:
        yield
    finally:
        _RECOMPUTING -= 1


def _children(model: nn.Module):
    return (m for m in model.modules() if m is not model)


def aux_loss(model: nn.Module) -> Optional[torch.Tensor]:
    """Sum of the submodules' `aux_loss` tensors from the last forward, or None."""
    terms = [m.aux_loss for m in _children(model) if isinstance(getattr(m, "aux_loss", None), torch.Tensor)]
    return torch.stack(terms).sum() if terms else None


def stats(model: nn.Module) -> dict:
    """{name: mean over the submodules reporting it} of every submodule's `stats()`."""
    acc: dict = {}
    for m in _children(model):
        if callable(getattr(m, "stats", None)):
            for k, v in m.stats().items():
                acc.setdefault(k, []).append(torch.as_tensor(v, dtype=torch.float32))
    return {k: torch.stack(v).mean() for k, v in acc.items()}


def after_optimizer_step(model: nn.Module) -> None:
    for m in _children(model):
        if callable(getattr(m, "after_optimizer_step", None)):
            m.after_optimizer_step()


def set_train_step(model: nn.Module, step: int) -> None:
    """Tell the submodules whose training depends on the step which optimizer step the next batch trains (the
    trainer's global_step: a resumed run continues from its own)."""
    for m in _children(model):
        if callable(getattr(m, "set_train_step", None)):
            m.set_train_step(step)


def trains_only(model: nn.Module) -> Optional[list]:
    """The parameters the coming optimizer step may update when a submodule restricts it (the union of their
    `trains_only()` lists, e.g. DSA's indexers during a frozen warm-up: the rest of the model, whatever family or
    mixer, stays as it is), or None: every parameter trains."""
    only = [m.trains_only() for m in _children(model) if callable(getattr(m, "trains_only", None))]
    only = [ps for ps in only if ps is not None]
    return None if not only else [p for ps in only for p in ps]
