"""The table of docs/benchmarks.md "FLOPs convention": each chunked mixer's FlopCounterMode count of its training
forward and of its no_grad forward, over the shared analytic figure (flops_per_token(T) * T), at T = 20 (not a multiple of
a chunk of 8) and T = 40 (whole chunks or one chunk). The delta-rule family's inverse, which the counter cannot see, is
added to the training count as tests/test_flops_exact.py adds it.

    .venv/bin/python scripts/flops_convention_table.py
"""
import torch, sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from tests.test_flops_exact import RECURRENT, mixer_of, counter, _inputs
print("| mixer (config) | chunk | T | training forward / shared figure | no_grad forward (counter-visible) / shared figure |")
print("|---|---|---|---|---|")
for name in RECURRENT:
    for L in (20, 40):
        m, mixer = mixer_of(RECURRENT[name])
        C = min(mixer.chunk_size, L); pad = -L % C
        delta = "delta" in name or name.startswith("rwkv7")
        c = {}
        for grad in (True, False):
            with torch.set_grad_enabled(grad), counter() as fc:
                mixer(_inputs(m, L, requires_grad=grad), positions=torch.arange(L))
            c[grad] = fc.get_total_flops()
        tr = c[True] + (mixer.n_v_heads * C * C / 3 * (L + pad) if delta else 0)
        shared = mixer.flops_per_token(L) * L
        print(f"| {name} | {mixer.chunk_size} | {L} | {tr / shared:.4f} | {c[False] / shared:.4f} |")
