"""Decoder-only language model assembled from the zoo: embedding, position, N blocks (mixer + FFN), head."""
from __future__ import annotations

import contextlib
import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from attnzoo.layers import aux_loss as hooks

from attnzoo.distributed import context_parallel as parallel
from attnzoo.layers.kv_cache import ModelCache, StaticModelCache
from attnzoo.config.schema import ModelConfig, layer_mixer_configs, resolve_model
from attnzoo.layers.ffn import build_ffn
from attnzoo.mixers.kv_quant import format_kwargs
from attnzoo.layers.norm import build_norm
from attnzoo.ops.packing import Documents
from attnzoo.layers.position import AbsolutePosition
from attnzoo.config.registry import MIXERS
from attnzoo.mixers.base import Mixer
from attnzoo.models import mup


def residual(h: torch.Tensor, f, norm: nn.Module, drop: nn.Module, pre: bool) -> torch.Tensor:
    """One residual sublayer, shared by every family: pre-norm h + f(norm(h)) or post-norm (Vaswani et al.)
    norm(h + f(h)), dropout on f's output."""
    return h + drop(f(norm(h))) if pre else norm(h + drop(f(h)))


class Block(nn.Module):
    """Residual block. pre-norm: h + mixer(norm(h)), then + ffn(norm(h)); post-norm (Vaswani et al.):
    norm(h + mixer(h)), then norm(h + ffn(h))."""

    def __init__(self, cfg: ModelConfig, mixer_cfg: Any, layer_idx: int):
        super().__init__()
        self.pre = cfg.norm_position == "pre"
        self.mixer = MIXERS.get(mixer_cfg.name).cls(mixer_cfg, cfg, layer_idx)
        self.ffn = build_ffn(cfg.ffn, cfg, layer_idx)
        self.has_ffn = not getattr(self.ffn, "is_identity", False)
        self.norm1 = build_norm(cfg.norm, cfg.d_model)
        self.norm2 = build_norm(cfg.norm, cfg.d_model) if self.has_ffn else None
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()

        # FFNs that route tokens (MoE) take the real-token mask so balancing ignores padding
        self.ffn_takes_mask = getattr(self.ffn, "takes_token_mask", False)

    def _ffn(self, x: torch.Tensor, token_mask: Optional[torch.Tensor]) -> torch.Tensor:
        return self.ffn(x, token_mask=token_mask) if self.ffn_takes_mask else self.ffn(x)

    def _mix(self, x: torch.Tensor, positions: torch.Tensor, cache: Any, documents: Any, carry: Any) -> torch.Tensor:
        kw = {"carry": carry} if self.mixer.carries else {}  # Mixer.carries: the forward's cross-layer carry
        if documents is not None:  # packed documents (packing.py): each runs as if alone
            return self.mixer.forward_packed(x, positions=positions, documents=documents, **kw)
        return self.mixer(x, positions=positions, cache=cache, **kw)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, cache: Any = None, token_mask=None,
                documents: Any = None, carry: Optional[dict] = None) -> torch.Tensor:
        h = residual(h, lambda x: self._mix(x, positions, cache, documents, carry), self.norm1, self.drop, self.pre)
        if self.has_ffn:
            h = residual(h, lambda x: self._ffn(x, token_mask), self.norm2, self.drop, self.pre)
        return h


def checkpoint_block(block: nn.Module, h: torch.Tensor, positions, token_mask, documents, carry=None) -> torch.Tensor:
    """block(h, ...) keeping only its input for backward, which runs the block again (activation checkpointing,
    Chen et al. 2016; torch.utils.checkpoint, non-reentrant). The recomputation restores the forward's RNG state
    (the same dropout masks), runs under `hooks.recomputation()` (stateful submodules do not count twice) and
    inside the forward's context-parallel group (parallel.sharded), so a sharded layer recomputes its ring."""
    cp = parallel.active()

    @contextlib.contextmanager
    def recompute():
        with hooks.recomputation(), parallel.sharded(cp):
            yield

    def contexts():  # (around the forward, around the recomputation), entered by checkpoint itself
        return contextlib.nullcontext(), recompute()

    kw = {} if torch.compiler.is_compiling() else {"context_fn": contexts}
    return torch.utils.checkpoint.checkpoint(block, h, positions, None, token_mask, documents, carry,
                                             use_reentrant=False, **kw)


