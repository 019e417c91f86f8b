"""Matched parameter budgets: adjust one width so that a model has a target parameter count (within 2%).

Which width (the rest of the model is left as configured):
  ffn mlp / swiglu / moe   model.ffn.d_ff   (MoE: each expert's hidden size)
  ffn none                 model.head_dim   (the per-head inner width of every mixer's projections; the
                                             residual width d_model stays, so mixers are compared at the
                                             same d_model as Zoology does; even values only, for RoPE)

`count`: "non_embedding" (default; excludes the token embedding and a learned position table — with a
small model and a large vocabulary the embedding would otherwise swamp the budget; Kaplan et al. 2020's
N) or "total" (every parameter; a tied LM head counts once).

Hook for train() (config: `model_budget: {params: N, count: non_embedding, tol: 0.02}`, or
`{match: {pattern: [gqa]}}` for the parameter count of a reference variant at the same sizes, or null):
    budget_metrics = apply_budget(container, dm.vocab_size)   # before LitLM(container, ...)
It rewrites container["model"] in place and returns {"budget/target", "budget/params", "budget/value",
"budget/rel_error"} to log (budget/field names the width it set).
"""
from __future__ import annotations

import copy
import math
from typing import Any

from attnzoo.config.errors import ConfigError


def count_params(model_cfg: dict, vocab_size: int, count: str = "non_embedding") -> int:
    """Parameters of the model its family builds from model_cfg (decoder LM, encoder-decoder, encoder), on
    the meta device: no memory, no init cost."""
    from attnzoo.training.families import embedding_params, family_of

    import torch

    build = family_of(model_cfg).build_model
    try:
        with torch.device("meta"):
            model = build(copy.deepcopy(model_cfg), vocab_size)
    except (NotImplementedError, RuntimeError):  # a module whose init needs real values
        model = build(copy.deepcopy(model_cfg), vocab_size)
    total = sum(p.numel() for p in model.parameters())  # shared (tied) tensors are yielded once
    if count == "non_embedding":
        total -= embedding_params(model)
    elif count != "total":
        raise ConfigError(f"got {count!r}; allowed: non_embedding, total", field="model_budget.count")
    return total


def width_field(model_cfg: dict) -> tuple[str, int]:
    """(dotted key under model, step) of the width the budget adjusts."""
    ffn = (model_cfg.get("ffn") or {}).get("name", "swiglu")
    return ("ffn.d_ff", 1) if ffn != "none" else ("head_dim", 2)


def _with(model_cfg: dict, key: str, value: int) -> dict:
    out = copy.deepcopy(model_cfg)
    node = out
    *parents, leaf = key.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return out


def match_budget(model_cfg: dict, vocab_size: int, params: int, count: str = "non_embedding",
                 tol: float = 0.02) -> tuple[dict, dict]:
    """Return (model config with the width set, info) with |params - target| <= tol * target.

    The parameter count is non-decreasing in the width, so a doubling then bisection search finds the
    smallest width reaching the target; the closer of it and the step below wins."""
    key, step = width_field(model_cfg)
    counted: dict = {}

    def f(w: int) -> int:  # each width's model built once (on the meta device)
        if w not in counted:
            counted[w] = count_params(_with(model_cfg, key, w * step), vocab_size, count)
        return counted[w]

    lo = _affine_width(f, params)
    if lo is None:  # not affine in the width (or past the search's reach): doubling, then bisection
        lo, hi = 1, 1
        while f(hi) < params:
            lo, hi = hi, hi * 2
            if hi > 1 << 20:
                raise ConfigError(f"{params} parameters not reachable by growing model.{key}",
                                  field="model_budget.params")
        while lo < hi:  # smallest w with f(w) >= params
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if f(mid) < params else (lo, mid)
    best = min({max(1, lo - 1), lo}, key=lambda w: abs(f(w) - params))
    got = f(best)
    rel = abs(got - params) / params
    if rel > tol:
        raise ConfigError(
            f"closest is {got} parameters at model.{key}={best * step} ({rel:.1%} off {params}); allowed: a target "
            f"within {tol:.0%} of what model.{key} can reach (the rest of the model already has {f(1)} at the smallest width)",
            field="model_budget.params",
        )
    info = {"budget/target": float(params), "budget/params": float(got), "budget/value": float(best * step),
            "budget/rel_error": rel, "budget/field": f"model.{key}"}
    return _with(model_cfg, key, best * step), info


def _affine_width(f, params: int) -> int | None:
    """The smallest width w with f(w) >= params, predicted from f(1) and f(2) (a model's parameters grow by the same
    amount per unit of d_ff or head_dim in every layer it has) and verified: f(w) >= params > f(w - 1). None when the
    prediction fails the check; the bisection then finds it (the same w: f is non-decreasing). 2-4 models built
    instead of ~2 log2(w) (a sweep job's start, and the tests that size every variant of a sweep)."""
    slope = f(2) - f(1)
    if slope <= 0:
        return None
    w = max(1, math.ceil((params - f(1)) / slope) + 1)
    if w > 1 << 20:
        return None
    return w if f(w) >= params and (w == 1 or f(w - 1) < params) else None


