"""`data=needle`: needle in a haystack as a token task a small model is trained on (issue 48 item 3), the token-level
form of RULER's NIAH (Hsieh et al. 2024; data/needles.py has the text form for any checkpoint), as MQAR is the
token-level form of associative recall. One example of length L:

    n n n n [NEEDLE k1 k2 v1 v2] n n n n ... n n [NEEDLE k1' k2' v1' v2'] n n | QUERY k1 k2 v1 v2
                                                                                    ^ answer v1 ^ v2

`n`: noise tokens, drawn from the upper half of the vocabulary; keys and values from the lower half (above the two
markers: token 0 = NEEDLE, token 1 = QUERY). `num_needles` needles with distinct keys are hidden in the haystack
(the first `L - 1 - key_len - value_len` tokens); the asked one (the first drawn) starts after `depth` of the
haystack's noise tokens (`data.depth`; null: uniform per example), the others at uniform random offsets (RULER's
multi-key distractors). The model must emit the asked needle's value tokens after the query's key: those
`value_len` positions are the loss and `val/acc` (per answer token). Evaluated at longer lengths by
`eval.context_lengths` (the task regenerated at each length) and per (length, depth) by `attnzoo-eval RUN --task
niah` (inference/niah.py, the depth x length heatmap).
"""
from __future__ import annotations

import numpy as np

from attnzoo.data import register_data
from attnzoo.data.configs import NEEDLE_SPECIALS, NeedleConfig, needle_tokens  # noqa: F401 (torch-free: config checks)
from attnzoo.data.synthetic import SyntheticDataModule

NEEDLE, QUERY = 0, 1


def generate_needle(cfg, n: int, rng: np.random.Generator):
    """(x, y, mask) for `n` examples; see the module docstring."""
    L, V, K, M, N = cfg.seq_len, cfg.vocab_size, cfg.key_len, cfg.value_len, cfg.num_needles
    kv_hi = NEEDLE_SPECIALS + (V - NEEDLE_SPECIALS) // 2  # keys / values in [2, kv_hi), noise in [kv_hi, V)
    T = needle_tokens(cfg)
    H = L - (1 + K + M)  # the haystack with its needles
    noise_len = H - N * T
    x = rng.integers(kv_hi, V, size=(n, L))
    y = np.zeros((n, L), dtype=np.int64)
    mask = np.zeros((n, L), dtype=bool)
    depth = rng.random(n) if cfg.depth is None else np.full(n, float(cfg.depth))
    for i in range(n):
        keys: list = []
        while len(keys) < N:  # distinct keys (whole tuples)
            k = tuple(rng.integers(NEEDLE_SPECIALS, kv_hi, size=K))
            if k not in keys:
                keys.append(k)
        values = rng.integers(NEEDLE_SPECIALS, kv_hi, size=(N, M))
        # noise offsets before each needle: the asked one's from its depth, the others uniform; in order of offset
        offsets = [int(round(depth[i] * noise_len))] + list(rng.integers(0, noise_len + 1, size=N - 1))
        order = sorted(range(N), key=lambda j: (offsets[j], j))
        hay = list(x[i, :noise_len])
        for placed, j in enumerate(order):  # inserted left to right: each shifts the later ones by T
            at = offsets[j] + placed * T
            hay[at:at] = [NEEDLE, *keys[j], *values[j]]
        q = [QUERY, *keys[0], *values[0]]
        x[i] = hay + q
        answer = np.arange(H + K, H + K + M)  # the query's last key token, then each value token but the last
        y[i, answer] = values[0]
        mask[i, answer] = True
    return x, y, mask


@register_data("needle", NeedleConfig)
class NeedleDataModule(SyntheticDataModule):
    generate = staticmethod(generate_needle)

    def task_info(self, cfg) -> dict:
        return {"seq_len": cfg.seq_len, "key_len": cfg.key_len, "value_len": cfg.value_len,
                "num_needles": cfg.num_needles, "depth": cfg.depth}