class DecoderLM(nn.Module):
    """`forward(idx (B, T), positions=None, cache=None) -> logits (B, T, V)`.

    With a `ModelCache` the call continues from `cache.seq_len` (prefill, then one token at a time).
    `activation_checkpointing` (trainer.activation_checkpointing): in a training forward with gradients, each
    block keeps only its input and is recomputed in backward (`checkpoint_block`).
    """

    activation_checkpointing: bool = False

    def __init__(self, cfg: ModelConfig | Any, vocab_size: Optional[int] = None):
        super().__init__()
        cfg = resolve_model(cfg, vocab_size=vocab_size)
        if cfg.vocab_size is None:
            raise ValueError("model.vocab_size: not set; pass vocab_size= or set model.vocab_size")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.position = AbsolutePosition(cfg.position, cfg.d_model, cfg.max_seq_len)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.layer_mixers = layer_mixer_configs(cfg)
        self.blocks = nn.ModuleList(Block(cfg, mc, i) for i, mc in enumerate(self.layer_mixers))
        # pre-norm needs a final norm before the head; post-norm blocks already end normalised
        self.norm = build_norm(cfg.norm, cfg.d_model) if cfg.norm_position == "pre" else nn.Identity()
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # on the meta device (parameter counts: training/budget.py, µP's width-doubled twin) there are no values to
        # draw, and torch's meta normal_ runs its Python reference (~1 ms a tensor: most of a 125M count)
        if cfg.init == "gpt2" and not self.embed.weight.is_meta:
            self.apply(self._init_weights)
            # GPT-2: scale the residual-output projections by 1/sqrt(2 * n_layers)
            for name, p in self.named_parameters():
                if name.endswith(("o_proj.weight", "down.weight")):
                    nn.init.normal_(p, mean=0.0, std=cfg.init_std / math.sqrt(2 * cfg.n_layers))
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # model.parametrization=mup (models/mup.py): hidden weights' init and AdamW groups by the width, logits / m
        self.readout_multiplier = 1.0
        if cfg.parametrization == "mup":
            with torch.device("meta"):  # the same model at twice the width: which weights' fan-in grows
                delta = DecoderLM(mup.delta_config(cfg))
            self.readout_multiplier = mup.apply(self, delta)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=self.cfg.init_std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.cfg.init_std)

    # ------------------------------------------------------------------ forward
    def hidden_states(
        self,
        idx: torch.Tensor,
        positions: Optional[torch.Tensor] = None,
        cache: Optional[ModelCache] = None,
        token_mask: Optional[torch.Tensor] = None,
        documents: Optional[Documents] = None,
    ):
        """The final (normed) hidden states (B, T, d_model): `forward` without the head (arguments as there). An entry
        point of its own (the chunked loss starts here): FSDP registers it as a forward method (distributed/fsdp.py),
        so `forward` calls `_hidden_states`, not this, and never enters the root's hooks twice."""
        return self._hidden_states(idx, positions, cache, token_mask, documents)

    def _hidden_states(self, idx, positions=None, cache=None, token_mask=None, documents=None):
        B, T = idx.shape
        if documents is not None:
            if cache is not None:
                raise ValueError("documents (packed sequences) are for training and scoring; decode with a cache "
                                 "one document per row")
            positions = documents.positions() if positions is None else positions
        if positions is None:
            positions = torch.arange(T, device=idx.device) if cache is None else cache.positions(T, idx.device)
        h = self.drop(self.position(self.embed(idx), positions))
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled() and cache is None
        carry = {}  # what a layer leaves for the later layers of this forward (Mixer.carries)
        for i, block in enumerate(self.blocks):
            if recompute:
                h = checkpoint_block(block, h, positions, token_mask, documents, carry)
            else:
                h = block(h, positions, None if cache is None else cache[i], token_mask, documents, carry)
        if cache is not None:
            cache.advance(T)
        h = self.norm(h)
        # µP's readout multiplier on the head's input, so the chunked training loss (lm_head.weight) sees it too
        return h if self.readout_multiplier == 1.0 else h * self.readout_multiplier

    def forward(
        self,
        idx: torch.Tensor,
        positions: Optional[torch.Tensor] = None,
        cache: Optional[ModelCache] = None,
        token_mask: Optional[torch.Tensor] = None,
        documents: Optional[Documents] = None,
    ):
        """Logits for every position: `idx` (B, T) int64 token ids -> (B, T, vocab_size) in the weights' dtype.

        positions: (T,) or (B, T) int64 absolute token positions (RoPE phases, masks, learned/sinusoidal
            tables); None: `0..T-1`, or continuing from `cache.seq_len` when a cache is given.
        cache: a `ModelCache` from `new_cache`: each layer reads and updates its own cache in place and
            `cache.seq_len` advances by T (prefill with the prompt, then T=1 per decoded token). None: a plain
            training / scoring forward over the whole sequence.
        token_mask: (B, T) bool, True on real (non-padding) tokens; FFNs that route (MoE) balance only those.
        documents: an `attnzoo.ops.packing.Documents` (data.packing: several documents per row): each is
            computed as if alone (positions restart per document, no mixer looks across a document start).

        Refused (ValueError): `documents` together with a cache (decode one document per row). A position past
        `max_seq_len` with learned absolute positions is refused by the position table."""
        return self.lm_head(self._hidden_states(idx, positions, cache, token_mask, documents))

    # ------------------------------------------------------------------ hooks for stateful parts (MoE)
    def aux_loss(self) -> Optional[torch.Tensor]:
        """Sum of the auxiliary losses (MoE balancing) submodules left from the last forward (hooks.py)."""
        return hooks.aux_loss(self)

    def stats(self) -> dict:
        """Submodule metrics (e.g. moe/load_max_over_mean), averaged over layers (hooks.py)."""
        return hooks.stats(self)

    def after_optimizer_step(self) -> None:
        """Called after each optimizer step (e.g. aux-loss-free bias updates; hooks.py)."""
        hooks.after_optimizer_step(self)

    # ------------------------------------------------------------------ caches and accounting
    @property
    def mixers(self) -> list:
        return [b.mixer for b in self.blocks]

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype = torch.float32, device=None,
                  kv_format=None) -> ModelCache:
        """An empty `ModelCache` for `batch` rows of up to `max_len` tokens: one cache per layer, of that layer's
        mixer's kind (KV, ring buffer, latent, recurrent state; DESIGN.md section 2), on `device` (default: the
        weights' device), holding `dtype` values. `kv_format` (attnzoo.mixers.kv_quant.KVFormat): how the
        layers whose KV cache is quantizable store keys and values (bf16, KIVI int8/int4); None: as computed.
        The other layers' caches are unchanged. Pass it to `forward(..., cache=)`; `cache.nbytes()` is what it
        really holds."""
        device = device or self.embed.weight.device
        return ModelCache([m.new_cache(batch, max_len, dtype, device, **format_kwargs(m, kv_format)) for m in self.mixers])

    def new_static_cache(self, batch: int, max_len: int, dtype: torch.dtype = torch.float32,
                         device=None, kv_format=None) -> Optional[StaticModelCache]:
        """A `StaticModelCache` for `batch` rows of positions 0 .. max_len - 1 (every buffer allocated now and
        written in place; each row's position a tensor): the cache of one compiled decode step
        (attnzoo.models.decoding); kv_format: the KV format of the layers that take one (mixers/kv_quant.py). None
        when a layer's mixer has no static cache (`static_cache_missing`)."""
        if self.static_cache_missing():
            return None
        device = device or self.embed.weight.device
        return StaticModelCache([m.new_static_cache(batch, max_len, dtype, device, **format_kwargs(m, kv_format))
                                 for m in self.mixers], batch, max_len, device)

    def static_cache_missing(self) -> list:
        """The mixers (names, in layer order, once each) whose caches have no static form (Mixer.new_static_cache)."""
        missing = []
        for m, mc in zip(self.mixers, self.layer_mixers):
            if type(m).new_static_cache is Mixer.new_static_cache and mc.name not in missing:
                missing.append(mc.name)
        return missing

    def cache_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.float32, kv_format=None) -> int:
        return sum(m.cache_bytes(context_len, batch, dtype, **format_kwargs(m, kv_format)) for m in self.mixers)

    def decode_read_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        """The cache bytes one decode step reads at `context_len`, over the layers (Mixer.decode_read_bytes)."""
        return sum(m.decode_read_bytes(context_len, batch, dtype) for m in self.mixers)

    def flops_per_token(self, context_len: int) -> float:
        """Forward FLOPs per token (multiply-add = 2), LM head included, embedding lookup excluded."""
        total = 2.0 * self.cfg.d_model * self.cfg.vocab_size
        for b in self.blocks:
            total += b.mixer.flops_per_token(context_len)
            if b.has_ffn:
                total += b.ffn.flops_per_token()
        return total

    def num_params(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def active_params(self) -> int:
        """Parameters one token touches (differs from num_params for MoE: only its active experts)."""
        total = self.num_params()
        for b in self.blocks:
            if hasattr(b.ffn, "active_params"):
                total -= sum(p.numel() for p in b.ffn.parameters())
                total += b.ffn.active_params()
        return total

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        eos_id: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
        use_cache: bool = True,
        kv_format=None,
    ) -> torch.Tensor:
        """Autoregressive sampling: prefill the prompt `idx` (B, T) once, then one token per step from the cache
        (its keys/values stored in `kv_format`, see new_cache). Returns (B, T + n) token ids, n <= max_new_tokens
        (fewer when every row has produced `eos_id`).

        temperature: 0 = greedy (argmax); top_k / top_p: keep the k most likely tokens / the smallest set whose
        probability reaches p before sampling (`sample_next`); generator: the sampling RNG (reproducible
        completions); use_cache=False recomputes the whole sequence per token (the slow reference the cached
        path is tested against). The model is put in eval mode for the call and restored after."""
        was_training = self.training
        self.eval()
        B, T = idx.shape
        cache = self.new_cache(B, T + max_new_tokens, self.embed.weight.dtype, kv_format=kv_format) if use_cache else None
        logits = self(idx, cache=cache)[:, -1]
        out = idx
        for _ in range(max_new_tokens):
            nxt = sample_next(logits, temperature, top_k, top_p, generator)  # (B, 1)
            out = torch.cat([out, nxt], dim=1)
            if eos_id is not None and bool((nxt == eos_id).all()):
                break
            logits = self(nxt, cache=cache)[:, -1] if use_cache else self(out)[:, -1]
        self.train(was_training)
        return out


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """One token per row from (B, V) logits: greedy at temperature 0, else top-k then nucleus (top-p)."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    probs = F.softmax(filtered_logits(logits, temperature, top_k, top_p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


def filtered_logits(logits: torch.Tensor, temperature, top_k=None, top_p=None) -> torch.Tensor:
    """(B, V) logits / temperature in fp32, -inf outside the k most likely tokens (ties at the k-th kept), then
    outside the smallest set of those whose probability reaches top_p (the top token always stays). The settings
    may be numbers or 0-d tensors (a compiled decode step: no recompile when they change); top_k None or >= V and
    top_p None or 1 cut nothing."""
    logits = logits.float() / temperature
    V = logits.shape[-1]
    top_k = None if isinstance(top_k, int) and top_k >= V else top_k
    top_p = None if isinstance(top_p, (int, float)) and top_p >= 1 else top_p
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    if top_k is not None:  # the k-th largest logit, by index into the sorted row (k clamped to 1 .. V)
        k = torch.as_tensor(top_k, device=logits.device).clamp(1, V)
        kth = sorted_logits.gather(-1, (k - 1).reshape(1, 1).expand(logits.shape[0], 1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = F.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        p = torch.as_tensor(top_p, device=logits.device)
        drop = (probs.cumsum(dim=-1) - probs >= p) & (p < 1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
