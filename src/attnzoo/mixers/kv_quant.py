"""KV-cache formats at inference: bf16 storage, and KIVI's asymmetric int8 / int4 quantization (Liu et al.
2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", arXiv:2402.02750).

`inference.kv_cache_dtype` (`KVFormat.dtype`):
  fp32        the plain `KVCache`: keys/values as computed (the format changes nothing; the default)
  bf16        keys/values stored in bf16 (`BF16KVCache`), read back in the compute dtype
  int8, int4  `QuantizedKVCache`, b = 8 or 4 bit codes (uint8; int4 packs two per byte along head_dim:
              channel 2i in the low nibble, 2i+1 in the high one), each group with an fp16 scale `s` and
              zero `z`, x ~ x_hat = q * s + z, q in [0, 2^b - 1]:
                keys    per channel: one (s, z) per (head, channel) over each group of G consecutive tokens
                        (KIVI sec. 3: key outliers sit in fixed channels)
                values  per token: one (s, z) per (head, token) over each group of G channels (the last of
                        the ceil(D/G) groups is shorter when G does not divide head_dim D)
              residual window: after n tokens the first n_q(n) = G * floor(max(0, n - R) / G) are held
              quantized, the other n - n_q(n) (between min(n, R) and R + G - 1) in the compute dtype. Groups
              are tokens [jG, (j+1)G) counted from position 0; group j is quantized once, on the call that
              brings n to R + (j+1)G or past it (all of its tokens have left the last R), never again.

Which layers: those whose mixer class sets `kv_quantizable` (mha / gqa / mqa: a plain `KVCache`, read through
`update` only). Every other mixer keeps its own cache, bytes unchanged: sliding-window ring, MLA latents,
recurrent states.

Attention over the cache: a call's own new keys/values are used as computed; the held past is read as
stored (quantized tokens dequantized). A single prefill therefore equals the full forward exactly, and the
quantization error enters through later calls, as in KIVI (its prefill attends in full precision).

Error bound: z = the group's min rounded down to fp16, s = (max - z) / (2^b - 1) rounded up to fp16 (at least
2^-24). Every x of the group then has (x - z) / s in [0, 2^b - 1], so round() needs no clamping and
|x - x_hat| <= s / 2 (plus the compute dtype's rounding of q * s + z): s ~ range / 255 for int8, range / 15
for int4. Values beyond fp16's range (|x| > 65504) are not representable as scale/zero (inf).

Bytes per layer after n tokens, batch B, n_g KV heads, head dim D, n_q = n_q(n), element size e of the
compute dtype (`kv_bytes`):
  fp32      2 * B * n_g * n * D * e
  bf16      2 * B * n_g * n * D * 2
  int8/int4 B * n_g * [2 * n_q * D * b / 8            codes, keys and values
                       + 4 * (n_q / G) * D            key scale + zero (fp16), per channel per group
                       + 4 * n_q * ceil(D / G)        value scale + zero (fp16), per token per group
                       + 2 * (n - n_q) * D * e]       the full-precision window
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from attnzoo.layers.kv_cache import LayerCache
from attnzoo.mixers.attention_cache import KVCache
from attnzoo.mixers.kv_format import (CONFIG_FIELDS, KV_CACHE_DTYPES, KVFormat, coverage, format_kwargs,  # noqa: F401
                                      quantized_names, quantizes)

SCALE_DTYPE = torch.float16  # KIVI's choice: 2 bytes per scale and per zero


# ----------------------------------------------------------------------------- caches


def _own(x: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A dense copy that owns its storage (x may be a view of the fused qkv activation or a longer window)."""
    return x.to(dtype=dtype or x.dtype, memory_format=torch.contiguous_format, copy=True)


class BF16KVCache(KVCache):
    """`KVCache` holding bf16 keys/values: k, v (B, n_kv_heads, T, head_dim), read back in the compute dtype."""

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        past_k, past_v = self.k, self.v
        new_k, new_v = _own(k, torch.bfloat16), _own(v, torch.bfloat16)
        self.k = new_k if past_k is None else torch.cat([past_k, new_k], dim=2)
        self.v = new_v if past_v is None else torch.cat([past_v, new_v], dim=2)
        if past_k is None:
            return k, v
        return torch.cat([past_k.to(k.dtype), k], dim=2), torch.cat([past_v.to(v.dtype), v], dim=2)