def _merged(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


BUDGET_KEYS = {"params", "match", "count", "tol"}
COUNTS = ("non_embedding", "total")


def check_budget(budget: Any) -> None:
    """The `model_budget` section's shape (torch-free: the config checks call it before any work); null: none."""
    if budget is None:
        return
    if not isinstance(budget, dict):
        raise ConfigError("expected {params: N} or {match: {model keys}}, count: non_embedding|total, tol: 0.02",
                          field="model_budget")
    if ("params" in budget) == ("match" in budget):
        raise ConfigError("expected {params: N} or {match: {model keys}} (one of them), count: non_embedding|total, "
                          "tol: 0.02", field="model_budget")
    if "match" in budget and (not isinstance(budget["match"], dict) or not budget["match"]):
        raise ConfigError(f"got {budget['match']!r}; allowed: model keys of the reference, e.g. {{pattern: [gqa]}}",
                          field="model_budget.match")
    # each value as the search reads it (was: an unknown key ignored, a negative target trained a model of width 1,
    # a string or NaN a ValueError traceback, a bad count / tol refused only after the data was set up)
    unknown = sorted(set(budget) - BUDGET_KEYS)
    if unknown:
        raise ConfigError(f"unknown key; allowed keys: {', '.join(sorted(BUDGET_KEYS))}",
                          field=f"model_budget.{unknown[0]}")
    if "params" in budget:
        n = budget["params"]
        if isinstance(n, bool) or not isinstance(n, (int, float)) or not (math.isfinite(n) and n >= 1):
            raise ConfigError(f"got {n!r}; allowed: a parameter count >= 1, e.g. 200000 or 1.2e6",
                              field="model_budget.params")
    if "match" in budget:
        from attnzoo.config.schema import ModelConfig, _fields

        keys = {f.name for f in _fields(ModelConfig)}
        bad = sorted(set(budget["match"]) - keys)
        if bad:
            raise ConfigError(f"not a model key; allowed keys: {', '.join(sorted(keys))}",
                              field=f"model_budget.match.{bad[0]}")
    count = budget.get("count", "non_embedding")
    if count not in COUNTS:
        raise ConfigError(f"got {count!r}; allowed: {', '.join(COUNTS)}", field="model_budget.count")
    tol = budget.get("tol", 0.02)
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not (math.isfinite(tol) and tol > 0):
        raise ConfigError(f"got {tol!r}; allowed: a relative tolerance > 0, e.g. 0.02 (2%)", field="model_budget.tol")


def norm_params_floor(model: Any) -> int:
    """Parameters every decoder LM of this config has at any width the budget sets (torch-free, from the resolved
    ModelConfig): its norms' gains alone - one norm before (pre) or after (post) each layer's mixer, and a final
    norm with pre-norm - which neither model.ffn.d_ff nor model.head_dim changes. A floor, not the count."""
    per_norm = model.d_model * (2 if model.norm.name == "layernorm" else 1)  # LayerNorm: weight and bias
    return per_norm * (model.n_layers + (model.norm_position == "pre"))


def check_budget_floor(budget: Any, model: Any) -> None:
    """A `params` target the model's floor (norm_params_floor) already passes by more than the tolerance: no width
    can reach it, refused before torch (issue 45; match_budget refuses the targets between the floor and the
    smallest model once it has counted them). Decoder LMs; a `match` target is counted from its reference, later."""
    if not budget or "params" not in budget:
        return
    params, tol = float(budget["params"]), float(budget.get("tol", 0.02))
    floor = norm_params_floor(model)
    key = width_field({"ffn": {"name": getattr(model.ffn, "name", "swiglu")}})[0]
    if floor > params * (1 + tol):
        raise ConfigError(f"{params:.6g} parameters is out of reach: the model has at least {floor:,} at any "
                          f"model.{key} (its norms' gains alone, {model.n_layers} layers x d_model={model.d_model}); "
                          f"allowed: a target of the smallest model's count or more", field="model_budget.params")


def budget_target(model_cfg: dict, vocab_size: int, budget: dict) -> int:
    """The parameter target: `params: N`, or `match: {model keys}` = as many parameters as this model would
    have with those keys replaced, at its other sizes (e.g. match: {pattern: [gqa]} holds every variant of a
    sweep at the gqa baseline's count, at the full size and in its debug=smoke form alike)."""
    check_budget(budget)
    if "params" in budget:
        return int(budget["params"])
    return count_params(_merged(model_cfg, budget["match"]), vocab_size, budget.get("count", "non_embedding"))


def apply_budget(container: dict, vocab_size: int) -> dict:
    """train() hook: with container['model_budget'] = {params | match, count?, tol?}, set the matched width in
    container['model'] (in place); return the budget metrics (empty without a budget)."""
    budget: Any = container.get("model_budget")
    if not budget:
        return {}
    check_budget(budget)
    target = budget_target(container["model"], vocab_size, budget)
    model, info = match_budget(container["model"], vocab_size, target, budget.get("count", "non_embedding"),
                               float(budget.get("tol", 0.02)))
    container["model"] = model
    return info
