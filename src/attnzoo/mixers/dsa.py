"""DeepSeek Sparse Attention (`dsa`; DeepSeek-AI 2025, "DeepSeek-V3.2: Pushing the Frontier of Open Large Language
Models", arXiv:2512.02556): MLA (mla.py, reused as it is) whose every query attends only its top-k keys, chosen by a
lightning indexer (ops/dsa.py holds the math and the reference form):

    x ──indexer.wk──> LayerNorm ──> RoPE on the first d_r dims ──> k_idx (B, T, DI)     one index key per token
    c_q ──indexer.wq_b──> (HI heads of DI) ──> RoPE on the first d_r dims ──> q_idx     (c_q: MLA's query latent,
    x ──indexer.weights_proj──> w (HI per token) * HI^-1/2                                 or x without q_lora_rank)
    I[t, s] = sum_j w[t, j] relu(DI^-1/2 q_idx[t, j] . k_idx[s]);   S_t = top-k of I[t, :] over s <= t
    out = MLA's attention with each query restricted to S_t (one selection for all heads)

The layout is transformers' `DeepseekV32Indexer` (tests/test_dsa.py matches its attention module on copied
weights): the indexer's RoPE is rotate-half whatever MLA's `rope_interleave`, on the first qk_rope_head_dim dims.
A model whose every layer is dsa imports from and exports to transformers' DeepseekV32ForCausalLM (interop/hf,
`model.init_from` / attnzoo-export; V3.2 needs a q_lora_rank and rope_interleave=true).

Training signal. The top-k is a selection, not differentiable: the main attention's gradient never reaches the
indexer. As the paper, the indexer learns from its own loss only (`index_loss_coef` x `indexer_kl`, left in
`aux_loss` and added to the training loss by layers/aux_loss.py): per query, KL(main attention probabilities
summed over heads and L1-normalised || softmax of the index scores), over the selected keys (the paper's sparse
stage, Eq. 4; with index_topk >= the sequence, every causal key: its dense warm-up, Eq. 3), with the indexer's
inputs detached so that the loss trains the indexer alone and the language-model loss the rest. The KL is averaged
over queries (the paper sums) and logged as `dsa/indexer_kl`. index_loss_coef=0 freezes the indexer at its init
(transformers runs its indexer under no_grad). `index_warmup_steps` N: the first N optimizer steps train dense
(every visible key, the KL over all of them: the paper's warm-up stage), then the top-k applies; the trainer says
the step before each batch (`set_train_step`, layers/aux_loss.py), so a resumed run continues where it was.
Validation and decoding always use the top-k. `index_warmup_freeze`: during the warm-up only the indexers train,
the rest of the model frozen (the paper's stage 1; `trains_only`, layers/aux_loss.py, and the TrainingModule drops
every other gradient before the optimizer step); without it everything trains from the first step.

Forms: fast (dense index scores, the top-k as a boolean mask over MLA's SDPA; a one-token cached step gathers its
k latents and attends over them only), reference (ops/dsa.dsa_attention_reference on the expanded K/V: each query
alone, its keys ranked in Python). Cache: MLA's latents plus each token's index key (`IndexedLatentCache`, static:
`StaticIndexedLatentCache`): kv_lora_rank + qk_rope_head_dim + index_head_dim values per token. Packing is native
(the document mask restricts the selection too). No ring form (context parallelism is refused by the config
checks); no fla kernel (fla-core has a naive DSA only).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from attnzoo.config.registry import register_mixer
from attnzoo.layers import aux_loss as hooks
from attnzoo.mixers.base import HF_SPARSE_LATENT_ATTENTION, causal_attended, dtype_bytes
from attnzoo.mixers.configs import DSAConfig  # noqa: F401 (torch-free: config checks)
from attnzoo.mixers.mla import MLA, LatentCache, StaticLatentCache
from attnzoo.ops.dsa import (causal_visible, dsa_attention_reference, index_scores, indexer_kl, select_topk,
                             topk_slots)


class IndexedLatentCache(LatentCache):
    """MLA's `LatentCache` plus every token's index key: k_idx (B, T, index_head_dim), in the latents' dtype."""

    def __init__(self, kv_lora_rank: int) -> None:
        super().__init__(kv_lora_rank)
        self.k_idx: Optional[torch.Tensor] = None

    def update_index(self, k_idx: torch.Tensor) -> torch.Tensor:
        """Append the new tokens' (B, t, DI) index keys; return every token's so far."""
        self.k_idx = k_idx.contiguous() if self.k_idx is None else torch.cat([self.k_idx, k_idx.to(self.k_idx.dtype)], 1)
        return self.k_idx


