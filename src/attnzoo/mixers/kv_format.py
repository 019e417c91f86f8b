"""The KV-cache format of `inference.kv_cache_dtype` / `kv_group_size` / `kv_residual` (`KVFormat`), its checks and
what it changes in a model (`coverage`), torch-free: the config checks read them before torch is imported (issue 45).
The caches that store keys and values in a format are in mixers/kv_quant.py (its docstring: the formats, the error
bound, the bytes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from attnzoo.config.errors import ConfigError
from attnzoo.config.registry import MIXERS

if TYPE_CHECKING:
    import torch

    from attnzoo.layers.kv_cache import LayerCache
    from attnzoo.mixers.attention_cache import KVCache


KV_CACHE_DTYPES = ("fp32", "bf16", "int8", "int4")
CONFIG_FIELDS = ("inference.kv_cache_dtype", "inference.kv_group_size", "inference.kv_residual")


@dataclass(frozen=True)
class KVFormat:
    """How the kv_quantizable layers (mha / gqa / mqa) store keys and values at inference (module docstring)."""

    dtype: str = "fp32"  # fp32 | bf16 | int8 | int4
    group_size: int = 32  # G: tokens per key group, channels per value group
    residual: int = 32  # R: the most recent R tokens (up to R + G - 1) stay in the compute dtype

    @classmethod
    def of(cls, inference) -> "KVFormat":
        """The format an `inference` config section (config.InferenceConfig) asks for."""
        return cls(inference.kv_cache_dtype, inference.kv_group_size, inference.kv_residual)

    @property
    def bits(self) -> Optional[int]:
        return {"int8": 8, "int4": 4}.get(self.dtype)

    def check(self, head_dims=(), fields=CONFIG_FIELDS) -> "KVFormat":
        """Raise a one-line ConfigError naming the field (`fields`: dtype, group size, residual) and what is
        allowed; `head_dims`: those of the layers it will quantize (int4 packs pairs of channels)."""
        f_dtype, f_group, f_res = fields
        if self.dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"got {self.dtype!r}; allowed: {', '.join(KV_CACHE_DTYPES)}", field=f_dtype)
        if self.group_size <= 0:
            raise ConfigError(f"must be >= 1 (tokens per key scale, channels per value scale), got {self.group_size}",
                              field=f_group)
        if self.residual < 0:
            raise ConfigError(f"must be >= 0 (full-precision recent tokens), got {self.residual}", field=f_res)
        odd = sorted({d for d in head_dims if d % 2})
        if self.dtype == "int4" and odd:
            raise ConfigError(f"int4 packs two channels per byte, but head_dim={odd[0]} is odd; allowed: int8, bf16, "
                              f"fp32, or an even model.head_dim", field=f_dtype)
        return self

    def n_quantized(self, n: int) -> int:
        """Tokens held quantized after n tokens: whole groups of G that have left the last R tokens."""
        if self.bits is None:
            return 0
        G = self.group_size
        return G * (max(0, n - self.residual) // G)

    def new_cache(self) -> "KVCache":
        from attnzoo.mixers.attention_cache import KVCache
        from attnzoo.mixers.kv_quant import BF16KVCache, QuantizedKVCache

        if self.dtype == "bf16":
            return BF16KVCache()
        if self.bits is not None:
            return QuantizedKVCache(self)
        return KVCache()

    def new_static_cache(self, batch: int, n_kv_heads: int, slots: int, head_dim: int, dtype: torch.dtype, device,
                         conv_tail: Optional[torch.Tensor] = None) -> LayerCache:
        """The static form (attnzoo.models.decoding) of positions 0 .. slots - 1: bf16 slots, or KIVI's codes."""
        import torch

        from attnzoo.mixers.attention_cache import StaticKVCache
        from attnzoo.mixers.kv_quant import StaticQuantizedKVCache

        if self.bits is not None:
            return StaticQuantizedKVCache(self, batch, n_kv_heads, slots, head_dim, dtype, device, conv_tail)
        store = torch.bfloat16 if self.dtype == "bf16" else dtype
        return StaticKVCache(batch, n_kv_heads, slots, head_dim, store, device, conv_tail=conv_tail,
                             lossy=self.dtype == "bf16")

    def kv_bytes(self, context_len: int, batch: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Analytic bytes of one layer's keys and values after `context_len` tokens (module docstring);
        `dtype`: the compute dtype (the fp32 format and the full-precision window hold that)."""
        from attnzoo.mixers.base import dtype_bytes
        from attnzoo.mixers.kv_quant import SCALE_DTYPE

        rows, n, D = batch * n_kv_heads, context_len, head_dim
        if self.bits is None:
            return 2 * rows * n * D * (2 if self.dtype == "bf16" else dtype_bytes(dtype))
        G, n_q = self.group_size, self.n_quantized(n)
        codes = 2 * n_q * D * self.bits // 8
        scales = 2 * dtype_bytes(SCALE_DTYPE) * ((n_q // G) * D + n_q * math.ceil(D / G))
        window = 2 * (n - n_q) * D * dtype_bytes(dtype)
        return rows * (codes + scales + window)


def quantizes(mixer) -> bool:
    """Whether `mixer`'s cache takes a KV format (its class is `kv_quantizable`)."""
    return mixer.kv_quantizable


def quantized_names() -> list[str]:
    """The registered mixers whose caches a KV format stores (sorted)."""
    return [n for n in MIXERS.names() if MIXERS.get(n).fact("kv_quantizable")]


def format_kwargs(mixer, kv_format: Optional[KVFormat]) -> dict:
    """`new_cache` / `cache_bytes` keyword arguments for one layer: the format where it applies."""
    return {"kv_format": kv_format} if kv_format is not None and quantizes(mixer) else {}


def coverage(fmt: KVFormat, layer_mixers: list[str], seq_len: Optional[int], fields=CONFIG_FIELDS,
             seq_field: str = "data.seq_len") -> str:
    """What `fmt` changes in a model whose layers have the mixers `layer_mixers`, evaluated on `seq_len`-token
    sequences (None: any length, as in generation), in words ('' for fp32): which layers it stores and which
    keep their own caches, and (int8 / int4) how many tokens are held quantized at the end of a sequence. A
    one-line ConfigError where it would change nothing, so no run reports a "+0.0000" cost of a format that
    was never applied: no kv_quantizable layer, or a full-precision window R + G that covers the whole
    sequence (the first group is quantized once R + G tokens are held; only tokens after it read it back)."""
    if fmt.dtype == "fp32":
        return ""
    f_dtype, f_group, f_res = fields
    n = len(layer_mixers)
    quantized = [i for i, name in enumerate(layer_mixers) if MIXERS.get(name).fact("kv_quantizable")]
    kept = sorted({layer_mixers[i] for i in range(n) if i not in quantized})
    if not quantized:
        names = " / ".join(quantized_names())
        raise ConfigError(f"{fmt.dtype} stores the KV caches of {names} layers, and none of this model's {n} layers "
                          f"is one ({', '.join(kept)}: own caches, unchanged); allowed: fp32, or a model with a "
                          f"{names} layer", field=f_dtype)
    R, G = fmt.residual, fmt.group_size
    if fmt.bits is not None and seq_len is not None and seq_len <= R + G:
        raise ConfigError(f"{R} full-precision tokens (+ a group of {G}) cover the whole {seq_len}-token sequence "
                          f"({seq_field}): no token would read a quantized key or value; allowed: "
                          f"{f_res.rsplit('.', 1)[-1].lstrip('-')} + {f_group.rsplit('.', 1)[-1].lstrip('-')} "
                          f"< {seq_len}", field=f_res)
    kinds = "/".join(sorted({layer_mixers[i] for i in quantized}))
    where = f"all {n} layers ({kinds})" if len(quantized) == n else (
        f"layers {','.join(map(str, quantized))} of {n} ({kinds}); not quantized: "
        f"{','.join(str(i) for i in range(n) if i not in quantized)} ({', '.join(kept)}: own caches)")
    if fmt.bits is None or seq_len is None:
        return f"{fmt.dtype} keys/values in {where}"
    n_q = fmt.n_quantized(seq_len)
    return (f"{fmt.dtype} keys/values in {where}; at {seq_len} tokens the first {n_q} held quantized, the last "
            f"{seq_len - n_q} in full precision")