class QuantizedKVCache(KVCache):
    """KIVI int8 / int4 keys and values (module docstring), batch-first like every cache:

      k_codes, v_codes   (B, n_kv_heads, n_q, D * b / 8) uint8
      k_scale, k_zero    (B, n_kv_heads, n_q / G, D) fp16         keys: per channel, per group of G tokens
      v_scale, v_zero    (B, n_kv_heads, n_q, ceil(D / G)) fp16   values: per token, per group of G channels
      k, v               (B, n_kv_heads, n - n_q, D)              the full-precision window (compute dtype)
    """

    def __init__(self, fmt: KVFormat) -> None:
        super().__init__()
        self.fmt = fmt
        self.k_codes = self.k_scale = self.k_zero = None
        self.v_codes = self.v_scale = self.v_zero = None

    @property
    def n_quantized(self) -> int:
        return 0 if self.k_codes is None else self.k_codes.shape[2]

    @property
    def seq_len(self) -> int:
        return self.n_quantized + (0 if self.k is None else self.k.shape[2])

    def held(self, dtype: torch.dtype) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Every held key/value oldest first, in `dtype`: the dequantized tokens, then the window."""
        if self.k is None:
            return None, None
        if self.k_codes is None:
            return self.k, self.v
        G, b, D = self.fmt.group_size, self.fmt.bits, self.k.shape[-1]
        k = dequantize(unpack(self.k_codes, b, D), self.k_scale, self.k_zero, axis=2, group=G, dtype=dtype)
        v = dequantize(unpack(self.v_codes, b, D), self.v_scale, self.v_zero, axis=3, group=G, dtype=dtype)
        return torch.cat([k, self.k.to(dtype)], dim=2), torch.cat([v, self.v.to(dtype)], dim=2)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new (B, Hkv, t, D) keys/values; return the held past (as stored) followed by the new ones
        (as computed). Whole groups that have left the last R tokens are quantized here."""
        past_k, past_v = self.held(k.dtype)
        win_k = _own(k) if self.k is None else torch.cat([self.k, k], dim=2)
        win_v = _own(v) if self.v is None else torch.cat([self.v, v], dim=2)
        m = self.fmt.n_quantized(self.n_quantized + win_k.shape[2]) - self.n_quantized  # a multiple of G
        if m > 0:
            G, b = self.fmt.group_size, self.fmt.bits
            kq, ks, kz = quantize(win_k[:, :, :m], axis=2, group=G, bits=b)  # keys: per channel, G tokens
            vq, vs, vz = quantize(win_v[:, :, :m], axis=3, group=G, bits=b)  # values: per token, G channels
            first = self.k_codes is None
            grow = lambda old, new: new if first else torch.cat([old, new], dim=2)  # noqa: E731
            self.k_codes, self.k_scale, self.k_zero = grow(self.k_codes, pack(kq, b)), grow(self.k_scale, ks), grow(self.k_zero, kz)
            self.v_codes, self.v_scale, self.v_zero = grow(self.v_codes, pack(vq, b)), grow(self.v_scale, vs), grow(self.v_zero, vz)
            win_k, win_v = _own(win_k[:, :, m:]), _own(win_v[:, :, m:])  # not a view pinning the quantized part
        self.k, self.v = win_k, win_v
        if past_k is None:
            return k, v
        return torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)