class StaticIndexedLatentCache(StaticLatentCache):
    """MLA's `StaticLatentCache` plus k_idx (B, max_len, index_head_dim): slot s holds position s's index key."""

    def __init__(self, batch: int, max_len: int, width: int, index_dim: int, dtype: torch.dtype, device,
                 conv_tail: Optional[torch.Tensor] = None) -> None:
        super().__init__(batch, max_len, width, dtype, device, conv_tail=conv_tail)
        self.k_idx = torch.zeros(batch, max_len, index_dim, dtype=dtype, device=device)

    def write_index(self, k_idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """New (B, T, DI) index keys at `positions` (B, T); returns every slot."""
        rows = torch.arange(k_idx.shape[0], device=k_idx.device)[:, None]
        self.k_idx[rows, positions] = k_idx.to(self.k_idx.dtype)
        return self.k_idx

    def filled_bytes(self, lengths: torch.Tensor) -> int:
        per_token = self.k_idx.shape[2] * self.k_idx.element_size()
        return super().filled_bytes(lengths) + per_token * int(lengths.clamp(max=self.k_idx.shape[1]).sum())


class LightningIndexer(nn.Module):
    """The indexer's weights, named as transformers' `DeepseekV32Indexer`: wq_b (query input -> HI x DI), wk
    (d_model -> DI, one key per token), k_norm (LayerNorm, eps 1e-6), weights_proj (d_model -> HI)."""

    def __init__(self, q_in: int, d_model: int, n_heads: int, head_dim: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.wq_b = nn.Linear(q_in, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(d_model, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(d_model, n_heads, bias=False)

    def forward(self, x: torch.Tensor, q_in: torch.Tensor, positions: torch.Tensor, rope):
        """x (B, T, d_model), q_in (B, T, *) MLA's query input, both detached here -> q_idx (B, HI, T, DI), k_idx
        (B, T, DI), w (B, HI, T). `rope` (MLA's, d_r dims; None without RoPE) rotates the first d_r dims."""
        B, T, _ = x.shape
        x, q_in = x.detach(), q_in.detach()
        q = self.wq_b(q_in).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_norm(self.wk(x))
        if rope is not None:
            cs = rope.cos_sin(positions, x.dtype)
            cs_k = tuple(c[:, 0] for c in cs) if positions.dim() == 2 else cs  # (B, 1, T, dr) -> (B, T, dr)
            q, k = rope(q, None, cs), rope(k, None, cs_k)
        w = (self.weights_proj(x) * self.n_heads ** -0.5).transpose(1, 2)
        return q, k, w


@register_mixer("dsa", DSAConfig)
class DeepSeekSparseAttention(MLA):
    SHAPE_FIELDS = MLA.SHAPE_FIELDS + ("index_n_heads", "index_head_dim", "index_topk")
    hf_layer = HF_SPARSE_LATENT_ATTENTION  # DeepSeek-V3.2 (interop/hf: DeepseekV32ForCausalLM)
    packing = "native"  # the document mask bounds the selection as it bounds the attention

    def __init__(self, cfg: DSAConfig, model_cfg, layer_idx: int):
        super().__init__(cfg, model_cfg, layer_idx)
        self.index_n_heads, self.index_topk = cfg.index_n_heads, cfg.index_topk
        self.index_head_dim = cfg.sizes(model_cfg)["index_head_dim"]
        q_in = self.d_model if self.q_lora_rank is None else self.q_lora_rank
        self.indexer = LightningIndexer(q_in, self.d_model, self.index_n_heads, self.index_head_dim)
        if cfg.index_loss_coef == 0:  # no loss reaches it: frozen (and not a DDP unused parameter)
            self.indexer.requires_grad_(False)
        self.aux_loss: Optional[torch.Tensor] = None
        self._stats: dict = {}
        self.warmup_steps = cfg.index_warmup_steps
        self._warm = self.warmup_steps > 0  # dense training forwards until set_train_step reaches warmup_steps

    @classmethod
    def hf_mixer_config(cls, c: dict) -> dict:
        """DeepSeek-V3.2's attention fields: MLA's (its main RoPE interleaved) and the indexer's."""
        return {**MLA.hf_mixer_config(c), "name": "dsa", "rope_interleave": True, "index_n_heads": c["index_n_heads"],
                "index_head_dim": c["index_head_dim"], "index_topk": c["index_topk"]}

    def set_train_step(self, step: int) -> None:
        """Before each training batch (layers/aux_loss.set_train_step): dense while step < index_warmup_steps."""
        self._warm = step < self.warmup_steps

    def trains_only(self) -> Optional[list]:
        """During a frozen warm-up, the step updates the indexer alone (layers/aux_loss.trains_only)."""
        return list(self.indexer.parameters()) if self._warm and self.cfg.index_warmup_freeze else None

    # ------------------------------------------------------------------ the sparse attention
    def sparse_attend(self, q_nope, q_rope, latent, q_idx, k_idx, w, visible=None, step: bool = False):
        """MLA's attention of q_nope / q_rope (B, H, T, *) over latent (B, S, r + dr), each query restricted to its
        top-k keys by the index scores of q_idx / k_idx / w; visible (T, S) or (B, T, S) the keys it may see at all
        (None: causal, the queries the last T of S); step: a one-token cached call (gathers its keys).
        Returns (B, H, T, dv) and the indexer's KL loss (None unless training it)."""
        T, S = q_nope.shape[2], latent.shape[1]
        visible = causal_visible(T, S, q_nope.device) if visible is None else visible
        learn = self.training and torch.is_grad_enabled() and self.cfg.index_loss_coef > 0
        topk = S if self.training and self._warm else self.index_topk  # the dense warm-up: every visible key
        scores = chosen = None
        if learn or self.impl != "reference":
            with torch.set_grad_enabled(learn):
                scores = index_scores(q_idx, k_idx, w)  # (B, T, S) in at least fp32
        if self.impl == "reference":
            k, v = self.expand(latent)
            y = dsa_attention_reference(torch.cat([q_nope, q_rope], -1), k, v, q_idx, k_idx, w, topk=topk,
                                        visible=visible, scale=self.scale)
        else:
            absorbed = self.cfg.absorb == "always" or (self.cfg.absorb == "decode" and step)
            attend = self.attend_absorbed if absorbed else self.attend_expanded
            if step:  # the k chosen latents gathered: the step reads those and the index keys only
                slots, valid = topk_slots(scores, visible, topk)  # (B, 1, k)
                picked = latent.gather(1, slots[:, 0, :, None].expand(-1, -1, latent.shape[-1]))
                y = attend(q_nope, q_rope, picked, valid)
            else:
                chosen = select_topk(scores, visible, topk)
                y = attend(q_nope, q_rope, latent, chosen)
        if not learn:
            return y, None
        chosen = select_topk(scores, visible, topk) if chosen is None else chosen
        with torch.no_grad():
            k, _ = self.expand(latent)
        q = torch.cat([q_nope, q_rope], -1).detach()
        return y, indexer_kl(scores, chosen, q, k, scale=self.scale)

    def _finish(self, y: torch.Tensor, kl: Optional[torch.Tensor]) -> torch.Tensor:
        """o_proj of (B, H, T, dv); keep the indexer's loss for the training step (not when activation checkpointing
        recomputes this forward: the first one's is kept, layers/aux_loss.py)."""
        if not hooks.recomputing():
            self.aux_loss = None if kl is None else self.cfg.index_loss_coef * kl
            self._stats = {} if kl is None else {"dsa/indexer_kl": kl.detach()}
        B, _, T, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.dv))

    def stats(self) -> dict:
        """The last training forward's indexer KL (DecoderLM.stats averages it over layers)."""
        return dict(self._stats)

    # ------------------------------------------------------------------ contract
    def forward(self, x: torch.Tensor, *, positions: torch.Tensor, cache=None) -> torch.Tensor:
        B, T, _ = x.shape
        x = self.shift(x, cache)
        q_in = self.query_input(x)
        q_nope, q_rope, latent = self.project(x, positions, q_in=q_in)
        q_idx, k_idx, w = self.indexer(x, q_in, positions, self.rope)
        visible = None
        if cache is not None and cache.static:  # every slot, under the mask of the positions they hold
            pos = positions.expand(B, -1) if positions.dim() == 1 else positions
            dtype = latent.dtype
            latent, k_idx = cache.write(latent, pos).to(dtype), cache.write_index(k_idx, pos).to(dtype)
            visible = torch.arange(latent.shape[1], device=x.device)[None, None] <= pos[:, :, None]  # (B, T, S)
        elif cache is not None:
            latent, k_idx = cache.update(latent), cache.update_index(k_idx.to(latent.dtype))
        y, kl = self.sparse_attend(q_nope, q_rope, latent, q_idx, k_idx, w, visible, step=cache is not None and T == 1)
        return self._finish(y, kl)

    def forward_packed(self, x: torch.Tensor, *, positions: torch.Tensor, documents) -> torch.Tensor:
        """Every document of a packed row under its document mask: a query's index scores, selection and attention
        see its own document's keys only, and positions restart per document, so each equals its document alone."""
        x = self.shift_packed(x, documents)
        q_in = self.query_input(x)
        q_nope, q_rope, latent = self.project(x, positions, q_in=q_in)
        q_idx, k_idx, w = self.indexer(x, q_in, positions, self.rope)
        return self._finish(*self.sparse_attend(q_nope, q_rope, latent, q_idx, k_idx, w, documents.mask(causal=True)[:, 0]))

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> IndexedLatentCache:
        return IndexedLatentCache(self.kv_lora_rank)

    def new_static_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> StaticIndexedLatentCache:
        tail = None if self.input_conv is None else self.input_conv.empty_tail(batch, dtype, device)
        return StaticIndexedLatentCache(batch, max_len, self.kv_lora_rank + self.dr, self.index_head_dim, dtype, device,
                                        conv_tail=tail)

    def cache_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        """MLA's latents plus an index key per token: (kv_lora_rank + qk_rope_head_dim + index_head_dim) values."""
        index_keys = self.index_head_dim * context_len * batch * dtype_bytes(dtype)
        return super().cache_bytes(context_len, batch, dtype) + index_keys

    def decode_read_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        """A decode step reads every index key (the indexer scores them all) and the latents of its top-k keys."""
        per_row = self.index_head_dim * context_len + (self.kv_lora_rank + self.dr) * min(self.index_topk, context_len)
        return per_row * batch * dtype_bytes(dtype) + self.input_conv_bytes(batch, dtype)

    def flops_per_token(self, context_len: int) -> float:
        """Every projection (the indexer's too), the indexer over every causal key (HI dot products of DI and their
        HI-weighted sum, (L + 1) / 2 keys on average), MLA's attention (QK^T over dn + dr, PV over dv per head) over
        min(top-k, t) keys: the reference form's per-query work, exactly (tests/test_dsa.py)."""
        proj = sum(m.in_features * m.out_features for m in self.modules() if isinstance(m, nn.Linear))
        index = 2.0 * self.index_n_heads * (self.index_head_dim + 1) * causal_attended(context_len)
        attn = 2.0 * self.n_heads * (self.dn + self.dr + self.dv) * causal_attended(context_len, self.index_topk)
        return 2.0 * proj + self.input_conv_flops() + index + attn
