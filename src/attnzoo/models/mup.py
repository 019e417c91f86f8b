"""The maximal update parametrization of the decoder LM: `model.parametrization=mup` (docs/mup.md).

µP (Yang et al. 2022, "Tensor Programs V: Tuning Large Neural Networks via Zero-Shot Hyperparameter Transfer",
arXiv:2203.03466) scales initialisation, learning rates and two multipliers with the width so that every layer's
activations and their updates stay the same size as the model widens: the learning rate (and the rest of the
optimizer's settings) tuned at a small base width is then the best one at every width. Here as the `mup` package
(MuAdamW, MuSharedReadout) and the µP practitioner's guide (Dey et al. 2024; EleutherAI's nanoGPT-mup) apply it to a
Transformer trained with AdamW, with the width multiplier m = d_model / model.mup_base_width:

  weights whose fan-in grows with the width (q/k/v/o, FFN, MoE experts and router, gate projections; found as
  `mup.set_base_shapes` finds its "infinite" dimensions: the model is built again, on the meta device, at twice the
  width; a weight with two or more dimensions that differ there is a hidden matrix, and one with a single such
  dimension counts when that dimension is its fan-in - dim 1 of an nn.Linear (out, in), or the dim a raw parameter
  declares as `_fan_in_dim` (e.g. an input-major LoRA, x @ W: 0); undeclared raw parameters with one growing
  dimension (a short conv's (channels, taps), a per-head (heads, head_dim) vector) are vectors):
      init N(0, init_std^2 / m): model.init_std is the std at the base width, so std ~ 1/sqrt(fan_in) (GPT-2's
      1/sqrt(2 n_layers) on residual outputs kept); AdamW learning rate optim.lr / m; weight decay
      optim.weight_decay * m, so lr x wd, the fraction decayed per step, stays put (MuAdamW's default)
  everything else (token embedding, learned position table, norm gains, biases, A_log / dt_bias / D, the short
  conv's taps, a low-rank gate's up-projection from a fixed rank): as standard, width-independent
  readout: logits = lm_head(h) / m (MuReadout's multiplier), lm_head the embedding when tied (learning rate unscaled,
  as an input weight), zero-initialised when untied (the paper's recommendation)
  q.k: times d^-1/2 more where q.k grows with d (softmax attention: 1/d instead of 1/sqrt(d)); each mixer class
  says whether (`Mixer.mup_qk_grows`, `Mixer.mup_qk_scale`)

The standard parametrization does not pass through this module: its model is bit for bit what it was.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn


def width_multiplier(cfg: Any) -> float:
    """m = d_model / model.mup_base_width (1 under the standard parametrization)."""
    if getattr(cfg, "parametrization", "standard") != "mup":
        return 1.0
    return cfg.d_model / cfg.mup_base_width


def delta_config(cfg: Any) -> Any:
    """The model config at twice the width, standard parametrization: what `fan_in_grows` compares shapes with.
    model.head_dim grows with d_model when it tiles it (head_dim x n_heads = d_model, its default d_model / n_heads);
    a head size set apart from the width stays. model.mup_base_width is kept: sizes derived from the base width
    (RWKV-7's default LoRA ranks) are the same in both models, so no role depends on which widths are compared."""
    head_dim = 2 * cfg.head_dim if cfg.head_dim * cfg.n_heads == cfg.d_model else cfg.head_dim
    return dataclasses.replace(cfg, d_model=2 * cfg.d_model, head_dim=head_dim, parametrization="standard")


def fan_in_grows(model: nn.Module, delta: nn.Module) -> list[str]:
    """Names of `model`'s weights whose fan-in grows: the hidden (and output-like) matrices µP scales, found against
    `delta`, the same model at another width (the module docstring says how). Embedding tables (fan-in: the
    vocabulary or the positions) and the readout (scaled by its multiplier instead) are never among them."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} | {id(model.lm_head.weight)}
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    other = dict(delta.named_parameters())
    out = []
    for name, p in model.named_parameters():
        if p.dim() < 2 or id(p) in tables:
            continue
        grows = [i for i, (a, b) in enumerate(zip(p.shape, other[name].shape)) if a != b]
        fan_in = getattr(p, "_fan_in_dim", 1 if id(p) in linear else None)
        if len(grows) >= 2 or (fan_in is not None and grows == [fan_in]):
            out.append(name)
    return out


def apply(model: nn.Module, delta: nn.Module) -> float:
    """µP on a freshly initialised decoder LM (gpt2 init): rescale the hidden weights' init by m^-1/2, flag their
    AdamW groups (`_lr_scale` 1/m, `_wd_scale` m: training/lit_lm.param_groups), zero an untied readout. Returns
    the readout multiplier 1/m. The draws are the standard model's, only scaled: the RNG advances identically."""
    m = width_multiplier(model.cfg)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in fan_in_grows(model, delta):
            p = params[name]
            p.mul_(m**-0.5)
            p._lr_scale = getattr(p, "_lr_scale", 1.0) / m
            p._wd_scale = getattr(p, "_wd_scale", 1.0) * m
        if not model.cfg.tie_embeddings:
            model.lm_head.weight.zero_()
    return 1.0 / m


def roles(model: nn.Module) -> dict[str, str]:
    """Each parameter's µP kind by name: "hidden" (init and learning rate scaled), "readout" (an untied lm_head:
    multiplier 1/m, zero init) or "width-independent" - what docs/mup.md and the tests list."""
    out = {}
    for name, p in model.named_parameters():
        if name == "lm_head.weight":
            out[name] = "readout"
        else:
            out[name] = "hidden" if hasattr(p, "_wd_scale") else "width-independent"
    return out