class StaticQuantizedKVCache(LayerCache):
    """The static form of `QuantizedKVCache` (layers/kv_cache.py: allocated once, written in place, positions as
    tensors), for positions 0 .. S - 1:

      k_codes, v_codes   (B, n_kv_heads, S, D * b / 8) uint8     slot s: position s, once quantized
      k_scale, k_zero    (B, n_kv_heads, ceil(S / G), D) fp16
      v_scale, v_zero    (B, n_kv_heads, S, ceil(D / G)) fp16
      k, v               (B, n_kv_heads, R + G, D)               the full-precision window: a ring, position p in
                                                                slot p % (R + G) (it never holds more)

    A one-token step writes its token into the ring and quantizes group j from the ring when the step brings the
    row's count to R + (j + 1) G (every row computes its group; only the rows it is due for write it), so each
    group is quantized once, from the same full-precision values, as `QuantizedKVCache` does. A prefill (every row
    from position 0) quantizes its whole groups at once; after it, one token at a time (`chunks` False)."""

    static = True
    ring = False  # every position has a slot; Attention.attend_static reads them under the position mask
    chunks = False  # the window holds R + G tokens: a longer chunk after the prefill would overwrite what it reads
    lossy = False  # a step's own token is read from the window, as computed (keys(): n_q of the tokens before it)

    def __init__(self, fmt: KVFormat, batch: int, n_kv_heads: int, slots: int, head_dim: int, dtype: torch.dtype,
                 device, conv_tail: Optional[torch.Tensor] = None) -> None:
        self.fmt = fmt
        G, b = fmt.group_size, fmt.bits
        zeros = lambda *shape, dt=SCALE_DTYPE: torch.zeros(batch, n_kv_heads, *shape, dtype=dt, device=device)  # noqa: E731
        self.k_codes = zeros(slots, head_dim * b // 8, dt=torch.uint8)
        self.v_codes = zeros(slots, head_dim * b // 8, dt=torch.uint8)
        self.k_scale, self.k_zero = zeros(-(-slots // G), head_dim), zeros(-(-slots // G), head_dim)
        self.v_scale, self.v_zero = zeros(slots, -(-head_dim // G)), zeros(slots, -(-head_dim // G))
        self.k = zeros(fmt.residual + G, head_dim, dt=dtype)
        self.v = zeros(fmt.residual + G, head_dim, dt=dtype)
        self.conv_tail = conv_tail

    def write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """New keys/values (B, Hkv, T, D) at `positions` (B, T)."""
        T, G, b, W = k.shape[2], self.fmt.group_size, self.fmt.bits, self.k.shape[2]
        if T > 1 and int(positions[:, 0].max()) == 0:  # a prefill: its whole groups at once
            n_q = self.fmt.n_quantized(T)
            if n_q:
                kq, ks, kz = quantize(k[:, :, :n_q], axis=2, group=G, bits=b)
                vq, vs, vz = quantize(v[:, :, :n_q], axis=3, group=G, bits=b)
                self.k_codes[:, :, :n_q], self.k_scale[:, :, :n_q // G], self.k_zero[:, :, :n_q // G] = pack(kq, b), ks, kz
                self.v_codes[:, :, :n_q], self.v_scale[:, :, :n_q], self.v_zero[:, :, :n_q] = pack(vq, b), vs, vz
            slot = torch.arange(n_q, T, device=k.device) % W
            self.k[:, :, slot], self.v[:, :, slot] = k[:, :, n_q:].to(self.k.dtype), v[:, :, n_q:].to(self.v.dtype)
            return
        rows = torch.arange(k.shape[0], device=k.device)
        p = positions[:, 0]
        self.k[rows, :, p % W], self.v[rows, :, p % W] = k[:, :, 0].to(self.k.dtype), v[:, :, 0].to(self.v.dtype)
        n, R = p + 1, self.fmt.residual
        due = (n >= R + G) & ((n - R) % G == 0)  # (B,): group j leaves the window with this token
        j = ((n - R) // G - 1).clamp(min=0)
        toks = (j[:, None] * G + torch.arange(G, device=k.device)).clamp(max=self.k_codes.shape[2] - 1)  # (B, G)
        rr = rows[:, None]
        gk, gv = self.k[rr, :, toks % W].transpose(1, 2), self.v[rr, :, toks % W].transpose(1, 2)  # (B, Hkv, G, D)
        kq, ks, kz = quantize(gk, axis=2, group=G, bits=b)
        vq, vs, vz = quantize(gv, axis=3, group=G, bits=b)
        def put(buf: torch.Tensor, idx: tuple, new: torch.Tensor) -> None:  # where due, else as it was
            buf[idx] = torch.where(due.view(-1, *[1] * (new.dim() - 1)), new, buf[idx])

        put(self.k_codes, (rr, slice(None), toks), pack(kq, b).transpose(1, 2))
        put(self.v_codes, (rr, slice(None), toks), pack(vq, b).transpose(1, 2))
        put(self.v_scale, (rr, slice(None), toks), vs.transpose(1, 2))
        put(self.v_zero, (rr, slice(None), toks), vz.transpose(1, 2))
        jj = j.clamp(max=self.k_scale.shape[2] - 1)
        put(self.k_scale, (rows, slice(None), jj), ks[:, :, 0])
        put(self.k_zero, (rows, slice(None), jj), kz[:, :, 0])

    def keys(self, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, values, key_positions (B, S)) for a token at `last` (B,): slot s dequantized where position s was
        held quantized before this token (s < n_q(last), as `QuantizedKVCache` reads the past before its update),
        else the window's copy (slots past `last`: masked)."""
        G, b, D, W = self.fmt.group_size, self.fmt.bits, self.k.shape[3], self.k.shape[2]
        S = self.k_codes.shape[2]
        slot = torch.arange(S, device=last.device)
        n_q = G * ((last - self.fmt.residual).clamp(min=0) // G)
        quantized = (slot < n_q[:, None])[:, None, :, None]
        k = dequantize(unpack(self.k_codes, b, D), self.k_scale, self.k_zero, axis=2, group=G, dtype=self.k.dtype)
        v = dequantize(unpack(self.v_codes, b, D), self.v_scale, self.v_zero, axis=3, group=G, dtype=self.v.dtype)
        return (torch.where(quantized, k, self.k[:, :, slot % W]), torch.where(quantized, v, self.v[:, :, slot % W]),
                slot.expand(last.shape[0], S))

    def filled_bytes(self, lengths: torch.Tensor) -> int:
        """Per row: `KVFormat.kv_bytes` of its length (codes, scales, the full-precision window) and the conv tail."""
        _, H, _, D = self.k.shape
        tail = 0 if self.conv_tail is None else self.conv_tail.numel() * self.conv_tail.element_size()
        return sum(self.fmt.kv_bytes(int(n), 1, H, D, self.k.dtype) for n in lengths) + tail


# ----------------------------------------------------------------------------- quantization


def _fp16_toward(x: torch.Tensor, direction: float) -> torch.Tensor:
    """x in fp16, rounded toward -inf (direction < 0) or +inf (> 0) instead of to nearest."""
    h = x.to(SCALE_DTYPE)
    wrong = h.to(x.dtype) > x if direction < 0 else h.to(x.dtype) < x
    return torch.where(wrong, torch.nextafter(h, torch.full_like(h, math.copysign(math.inf, direction))), h)


def _expand(t: torch.Tensor, group: int, n: int) -> torch.Tensor:
    """Per-group values along the last dim -> per-element (each repeated `group` times, cut to n)."""
    return t.repeat_interleave(group, dim=-1)[..., :n]


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # at least fp32 (fp64 stays fp64)


def quantize(x: torch.Tensor, *, axis: int, group: int, bits: int):
    """Asymmetric `bits`-bit codes of x over groups of `group` consecutive elements along `axis` (the last
    group may be shorter). Returns (codes uint8 shaped like x, scale, zero fp16 shaped like x with
    ceil(n / group) along `axis`), with zero <= min and scale * (2^bits - 1) >= max - zero in every group."""
    xt = x.movedim(axis, -1).to(_work_dtype(x.dtype))
    n = xt.shape[-1]
    n_groups = -(-n // group)
    pad = n_groups * group - n
    lo = F.pad(xt, (0, pad), value=math.inf).unflatten(-1, (n_groups, group)).amin(-1)
    hi = F.pad(xt, (0, pad), value=-math.inf).unflatten(-1, (n_groups, group)).amax(-1)
    zero = _fp16_toward(lo, -1.0)
    scale = _fp16_toward((hi - zero.to(hi.dtype)) / (2**bits - 1), 1.0).clamp_min(2.0**-24)
    s, z = _expand(scale, group, n).to(xt.dtype), _expand(zero, group, n).to(xt.dtype)
    codes = torch.round((xt - z) / s).clamp_(0, 2**bits - 1).to(torch.uint8)
    back = lambda t: t.movedim(-1, axis).contiguous()  # noqa: E731
    return back(codes), back(scale), back(zero)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, *, axis: int, group: int,
               dtype: torch.dtype) -> torch.Tensor:
    """x_hat = codes * scale + zero (the inverse layout of `quantize`), computed in >= fp32, returned in dtype."""
    work = _work_dtype(dtype)
    ct = codes.movedim(axis, -1)
    n = ct.shape[-1]
    s = _expand(scale.movedim(axis, -1), group, n).to(work)
    z = _expand(zero.movedim(axis, -1), group, n).to(work)
    return (ct.to(work) * s + z).to(dtype).movedim(-1, axis)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int4: two codes per byte along the last dim (even channel low nibble, odd channel high nibble)."""
    return codes if bits == 8 else codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    if bits == 8:
        return packed
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)[..., :n]


# ----------------------------------------------------------------------------- teacher forcing through a cache


def decode_calls(length: int, kv_format: Optional[KVFormat]) -> list[tuple[int, int]]:
    """(start, end) of the calls that feed `length` teacher-forced tokens through a cache so that every token
    sees the cache exactly as one-token-at-a-time decoding would. int8/int4: n_q(n) changes only at
    n = R + jG, so one call of R + G tokens, then calls of G. bf16: every past token is read as bf16, so one
    token per call. fp32 (or none): one call (equal to the full forward; tests/test_mixers_contract.py)."""
    if kv_format is None or kv_format.dtype == "fp32":
        return [(0, length)]
    if kv_format.dtype == "bf16":
        return [(t, t + 1) for t in range(length)]
    first, G = kv_format.residual + kv_format.group_size, kv_format.group_size
    starts = [0, *range(first, length, G)]
    return [(s, min(e, length)) for s, e in zip(starts, starts[1:] + [length]) if s < length]


@torch.no_grad()
def logits_through_cache(model, idx: torch.Tensor, kv_format: Optional[KVFormat]) -> torch.Tensor:
    """Teacher-forced logits (B, T, V) of a decoder LM computed through a fresh cache in `kv_format`
    (`decode_calls`): later tokens attend to the past keys/values as the cache stores them."""
    cache = model.new_cache(idx.shape[0], idx.shape[1], kv_format=kv_format)
    return torch.cat([model(idx[:, s:e], cache=cache) for s, e in decode_calls(idx.shape[1], kv_format)], dim=1)
