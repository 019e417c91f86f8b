"""Mixture-of-Experts FFN (`model/ffn=moe`): router, top-k, routed + shared experts, balancing, dispatch.

One token's path:  scores = softmax(W_r x)  (Mixtral, Switch)  or  sigmoid(W_r x)  (DeepSeek-V3)
                   chosen = top_k(scores + b)              (b: aux-loss-free bias, selection only)
                   w      = scores[chosen] (/ sum, if norm_topk_prob) * routed_scaling_factor
                   y      = sum_k w_k E_k(x) + [sigmoid(g x)] * Shared(x)

Papers: Switch Transformer (Fedus et al. 2021) and GShard (Lepikhin et al. 2020) for the load-balancing
loss and the capacity factor; ST-MoE (Zoph et al. 2022) for the router z-loss; Mixtral (Jiang et al. 2024);
DeepSeekMoE (Dai et al. 2024) for fine-grained + shared experts; DeepSeek-V3 (2024) for sigmoid scoring,
group-limited routing and auxiliary-loss-free balancing; Qwen3-Next for the gated shared expert.

Dispatch (`impl = "fast"`): sort the (token, slot) assignments by expert, run each expert on its contiguous
rows (`torch._grouped_mm` when it works for the device/dtype/shapes, else a loop over experts), and
scatter back with the routing weights (`index_add`). With a capacity factor the rows go into a fixed
(E, C, d) buffer and one batched matmul (GShard). `impl = "reference"` computes every expert for every
token and masks by the routing weights: slow and obviously correct, on the same weights.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.layers import aux_loss as hooks
from attnzoo.layers.ffn import MLP, MLPConfig, SwiGLU, SwiGLUConfig, hidden_size
from attnzoo.config.registry import register_ffn
from attnzoo.ops.dispatch import autocast_off, constant_result
from attnzoo.layers.ffn_configs import MoEConfig  # noqa: F401 (torch-free: config checks)


# ----------------------------------------------------------------------------- dispatch helpers

_GROUPED_MM_OK: dict = {}


# an eager probe, never traced: under torch.compile it runs once at trace time and its answer is a constant of the
# graph (device and dtype are constants there); constant_result, not torch.compiler.disable, so that importing the
# FFN registry does not import torch._dynamo (issue 45)
@constant_result
def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs forward + backward here (it is private and its support differs
    by device, dtype and version); probed once per (device type, dtype) on a tiny problem."""
    key = (torch.device(device).type, dtype)
    if key not in _GROUPED_MM_OK:
        _GROUPED_MM_OK[key] = hasattr(torch, "_grouped_mm") and _probe_grouped_mm(device, dtype)
    return _GROUPED_MM_OK[key]


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


def _probe_grouped_mm(device, dtype) -> bool:
    try:
        # the first call may come from inside no_grad / inference mode (eval, generation): probe backward anyway;
        # and from inside a checkpointed block (trainer.activation_checkpointing): identity saved-tensor hooks keep
        # the probe's tensors out of the checkpoint, whose recomputation (probe cached by then) would miss them; its
        # own generator leaves the global one (dropout masks, replayed by the recomputation) where it was
        with torch.inference_mode(False), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(8, 16, generator=g).to(device, dtype).requires_grad_()
            w = torch.randn(2, 16, 16, generator=g).to(device, dtype).requires_grad_()
            offs = torch.tensor([3, 8], device=device, dtype=torch.int32)
            y = torch._grouped_mm(x, w, offs=offs)
            y.backward(torch.ones_like(y))
            ref = torch.cat([x[:3] @ w[0], x[3:] @ w[1]])
            return bool(torch.allclose(y, ref, rtol=1e-2, atol=1e-2))
    except Exception:  # noqa: BLE001 - any failure means "use the loop"
        return False


def _aligned(*sizes: int, dtype: torch.dtype) -> bool:
    """_grouped_mm needs row strides that are multiples of 16 bytes."""
    return all((s * dtype.itemsize) % 16 == 0 for s in sizes)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the expert matmuls run in: autocast's, if on (private ops are not autocast)."""
    if torch.amp.is_autocast_available(x.device.type) and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


