"""The optimizers `optim.name` picks, built from the model's parameter groups (docs/optimizers.md).

    adamw  torch.optim.AdamW on every parameter (decay on weight matrices only)
    muon   Muon on the hidden matrices, AdamW on the rest, in one optimizer (`MuonWithAdamW`)

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks", kellerjordan.github.io/posts/muon)
orthogonalises each hidden matrix's Nesterov momentum with a quintic Newton-Schulz iteration; the Moonlight scaling
(Liu et al. 2025, "Muon is Scalable for LLM Training", arXiv:2502.16982) multiplies its update by 0.2 sqrt(max(A, B))
for an A x B matrix, which gives it AdamW's update RMS, so one learning rate and weight decay serve both halves.
The update is torch.optim.Muon's (`adjust_lr_fn="match_rms_adamw"`) op for op, tested against it
(tests/test_muon.py); the AdamW half is torch.optim.AdamW itself.
"""
from __future__ import annotations

import logging
import math

import torch
from torch import nn

log = logging.getLogger("attnzoo")

# torch.optim.Muon's (Keller Jordan's) quintic coefficients and the floor on the norm the iteration starts from
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
READOUTS = ("lm_head", "head")  # the output layers (decoder / encoder-decoder / VLM, image classifier): AdamW's


def muon_matrices(model: nn.Module) -> set[int]:
    """ids of the parameters Muon updates, the hidden matrices: every nn.Linear weight, raw matrices that declare
    their fan-in (`_fan_in_dim`, e.g. RWKV-7's LoRAs) and a routed FFN's expert stacks (a module's `n_experts`
    matrices in one (E, A, B) parameter: each expert's orthogonalised alone). Never Muon's: embedding tables (a tied
    head included), the readout (`READOUTS`), parameters flagged `_no_weight_decay` (per-channel coefficients), and
    every other raw parameter (norm gains, biases, short-conv taps, position tables, learned queries)."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    tables |= {id(m.weight) for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in READOUTS}
    out = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            matrix = ((isinstance(module, nn.Linear) and name == "weight")
                      or (p.dim() == 2 and hasattr(p, "_fan_in_dim"))
                      or (p.dim() == 3 and getattr(module, "n_experts", None) == p.shape[0]))
            if matrix and id(p) not in tables and not getattr(p, "_no_weight_decay", False):
                out.add(id(p))
    return out


def param_groups(model: nn.Module, weight_decay: float, lr: float | None = None, muon: bool = False) -> list[dict]:
    """AdamW groups: decay on weight matrices only; none on norms, biases, embeddings, and parameters
    flagged `_no_weight_decay` (e.g. Gated DeltaNet's A_log and dt_bias). Parameters flagged `_lr_scale`
    (model=vlm's image encoder, model.vision.lr_scale; µP's hidden weights, models/mup.py) get groups of their own
    at lr * scale, and decayed ones flagged `_wd_scale` (µP) weight_decay * that scale.
    `muon`: the hidden matrices (`muon_matrices`) in groups of their own, first, and every group marked `"muon"`."""
    groups: dict = {}
    seen: set = set()
    emb_ids = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    matrices = muon_matrices(model) if muon else set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        decay = p.dim() >= 2 and id(p) not in emb_ids and not getattr(p, "_no_weight_decay", False)
        wd_scale = getattr(p, "_wd_scale", 1.0) if decay else 1.0
        groups.setdefault((getattr(p, "_lr_scale", 1.0), wd_scale, decay, id(p) in matrices), []).append(p)
    mark = (lambda matrix: {"muon": matrix}) if muon else (lambda matrix: {})
    out = [{"params": groups.pop((1.0, 1.0, True, False), []), "weight_decay": weight_decay, **mark(False)},
           {"params": groups.pop((1.0, 1.0, False, False), []), "weight_decay": 0.0, **mark(False)}]
    if muon:
        out.insert(0, {"params": groups.pop((1.0, 1.0, True, True), []), "weight_decay": weight_decay, **mark(True)})
    by = lambda kv: (kv[0][0], not kv[0][2], kv[0][1], not kv[0][3])  # noqa: E731
    for (scale, wd_scale, decay, matrix), params in sorted(groups.items(), key=by):
        out.append({"params": params, "weight_decay": weight_decay * wd_scale if decay else 0.0, "lr_scale": scale,
                    **({"lr": lr * scale} if lr is not None else {}), **mark(matrix)})
    # muon: no empty group (with a tied head every decayed matrix may be Muon's): torch.distributed.checkpoint maps
    # saved groups to the optimizer's by their parameters, and gives an empty group another group's settings
    return [g for g in out if g["params"]] if muon else out


def fused_adamw(params, precision: str) -> bool:
    """Whether AdamW takes its fused kernel (one launch over all parameters instead of a loop of foreach kernels:
    327 -> 49 ms per optimizer step on a 17.7M-param CPU model, docs/benchmarks.md) for these parameters at this
    Lightning precision. Needs every parameter floating point and on one device type fused supports (cuda, cpu).
    Then: on CUDA always, except 16-mixed (its GradScaler: a fused step unscales inside itself, so the gradients
    Lightning clips before the step would still be scaled); under bf16-mixed the gradients carry no scale and
    `TrainingModule.configure_gradient_clipping` clips them. On a CPU only without mixed precision (as before)."""
    kinds = {p.device.type for p in params}
    if len(kinds) != 1 or not all(p.is_floating_point() for p in params):
        return False
    kind = kinds.pop()
    if kind == "cuda":
        return str(precision) != "16-mixed"
    return kind == "cpu" and "mixed" not in str(precision)


def newton_schulz(G: torch.Tensor, steps: int = 5, coefficients=NS_COEFFICIENTS, eps: float = NS_EPS,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The quintic Newton-Schulz iteration X <- aX + b(XX^T)X + c(XX^T)^2 X from X = G / max(||G||_F, eps), on the
    wide orientation of the (A, B) matrix G, computed in `dtype`: U S' V^T with S' ~ 1 where G = U S V^T
    (torch.optim.Muon's `_zeropower_via_newtonschulz` op for op; G is never written)."""
    a, b, c = coefficients
    X = G.to(dtype)
    tall = G.size(0) > G.size(1)
    if tall:
        X = X.T
    X = X / X.norm().clamp(min=eps)
    for _ in range(steps):
        gram = X @ X.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        X = torch.addmm(X, poly, X, beta=a)
    return X.T if tall else X


def orthogonalise(update: torch.Tensor, steps: int, coefficients, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """`newton_schulz` of each matrix of `update`: an (A, B) matrix, or (E, A, B) stacked ones one by one. A DTensor
    (FSDP2's shards of a parameter) is gathered whole first: the iteration mixes every row with every other, so
    no rank can orthogonalise its rows alone; every rank orthogonalises the whole matrix and keeps its own rows."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor, distribute_tensor

        if isinstance(update, DTensor):
            whole = orthogonalise(update.full_tensor(), steps, coefficients, eps, dtype)
            return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)
    if update.dim() == 2:
        return newton_schulz(update, steps, coefficients, eps, dtype)
    return torch.stack([newton_schulz(m, steps, coefficients, eps, dtype) for m in update.flatten(0, -3)]).view(
        update.shape)


def match_rms_adamw(lr: float, shape) -> float:
    """Moonlight's learning rate for an (.., A, B) matrix's orthogonalised update: lr * 0.2 * sqrt(max(A, B)) (an
    orthogonal A x B matrix has RMS 1/sqrt(max(A, B)); AdamW's updates have RMS ~0.2-0.4, arXiv:2502.16982 sec. 2.2)."""
    return lr * 0.2 * math.sqrt(max(shape[-2], shape[-1]))


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer, two rules: Muon on the groups marked `"muon"` (`param_groups(..., muon=True)`), AdamW on the
    others (Keller Jordan's MuonWithAuxAdam), so LambdaLR (every group's "lr"), gradient clipping, Lightning and its
    checkpoints (`state_dict` / `load_state_dict`, also torch.distributed.checkpoint's) see a single optimizer.

    Muon, per matrix W with gradient G (torch.optim.Muon with nesterov and adjust_lr_fn="match_rms_adamw"):
        B <- momentum B + (1 - momentum) G;  U = (1 - momentum) G + momentum B  (Nesterov; B itself without)
        O = newton_schulz(U) in `ns_dtype`;  W <- W (1 - lr wd) - match_rms_adamw(lr, W.shape) O
    (Moonlight's momentum is the sum B <- mB + G, U = G + mB: (1 - m) times this one, the same O up to `ns_eps`.)
    AdamW: torch.optim.AdamW itself (`fused` as `fused_adamw` decides), over the same group dicts and state."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, ns_dtype: str = "bf16",
                 ns_coefficients=NS_COEFFICIENTS, ns_eps: float = NS_EPS, fused: bool | None = None):
        defaults = dict(lr=lr, weight_decay=weight_decay, muon=False, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, ns_dtype=ns_dtype, ns_coefficients=tuple(ns_coefficients), ns_eps=ns_eps)
        self._adamw = None
        super().__init__(params, defaults)
        rest = [g for g in self.param_groups if not g["muon"]]
        for group in self.param_groups:
            if group["muon"] and any(p.dim() < 2 for p in group["params"]):
                raise ValueError("Muon updates matrices (or stacks of them); a group marked muon holds a vector")
        if rest:
            self._adamw = torch.optim.AdamW(rest, lr=lr, betas=tuple(betas), eps=eps, fused=fused)
        self._link()

    def _link(self) -> None:
        """AdamW's groups and state are this optimizer's own dicts (again after load_state_dict replaced them)."""
        if self._adamw is not None:
            self._adamw.param_groups = [g for g in self.param_groups if not g["muon"]]
            self._adamw.state = self.state

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if self._adamw is not None and not param_group["muon"]:
            self._adamw.add_param_group(param_group)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["muon"]:
                self._muon_step(group)
        if self._adamw is not None:
            self._adamw.step()
        return loss

    def _muon_step(self, group: dict) -> None:
        lr, momentum, dtype = group["lr"], group["momentum"], NS_DTYPES[group["ns_dtype"]]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
            ortho = orthogonalise(update, group["ns_steps"], group["ns_coefficients"], group["ns_eps"], dtype)
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(ortho, alpha=-match_rms_adamw(lr, p.shape))


def ns_dtype_for(name: str, params: list) -> str:
    """optim.ns_dtype settled for these parameters: `auto` is bf16 on CUDA (Jordan's and torch.optim.Muon's choice:
    tensor cores, and the iteration is stable in bf16), otherwise the parameters' own precision (fp32, or fp64 under
    64-true): a CPU without bf16 units runs a bf16 matmul ~20x slower than fp32 (docs/optimizers.md)."""
    if name != "auto":
        return name
    if any(p.dtype == torch.float64 for p in params):
        return "fp64"
    return "bf16" if any(p.device.type == "cuda" for p in params) else "fp32"


def build_optimizer(model: nn.Module, o, precision: str = "32-true") -> torch.optim.Optimizer:
    """The run's optimizer from `optim.*` (config/schema.OptimConfig) over `model`'s groups (`param_groups`)."""
    if o.name == "muon":
        groups = param_groups(model, o.weight_decay, o.lr, muon=True)
        matrices = [p for g in groups if g["muon"] for p in g["params"]]
        rest = [p for g in groups if not g["muon"] for p in g["params"]]
        ns_dtype = ns_dtype_for(o.ns_dtype, matrices)
        log.info("optim=muon: %d matrices (%s of %s parameters) on Muon, Newton-Schulz in %s; the rest on AdamW",
                 len(matrices), f"{sum(p.numel() for p in matrices):,}", f"{sum(p.numel() for p in rest + matrices):,}",
                 ns_dtype)
        return MuonWithAdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, momentum=o.momentum,
                             nesterov=o.nesterov, ns_steps=o.ns_steps, ns_dtype=ns_dtype,
                             fused=fused_adamw(rest, precision))
    groups = param_groups(model, o.weight_decay, o.lr)
    return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                             fused=fused_adamw([p for g in groups for p in g["params"]], precision))
