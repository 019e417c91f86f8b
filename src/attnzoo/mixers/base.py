"""The mixer contract: what every token mixer implements, and what the rest of the model assumes.

A new mixer is one file in this package plus one yaml in conf/model/mixer/ (the yaml's values must equal
the config dataclass's defaults: tests/test_families.py checks it; tests/test_add_a_mixer.py adds a toy one and
trains it with nothing else edited). tests/test_mixers_contract.py applies the whole contract below to every
registered mixer automatically. What the rest of the package needs to know about a mixer it asks the class
(the attributes below `context_parallel`), never the mixer's name (tests/test_mixer_knowledge.py).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn


class Mixer(nn.Module):
    """Maps (B, T, d_model) -> (B, T, d_model).

    Registration: `@register_mixer("name", ConfigDataclass)` on the class; the dataclass has a `name` field
    and may define `validate(model_cfg, field)` raising `ConfigError` (one line, naming `field.<key>`)
    for values that are wrong for this model (called by `config.resolve_model` before anything is built).

    Construction: `cls(cfg, model_cfg, layer_idx)`; model_cfg is the resolved `ModelConfig` (head_dim,
    n_kv_heads, position settled once: read them, do not re-derive them).

    Required:
      forward(x (B, T, d_model), *, positions (T,) absolute token positions, cache=None) -> (B, T, d_model).
          With a cache: continue from what the cache holds (any T >= 1: one-token decode and multi-token
          chunks on a non-empty cache must both equal the full forward), and update the cache in place.
      new_cache(batch, max_len, dtype, device) -> a `layers.kv_cache.LayerCache` subclass. Every tensor it holds is
          batch-first (beam search reorders dim 0 of every tensor attribute) and counted by `nbytes()`.
      cache_bytes(context_len, batch=1, dtype=torch.float32) -> int: the analytic bytes held after
          context_len tokens; must equal the cache's measured `nbytes()` after a real prefill.
      flops_per_token(context_len) -> float: forward FLOPs per token averaged over positions 1..L, by the
          project's convention (2 per multiply-add; causal average of attended keys; softmax, norms and
          the delta rule's triangular inverse not counted); checked against FlopCounterMode.
    Conventions the model relies on:
      - the output projection is named `o_proj` (GPT-2 init scales it by 1/sqrt(2 n_layers));
      - parameters that must not be weight-decayed carry `_no_weight_decay = True` (e.g. A_log, dt_bias);
      - `impl = "reference"` switches to a slow, obviously-correct form of the same weights: a different
        code path (the contract test fails when the two are bit-identical), equal to fp64 precision;
      - a short input conv (`build_input_conv` / `shift`) keeps its K-1 tail in `cache.conv_tail`;
      - `context_parallel = True` declares a path for a sequence split over ranks (parallel.active());
      - `forward_packed(x, *, positions (B, T), documents)` runs a packed batch (packing.Documents: several
        documents per row) as if each document ran alone. The default gathers one padded row per document
        and calls forward; mixers override it with a native form (`packing = "native"`): a document mask,
        state resets at document starts;
      - `layer_shape()` reports what the layer really is (heads, KV heads, sizes, state) for summaries.
    What other parts ask the class (defaults here, overridden per mixer; each commented where it is declared):
    `full_causal_attention` (context-parallel layout), `kernel_family` / `dispatch_family()` (kernel dispatch),
    `kv_quantizable` (KV formats), `bidirectional` (encoder-decoder), `linearize_source` / `linearize_target` /
    `linearize_sizes()` (linearize), `hf_layer` / `hf_missing` / `hf_mixer_config()` (transformers interop),
    `check_seq_len()` (the training length); the class's own `mup_qk_grows()` (µP's q.k scale, `mup_qk_scale`).
    """

    impl: str = "fast"
    # reads / writes the model's per-forward `carry` (a dict the model makes once per forward and hands every layer
    # whose class sets this, in layer order: forward / forward_packed then take `carry=`): what one layer leaves for
    # later layers of the same forward, e.g. RWKV-7's value residual (the first RWKV-7 layer's values). Keys are the
    # mixer's own; nothing outside the mixer reads them
    carries: bool = False
    # runs on a shard of a sequence split over a context-parallel group (parallel.py; trainer.context_parallel):
    # forward with cache=None under `parallel.sharded` must equal the full-sequence forward on its tokens
    context_parallel: bool = False

    # ---- what the rest of the package asks a mixer class (never its name); tests/test_mixer_knowledge.py
    # checks each is set consistently
    # context parallelism (distributed/context_parallel.resolve_layout): causal softmax over the whole past, so
    # a contiguous shard's work grows with its position and the `auto` layout is zigzag (equal work per rank)
    full_causal_attention: bool = False
    # ops/dispatch.py: the kernel family a call is dispatched by (one of dispatch.FAMILY_NAMES); a layer whose
    # settings the fast kernel does not cover narrows it to "other" (`dispatch_family`)
    kernel_family: str = "other"
    fla_kernel: Optional[str] = None  # the fla function its fast path calls (ops/dispatch.py FLA_KERNELS), if any
    # inference KV formats (mixers/kv_quant.py): the cache is a plain `KVCache` read through `update` only, so
    # bf16 / KIVI int8 / int4 storage applies (`new_cache` / `cache_bytes` take `kv_format=`)
    kv_quantizable: bool = False
    # models/encoder_decoder.py: runs bidirectionally (config causal=false) over a key padding mask through
    # `project()` / `output()`, and its config's `kv_heads(model)` gives its K/V heads: a kind of encoder
    # self-attention and of cross-attention
    bidirectional: bool = False
    # training/linearize.py (LoLCATs): softmax attention whose q/k/v/o projections can seed a linear mixer
    # (`linearize_source`), and the fixed-state mixers it can become (`linearize_target`; `linearize_sizes`)
    linearize_source: bool = False
    linearize_target: bool = False
    # interop/hf: the transformers decoder layer this mixer is exactly equivalent to (one of HF_LAYERS; its
    # config section from a config.json: `hf_mixer_config`), or None with the reason in `hf_missing`
    hf_layer: Optional[str] = None
    hf_missing: str = "this mixer has no transformers causal-LM counterpart"

    # µP (model.parametrization=mup; models/mup.py, docs/mup.md): whether this mixer's q.k, once training aligns q
    # with k, grows like d (the q/k size per head) and reaches the output undivided, so µP scales it by d^-1/2 more
    # (softmax: 1/d instead of 1/sqrt(d)); `mup_qk_scale` applies it. A class may decide per config (classmethod)
    @classmethod
    def mup_qk_grows(cls, cfg: Any) -> bool:
        return False

    def __init__(self, cfg: Any, model_cfg: Any, layer_idx: int):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.d_model = model_cfg.d_model
        # model.impl (auto | torch | fla | flex): resolved per call by ops/dispatch.py from the input's device
        self.kernel_request: str = getattr(model_cfg, "impl", "auto")
        self.input_conv: Optional[nn.Module] = None

    def mup_qk_scale(self, model_cfg: Any, d: int, scale: Optional[float],
                     multiplier: Optional[float] = None) -> Optional[float]:
        """The q.k scale this layer applies: `scale`, the standard parametrization's (None: the kernel's d^-1/2); under
        model.parametrization=mup where `mup_qk_grows(cfg)`, multiplier / d instead (softmax attention: 1/d, as Yang
        et al. 2022; `multiplier`: the config's own scale field, None = 1, as mup's attn_mult in attn_mult / d)."""
        if getattr(model_cfg, "parametrization", "standard") != "mup" or not self.mup_qk_grows(self.cfg):
            return scale
        return (1.0 if multiplier is None else multiplier) / d

    # ------------------------------------------------------------------ short conv on the mixer input
    def build_input_conv(self, conv_size: int, bias: bool = False) -> None:
        """A short causal depthwise conv over the mixer input, before any projection (the H3 / Based
        "shift conv"; Allen-Zhu 2025's Canon-A layer). It lets one attention layer see the previous
        tokens' content, which associative recall needs (Arora et al. 2023, Zoology). No activation.
        The decode cache keeps its last conv_size - 1 inputs (`conv_tail`), counted in `cache_bytes`."""
        from attnzoo.mixers.short_conv import ShortConvolution

        if conv_size > 0:
            self.input_conv = ShortConvolution(self.d_model, conv_size, bias=bias, activation=None)

    def shift(self, x: torch.Tensor, cache: Optional[Any]) -> torch.Tensor:
        """Apply the input conv (identity without one), reading and updating `cache.conv_tail`."""
        if self.input_conv is None:
            return x
        y, tail = self.input_conv(x, None if cache is None else cache.conv_tail)
        if cache is not None:  # a view of the padded input: own the K-1 columns only (a static cache: in place)
            cache.store("conv_tail", tail.contiguous())
        return y

    def input_conv_bytes(self, batch: int, dtype: torch.dtype) -> int:
        if self.input_conv is None:
            return 0
        return batch * self.input_conv.channels * (self.input_conv.kernel_size - 1) * dtype_bytes(dtype)

    def input_conv_flops(self) -> float:
        return 0.0 if self.input_conv is None else self.input_conv.flops_per_token()

    def shift_packed(self, x: torch.Tensor, documents: Any) -> torch.Tensor:
        """`shift` over packed documents: the input conv never reads the previous document's tokens."""
        if self.input_conv is None:
            return x
        from attnzoo.ops.packing import masked_conv

        return masked_conv(self.input_conv, x, documents.positions())

    def forward(self, x: torch.Tensor, *, positions: torch.Tensor, cache: Optional[Any] = None) -> torch.Tensor:
        """Mix the tokens of x (B, T, d_model) -> (B, T, d_model); a causal mixer's token t reads tokens <= t only.

        positions (T,) int64: the absolute positions of x's tokens, cache.seq_len .. cache.seq_len + T - 1 when
            continuing a cache, else 0 .. T - 1 (RoPE phases, ALiBi distances and masks read them).
        cache: None for a plain (training / full-sequence) forward; else this layer's cache from `new_cache`,
            holding what earlier calls left: the call continues from it for any T >= 1 (a one-token decode step
            and a multi-token chunk both equal the full forward on all the tokens so far) and updates it in place.
        Under a context-parallel split (`parallel.active()`, cache None) x holds this rank's tokens only; only
        mixers that declare `context_parallel` are run so (training/config_checks refuses the others).
        Refused (one-line ConfigError): an explicit model.impl=fla / flex on a tensor where it cannot run
        (ops/dispatch.py). Not checked: a cache of another layer or positions that do not continue it (the
        result is wrong, not an error); the config's checks (`validate`, `check_seq_len`) ran before building."""
        raise NotImplementedError

    # how forward_packed runs: "gather" = each document alone in a padded batch (any causal mixer), "native"
    packing: str = "gather"

    def forward_packed(self, x: torch.Tensor, *, positions: torch.Tensor, documents: Any) -> torch.Tensor:
        """x (B, T, d_model) holding several documents per row (`documents`, packing.Documents), positions (B, T)
        restarting at each document -> (B, T, d_model), equal to running each document alone.

        Default: each document by its own call when they are few (packing.SPLIT_MAX_DOCUMENTS), else one row per
        document, padded at the end (padding after a document cannot reach it in a causal mixer), in one call;
        positions 0..L-1; then back to the packed layout. Exact for every causal mixer. Mixers with a
        document-masked form override this."""
        if documents.split():  # few documents: each by its own call, no padding
            return documents.per_document(lambda xd: self(xd, positions=torch.arange(xd.shape[1], device=x.device)), x)
        xd = documents.gather(x)
        y = self(xd, positions=torch.arange(xd.shape[1], device=x.device))
        return documents.scatter(y)

    SHAPE_FIELDS = ("n_heads", "n_kv_heads", "head_dim", "window", "n_qk_heads", "n_v_heads", "qk_dim", "v_dim",
                    "phi_dim", "state_shape", "kv_lora_rank", "dn", "dr", "dv")

    def layer_shape(self) -> dict:
        """What this layer really is, as built (the run summary and summary.json print it): its name and
        whichever of SHAPE_FIELDS it has (heads, KV heads, head sizes, window, state shape, MLA latent),
        plus the short conv's kernel. A mixer with other defining sizes extends this."""
        out: dict = {"mixer": getattr(self.cfg, "name", type(self).__name__)}
        for k in self.SHAPE_FIELDS:
            v = getattr(self, k, None)
            if isinstance(v, (int, tuple)) and not isinstance(v, bool) and v is not None:
                out[k] = list(v) if isinstance(v, tuple) else v
        conv = self.input_conv if self.input_conv is not None else getattr(self, "conv", None)
        if conv is not None and hasattr(conv, "kernel_size"):
            out["conv"] = conv.kernel_size
        return out

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str) -> Any:
        """An empty cache for `batch` sequences: this mixer's `LayerCache` subclass (layers/kv_cache.py), which
        `forward(..., cache=)` fills. max_len: the longest context it is meant for (a hint: caches grow, or are
        bounded / fixed-size; none refuses a longer context); dtype, device: of the cached values (recurrent
        states are kept in at least fp32). Every tensor it holds is batch-first (beam search reorders dim 0 of
        each) and counted by its `nbytes()`. `kv_quantizable` mixers also take `kv_format=` (mixers/kv_quant.py)."""
        raise NotImplementedError

    def new_static_cache(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str) -> Any:
        """The static form of this mixer's cache (layers/kv_cache.StaticModelCache: the compiled decode of
        attnzoo.models.decoding): `static = True`, every tensor allocated here for positions 0 .. max_len - 1
        and written in place, no Python number that changes per token (`kv_quantizable` mixers also take
        `kv_format=`). None: this mixer has no static cache (decoding uses its dynamic `new_cache`, eager)."""
        return None

    def cache_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        """The bytes this layer's cache holds after `context_len` (>= 0) tokens of `batch` sequences computed in
        `dtype`, analytically: equal to the cache's measured `nbytes()` after a real prefill of that length
        (tests/test_mixers_contract.py; docs/attention.md, "Cache bytes"). It grows with the context for a KV
        cache, is bounded by the window for a sliding window and constant for a recurrent state, plus the short
        conv's K-1 tail. `kv_quantizable` mixers take `kv_format=`. Nothing is refused."""
        raise NotImplementedError

    def decode_read_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        """The cache bytes one decode step reads at context `context_len` (the memory side of its decode rate:
        attnzoo-bench decode's bytes per token). Default: everything the cache holds (`cache_bytes`); a mixer
        whose step reads a part only (NSA / MoBA: their selected blocks) says so."""
        return self.cache_bytes(context_len, batch, dtype)

    def flops_per_token(self, context_len: int) -> float:
        """Forward FLOPs per token at context L = `context_len` (>= 1), averaged over positions 1..L, by the
        project's convention (docs/attention.md, "FLOPs per token"): 2 per multiply-add, every projection, the
        keys a query attends on average ((L + 1) / 2 causal, min(W, t) with a window), a chunked recurrence from
        its own algorithm; softmax, norms, elementwise gates and the delta rule's triangular inverse not counted.
        Training is 3x this. Checked against FlopCounterMode on the reference forms (tests/test_flops_exact.py)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ what other parts ask the class
    def dispatch_family(self) -> str:
        """The kernel family of this built layer (ops/dispatch.py): `kernel_family`, narrowed to "other" by a
        subclass where the fast kernel does not cover this layer's settings."""
        return self.kernel_family

    @classmethod
    def check_seq_len(cls, cfg: Any, seq_len: int, field: str) -> None:
        """Refuse (one-line ConfigError naming `field`.<key>) a mixer config `cfg` that cannot train on
        sequences of `seq_len` tokens (data.seq_len); `field` is the layer's mixer path. Default: any length."""

    @classmethod
    def linearize_sizes(cls, n_heads: int, head_dim: int) -> dict:
        """(linearize_target mixers) this mixer's config keys that size it like an attention layer of
        `n_heads` heads of `head_dim`, so its q/k/v/o take the attention's projections."""
        raise NotImplementedError(f"{cls.__name__} is not a linearize target")

    @classmethod
    def hf_mixer_config(cls, c: dict, **options: Any) -> dict:
        """(hf_layer mixers) the attnzoo mixer section equivalent to the layer a transformers config.json `c`
        describes; `options`: what the architecture decides for the layer (e.g. qkv_bias, window)."""
        raise NotImplementedError(f"{cls.__name__} has no transformers counterpart")


