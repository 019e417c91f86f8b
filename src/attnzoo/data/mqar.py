"""`data=mqar`: multi-query associative recall (Arora et al. 2023, Zoology, arXiv:2312.04927),
generated as `zoology/data/multiquery_ar.py` does; and `data=noisy_ar`: recall with noise tokens.

mqar, one example of length L with N pairs (keys k_i from [1, V/2), values v_i from [V/2, V)):

    k_1 v_1 k_2 v_2 ... k_N v_N | f f k_3 f f f k_1 f ...        (f: random filler tokens from [0, V))
                                       ^ answer v_3  ^ answer v_1

Each key is queried once, at query-region offset 2·g, where the gaps g are N distinct draws from
[0, (L - 2N)/2) with P(g) ∝ (g + 1)^(a - 1) (a = 0.01: most queries come soon after the pairs). The model
must emit v_i at the query position of k_i; only those N positions count in the loss and `val/acc`.
"""
from __future__ import annotations


import numpy as np

from attnzoo.data import register_data
from attnzoo.data.synthetic import SyntheticDataModule, log, sample_distinct, sample_weighted_distinct
from attnzoo.data.configs import MQARConfig, NoisyARConfig, effective_pairs, noise_tokens  # noqa: F401 (torch-free: config checks)


def generate_mqar(cfg, n: int, rng: np.random.Generator):
    """(x, y, mask) for `n` MQAR examples; see the module docstring. N = effective_pairs(cfg)."""
    L, V, N = cfg.seq_len, cfg.vocab_size, effective_pairs(cfg)
    ctx = 2 * N
    keys = sample_distinct(rng, n, 1, V // 2, N)
    values = sample_distinct(rng, n, V // 2, V, N)
    x = np.zeros((n, L), dtype=np.int64)
    x[:, 0:ctx:2], x[:, 1:ctx:2] = keys, values
    space = (L - ctx) // 2  # query slots: even offsets of the query region
    g = np.arange(1, space + 1, dtype=np.float64)
    gaps = sample_weighted_distinct(rng, n, np.log(cfg.power_a) + (cfg.power_a - 1) * np.log(g), N)
    qpos = ctx + 2 * gaps  # (n, N): key i is queried at qpos[:, i]
    rows = np.arange(n)[:, None]
    x[rows, qpos] = keys
    y = np.zeros_like(x)
    y[rows, qpos] = values
    mask = np.zeros(x.shape, dtype=bool)
    mask[rows, qpos] = True
    if cfg.random_non_queries:
        # Fillers never repeat one of the example's keys: a filler copy of key k before k's query makes
        # "the token after k" ambiguous. Zoology draws fillers from all of [0, V): at V = 8192 a clash is
        # rare, at V = 256 it caps the reachable accuracy near 96% (docs/sweeps.md).
        fill = rng.integers(0, V, size=x.shape)
        fill[:, :ctx] = 0
        fill[mask] = 0
        clash = (fill[:, :, None] == keys[:, None, :]).any(-1)  # key tokens are >= 1, so 0 never clashes
        while clash.any():
            fill[clash] = rng.integers(0, V, size=int(clash.sum()))
            clash = (fill[:, :, None] == keys[:, None, :]).any(-1)
        filler = np.zeros(x.shape, dtype=bool)
        filler[:, ctx:] = ~mask[:, ctx:]
        x[filler] = fill[filler]
    return x, y, mask


@register_data("mqar", MQARConfig)
class MQARDataModule(SyntheticDataModule):
    generate = staticmethod(generate_mqar)

    def task_info(self, cfg) -> dict:
        n = effective_pairs(cfg)
        if n != cfg.num_kv_pairs:
            log.warning("data.num_kv_pairs=%d clipped to %d so that 4N <= seq_len=%d", cfg.num_kv_pairs, n, cfg.seq_len)
        return {"num_kv_pairs": n, "num_kv_pairs_requested": cfg.num_kv_pairs, "seq_len": cfg.seq_len,
                "power_a": cfg.power_a}


# ----------------------------------------------------------------------------- noisy_ar


def generate_noisy_ar(cfg, n: int, rng: np.random.Generator):
    L, V, N = cfg.seq_len, cfg.vocab_size, effective_pairs(cfg)
    kv_vocab, noise = V - cfg.noise_vocab, noise_tokens(cfg)
    keys = sample_distinct(rng, n, 1, kv_vocab // 2, N)
    values = sample_distinct(rng, n, kv_vocab // 2, kv_vocab, N)
    x = rng.integers(kv_vocab, V, size=(n, L))  # everything noise, then the pairs and queries are written in
    rows = np.arange(n)[:, None]
    # context: N pair items (2 tokens) and `noise` noise items (1 token) in random order
    items = N + noise
    is_pair = np.zeros((n, items), dtype=bool)
    is_pair[rows, sample_distinct(rng, n, 0, items, N)] = True
    length = np.where(is_pair, 2, 1)
    start = np.cumsum(length, axis=1) - length
    pair_start = start[is_pair].reshape(n, N)  # in context order
    x[rows, pair_start], x[rows, pair_start + 1] = keys, values
    ctx = 2 * N + noise
    qpos = ctx + sample_distinct(rng, n, 0, L - ctx, N)  # key i queried at qpos[:, i]
    x[rows, qpos] = keys
    y = np.zeros_like(x)
    y[rows, qpos] = values
    mask = np.zeros(x.shape, dtype=bool)
    mask[rows, qpos] = True
    return x, y, mask


@register_data("noisy_ar", NoisyARConfig)
class NoisyARDataModule(SyntheticDataModule):
    generate = staticmethod(generate_noisy_ar)

    def task_info(self, cfg) -> dict:
        return {"num_kv_pairs": effective_pairs(cfg), "noise_len": noise_tokens(cfg), "seq_len": cfg.seq_len}