# ----------------------------------------------------------------------------- the MoE layer


@register_ffn("moe", MoEConfig)
class MoE(nn.Module):
    """Routed experts + shared experts on (B, T, d_model).

    Parameters: router.weight (E, d); w_up (E, d, 2h) for SwiGLU (columns [gate | up]; HF's gate_up_proj
    is its transpose) or (E, d, h) for MLP; w_down (E, h, d); shared (a dense FFN), shared_gate (1, d).
    Expert weights are stored input-major (x @ w) because _grouped_mm on a transposed view is ~30x slower.
    Buffer expert_bias (E,): the aux-loss-free selection bias (zeros unless bias_update_speed > 0).
    """

    takes_token_mask = True
    impl: str = "fast"  # fast | reference

    def __init__(self, cfg: MoEConfig, d_model: int, layer_idx: int = 0, init_std: float = 0.02, n_layers: int = 1):
        super().__init__()
        self.cfg, self.d_model, self.layer_idx = cfg, d_model, layer_idx
        E, self.top_k = cfg.n_experts, cfg.top_k
        self.n_experts = E
        self.hidden = hidden_size(d_model, cfg.d_ff, cfg.hidden_mult, cfg.multiple_of)
        self.gated = cfg.expert_type == "swiglu"
        up_cols = (2 if self.gated else 1) * self.hidden
        self.router = nn.Linear(d_model, E, bias=False)
        self.w_up = nn.Parameter(torch.empty(E, d_model, up_cols))
        self.w_down = nn.Parameter(torch.empty(E, self.hidden, d_model))
        nn.init.normal_(self.router.weight, std=init_std)
        nn.init.normal_(self.w_up, std=init_std)
        nn.init.normal_(self.w_down, std=init_std / math.sqrt(2 * n_layers))  # GPT-2 residual scaling
        self.register_buffer("expert_bias", torch.zeros(E))
        self.register_buffer("_load_acc", torch.zeros(E), persistent=False)

        shared_h = cfg.shared_d_ff or cfg.n_shared_experts * self.hidden
        self.shared = None
        if shared_h:
            if self.gated:
                self.shared = SwiGLU(SwiGLUConfig(d_ff=shared_h, bias=False), d_model)
            else:
                self.shared = MLP(MLPConfig(d_ff=shared_h, bias=False), d_model)
        self.shared_gate = nn.Linear(d_model, 1, bias=False) if cfg.shared_expert_gate else None

        self.aux_loss: Optional[torch.Tensor] = None
        self._stats: dict = {}

    def _apply(self, fn, recurse=True):
        # the balancing state stays fp32 under .to(bf16): gamma-sized steps vanish in bf16's 8-bit mantissa
        super()._apply(fn, recurse)
        for name in ("expert_bias", "_load_acc"):
            self._buffers[name] = self._buffers[name].float()
        return self

    @classmethod
    def build(cls, cfg: MoEConfig, model_cfg, layer_idx: int) -> nn.Module:
        """DeepSeek's first-k-dense layers get a dense FFN of the same expert type; the rest are MoE."""
        if layer_idx < cfg.first_k_dense:
            if cfg.expert_type == "swiglu":
                return SwiGLU(SwiGLUConfig(d_ff=cfg.dense_d_ff), model_cfg.d_model)
            return MLP(MLPConfig(d_ff=cfg.dense_d_ff, bias=False), model_cfg.d_model)
        return cls(cfg, model_cfg.d_model, layer_idx, model_cfg.init_std, model_cfg.n_layers)

    # ------------------------------------------------------------------ router
    def route(self, x: torch.Tensor):
        """x (N, d) -> logits (N, E) fp32, probs (N, E) (the affinity distribution the aux loss uses),
        idx (N, K) chosen experts, weights (N, K) fp32 combine weights."""
        cfg, E, K = self.cfg, self.n_experts, self.top_k
        with autocast_off(x.device.type):  # route in fp32 even under bf16 autocast
            logits = F.linear(x.float(), self.router.weight.float())
        if cfg.scoring == "softmax":
            scores = probs = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
            probs = scores / scores.sum(dim=-1, keepdim=True)  # DeepSeek-V3's normalised affinities
        choice = scores.detach() + self.expert_bias  # the bias steers selection only, never the weights
        if cfg.n_group and cfg.n_group > 1:
            G = cfg.n_group
            grouped = choice.view(-1, G, E // G)
            # DeepSeek-V3 ranks a group by the sum of its two best scores
            group_score = grouped.topk(min(2, E // G), dim=-1).values.sum(dim=-1)  # (N, G)
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(cfg.topk_group or 1, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
        idx = choice.topk(K, dim=-1).indices  # (N, K)
        weights = scores.gather(1, idx)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, probs, idx, weights * cfg.routed_scaling_factor

    def capacity(self, n_tokens: int) -> Optional[int]:
        """Rows per expert with a capacity factor: ceil(cf * N * K / E); None when dropless."""
        cf = self.cfg.capacity_factor
        return None if cf is None else max(1, math.ceil(cf * n_tokens * self.top_k / self.n_experts))

    def plan(self, idx: torch.Tensor, real: torch.Tensor):
        """Group the N*K assignments by expert.

        Returns order (NK,): sorted row -> flat assignment (token = order // K); counts (E,): assignments
        per expert; and with a capacity C, keep (N, K) bool and slot (NK,): each sorted row's place
        e*C + rank in the (E, C) buffer, or the spare slot E*C when dropped (else both None).
        Within an expert earlier tokens win and padding goes last, so it never crowds out real tokens."""
        N, K = idx.shape
        E = self.n_experts
        flat = idx.reshape(-1)
        order = torch.argsort(flat * 2 + (~real).repeat_interleave(K).long(), stable=True)
        counts = torch.zeros(E, dtype=torch.long, device=idx.device).scatter_add_(0, flat, torch.ones_like(flat))
        C = self.capacity(N)
        if C is None:
            return order, counts, None, None
        e_sorted = flat[order]
        rank = torch.arange(N * K, device=idx.device) - (counts.cumsum(0) - counts)[e_sorted]  # place in its expert
        kept = rank < C
        keep = torch.empty_like(kept)
        keep[order] = kept
        slot = torch.where(kept, e_sorted * C + rank, E * C)
        return order, counts, keep.view(N, K), slot

    # ------------------------------------------------------------------ experts
    def _act(self, h: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(h, approximate="tanh")

    def experts_dense(self, x: torch.Tensor) -> torch.Tensor:
        """Reference: every expert on every token. x (N, d) -> (N, E, d)."""
        h = torch.einsum("nd,edf->nef", x, self.w_up)
        return torch.einsum("nef,efd->ned", self._act(h), self.w_down)

    def _use_grouped_mm(self, xs: torch.Tensor) -> bool:
        mode = self.cfg.dispatch
        if mode == "loop":
            return False
        ok = grouped_mm_works(xs.device, xs.dtype) and _aligned(self.d_model, self.hidden, dtype=xs.dtype)
        # torch.compile's shape function for _grouped_mm accepts bf16 only (torch 2.13)
        ok = ok and (xs.dtype == torch.bfloat16 or not torch.compiler.is_compiling())
        if mode == "grouped_mm" and not ok:
            raise RuntimeError(f"torch._grouped_mm is unavailable for {xs.device.type}/{xs.dtype}/d={self.d_model},"
                               f"h={self.hidden}; set dispatch=auto or loop")
        return ok

    def experts_sorted(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Dropless: xs (NK, d) sorted by expert, counts (E,) -> each row through its own expert (NK, d)."""
        w_up, w_down = self.w_up.to(xs.dtype), self.w_down.to(xs.dtype)
        if torch.compiler.is_compiling() and not torch.is_grad_enabled():
            # a compiled decode step (models/decoding.py): no split sizes read on the host and no eager probe; each
            # row through its own expert's gathered weights (a decode step has a few rows: the gathered weights are
            # what a grouped matmul would read)
            ids = torch.repeat_interleave(torch.arange(self.n_experts, device=xs.device), counts,
                                          output_size=xs.shape[0])
            h = torch.bmm(xs.unsqueeze(1), w_up.index_select(0, ids)).squeeze(1)
            return torch.bmm(self._act(h).unsqueeze(1), w_down.index_select(0, ids)).squeeze(1)
        if self._use_grouped_mm(xs):
            offs = counts.cumsum(0).to(torch.int32)  # group ends; no host sync
            h = torch._grouped_mm(xs, w_up, offs=offs)
            return torch._grouped_mm(self._act(h), w_down, offs=offs)
        out = []
        for e, rows in enumerate(xs.split(counts.tolist())):  # one host sync for the split sizes
            if rows.shape[0]:
                out.append(self._act(rows @ w_up[e]) @ w_down[e])
        return torch.cat(out) if out else xs.new_zeros(0, self.d_model)

    def experts_capacity(self, xs: torch.Tensor, slot: torch.Tensor, C: int) -> torch.Tensor:
        """Capacity-bounded: rows go to slot e*C + rank (dropped rows to a spare slot E*C), one batched
        matmul over the (E, C, d) buffer, rows read back (a dropped row reads zeros)."""
        E, d = self.n_experts, self.d_model
        buf = xs.new_zeros(E * C + 1, d).index_copy(0, slot, xs)[: E * C].view(E, C, d)
        h = torch.bmm(buf, self.w_up.to(xs.dtype))
        y = torch.bmm(self._act(h), self.w_down.to(xs.dtype)).reshape(E * C, d)
        return torch.cat([y, y.new_zeros(1, d)]).index_select(0, slot)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x (B, T, d) -> (B, T, d). token_mask (B, T) bool marks real tokens: balancing losses, load
        statistics and the bias update count only those (padding is still computed, and dropped first)."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (N, d)
        N, K, E = x2.shape[0], self.top_k, self.n_experts
        real = torch.ones(N, dtype=torch.bool, device=x.device) if token_mask is None else token_mask.reshape(-1).bool()

        logits, probs, idx, weights = self.route(x2)
        order, counts, keep, slot = self.plan(idx, real)
        if keep is not None:
            weights = weights * keep
        dt = _compute_dtype(x2)

        if self.impl == "reference":
            combine = torch.zeros(N, E, device=x.device, dtype=weights.dtype).scatter_add(1, idx, weights)
            y = torch.einsum("ne,ned->nd", combine.to(dt), self.experts_dense(x2.to(dt)))
        else:
            token = order // K  # sorted row -> token
            # (NK, d) grouped by expert; index_select, because x[token]'s backward is ~50x slower on CPU
            xs = x2.to(dt).index_select(0, token)
            if slot is None:
                ys = self.experts_sorted(xs, counts)
            else:
                ys = self.experts_capacity(xs, slot, self.capacity(N))
            ys = ys * weights.reshape(-1).index_select(0, order).to(ys.dtype).unsqueeze(-1)
            y = torch.zeros(N, shape[-1], device=x.device, dtype=ys.dtype).index_add(0, token, ys)

        if self.shared is not None:
            s = self.shared(x2)
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(x2)) * s
            y = y + s
        self._balance(logits, probs, idx, keep, real)
        return y.to(x.dtype).view(shape)

    # ------------------------------------------------------------------ balancing and statistics
    def _balance(self, logits, probs, idx, keep, real) -> None:
        """Aux losses and routing statistics over real tokens (no host syncs).

        load_i = real assignments to expert i (before dropping); f_i = load_i / (K * N_real);
        P_i = mean over real tokens of probs_i.  aux = E * sum_i f_i P_i  (= 1 when balanced).
        z = mean over real tokens of logsumexp(logits)^2.
        """
        cfg, E, K = self.cfg, self.n_experts, self.top_k
        m = real.to(probs.dtype)  # (N,)
        n_real = m.sum().clamp_min(1.0)
        load = torch.zeros(E, device=probs.device, dtype=probs.dtype).scatter_add(
            0, idx.reshape(-1), m.repeat_interleave(K)
        ).detach()
        with torch.set_grad_enabled(torch.is_grad_enabled() and cfg.aux_loss_coef > 0):
            P = (probs * m.unsqueeze(-1)).sum(0) / n_real
            aux = E * (load / (K * n_real) * P).sum()
        with torch.set_grad_enabled(torch.is_grad_enabled() and cfg.z_loss_coef > 0):
            z = (torch.logsumexp(logits, dim=-1).square() * m).sum() / n_real
        terms = []
        if cfg.aux_loss_coef > 0:
            terms.append(cfg.aux_loss_coef * aux)
        if cfg.z_loss_coef > 0:
            terms.append(cfg.z_loss_coef * z)
        if hooks.recomputing():
            # activation checkpointing re-runs this forward in backward: the losses above are recomputed for their
            # saved tensors, but the load was counted and the aux loss and statistics were stored the first time
            return
        self.aux_loss = torch.stack(terms).sum() if terms else None

        if self.training and cfg.bias_update_speed > 0:
            self._load_acc += load
        with torch.no_grad():
            p = probs.detach()
            entropy = -(p * p.clamp_min(1e-20).log()).sum(-1)
            dropped = torch.zeros((), device=p.device)
            if keep is not None:
                dropped = ((~keep) * m.unsqueeze(-1)).sum() / (K * n_real)
            balance = load.max() / load.mean().clamp_min(1e-9)
            self._stats = {
                "moe/aux_loss": aux.detach(),
                "moe/z_loss": z.detach(),
                "moe/load_max_over_mean": balance,
                "moe/dropped_frac": dropped,
                "moe/routing_entropy": (entropy * m).sum() / n_real,
                f"moe/layer{self.layer_idx}/load_max_over_mean": balance,
            }

    def stats(self) -> dict:
        """Detached metrics of the last forward (DecoderLM.stats averages them over layers)."""
        return dict(self._stats)

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """DeepSeek-V3 aux-loss-free balancing: b_i += gamma * sign(mean load - load_i), the load counted
        over the real tokens since the last step (all micro-batches, all ranks)."""
        if self.cfg.bias_update_speed <= 0:
            return
        load = self._load_acc
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(load)  # every rank must apply the same bias
        self.expert_bias += self.cfg.bias_update_speed * torch.sign(load.mean() - load)
        self._load_acc.zero_()

    # ------------------------------------------------------------------ accounting
    def _expert_flops(self) -> float:
        return 2.0 * (3 if self.gated else 2) * self.d_model * self.hidden

    def flops_per_token(self) -> float:
        """Forward FLOPs per token: router + K routed experts + shared experts (+ gate). Inactive experts
        cost nothing; the combine/softmax elementwise terms are left out like every other FFN's."""
        total = 2.0 * self.d_model * self.n_experts + self.top_k * self._expert_flops()
        if self.shared is not None:
            total += self.shared.flops_per_token()
        if self.shared_gate is not None:
            total += 2.0 * self.d_model
        return total

    def active_params(self) -> int:
        """Parameters one token touches: the router, K experts, the shared experts and their gate."""
        # from the shapes, not by indexing: under FSDP the weights are sharded DTensors and an index is a collective
        per_expert = (self.w_up.numel() + self.w_down.numel()) // self.n_experts
        total = self.router.weight.numel() + self.top_k * per_expert
        for mod in (self.shared, self.shared_gate):
            if mod is not None:
                total += sum(p.numel() for p in mod.parameters())
        return total

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"E={self.n_experts}, top_k={self.top_k}, hidden={self.hidden}, {c.expert_type}, {c.scoring}, "
                f"shared={0 if self.shared is None else 'yes'}, capacity={c.capacity_factor}, impl={self.impl}")