# transformers decoder-layer kinds (`Mixer.hf_layer`), in transformers' own `layer_types` words where it has them
HF_FULL_ATTENTION = "full_attention"  # Llama, Qwen2 / Qwen3 (-MoE), Mixtral; Qwen3-Next's attention layers
HF_SLIDING_ATTENTION = "sliding_attention"  # Mistral (and Mixtral) with a window
HF_LINEAR_ATTENTION = "linear_attention"  # Qwen3-Next's Gated DeltaNet layers
HF_LATENT_ATTENTION = "latent_attention"  # DeepSeek-V3's MLA, Kimi Linear's NoPE MLA (no layer type word of its own)
HF_SPARSE_LATENT_ATTENTION = "indexed_attention"  # DeepSeek-V3.2's DSA (MLA + lightning indexer), its layer_types word
# Kimi Linear's KDA layers: its checkpoints' own word (config.json linear_attn_config.kda_layers); its layer_types
# says linear_attention for them (as Qwen3-Next for GDN) and full_attention for its MLA layers (HF_LATENT_ATTENTION)
HF_KIMI_DELTA_ATTENTION = "kda"
HF_LAYERS = (HF_FULL_ATTENTION, HF_SLIDING_ATTENTION, HF_LINEAR_ATTENTION, HF_LATENT_ATTENTION,
             HF_SPARSE_LATENT_ATTENTION, HF_KIMI_DELTA_ATTENTION)
HF_WINDOW_FIELD = "sliding_window"  # config.json's window size (Mistral, Mixtral; null in Qwen2 / Qwen3)


from attnzoo.mixers.configs import validate_conv  # noqa: E402,F401 (torch-free; re-exported for the mixers)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def causal_attended(context_len: int, window: Optional[int] = None) -> float:
    """Average number of keys a query attends over positions 1..L (causal; min(W, t) with a window)."""
    L = context_len
    if window is None or window >= L:
        return (L + 1) / 2.0
    W = window
    # sum_{t=1}^{L} min(W, t) = W(W+1)/2 + (L - W) W
    return (W * (W + 1) / 2.0 + (L - W) * W) / L
