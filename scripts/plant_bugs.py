"""Plant bugs the tests must catch, one at a time, run the tests aimed at each on the planted tree, and
restore the file (try/finally). A bug is "caught" when at least one of those tests fails.

    .venv/bin/python scripts/plant_bugs.py            # every bug: prints, per bug, the tests that failed
    .venv/bin/python scripts/plant_bugs.py moba numpy  # only the bugs whose description contains a word

1. Gated DeltaNet drops the decay on the state carried in from the cache during a multi-token call
   (training forward and one-token decode are untouched: only chunked prefill on a non-empty cache sees it).
2. GQA's FLOPs formula is 10x too large.
3. GQA's `impl = "reference"` switch is ignored (the reference-vs-fast comparison compares a path with itself).
4. Training FLOPs counted as 2x forward instead of 3x (perf/flops_per_token and MFU off by a third).
5. The budget search rounds the width up instead of taking the closest.
6. Resume restores every random generator except numpy's.
7. MoBA's FLOPs count one key too many per position.
8. MoBA with topk = 1 counts router scores it never computes.
9. Linear attention's packed form goes back to a global prefix sum minus its value at the reset (rounding
   from an earlier document leaks into a later one).
10-15. Issue 46's mixers: FoX's gate on the diagonal, a dropped Householder step, KDA's decay per head instead of
   per channel, GDN-2's write gate broadcast over the value channels, DSA's top-k off by one, Mamba-3's chunk form
   without the trapezoid's previous-token term.
16. KDA's fla path (fla's chunk_kda under Triton's interpreter) handed the decay instead of the log-decay.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = "tests/test_mixers_contract.py"
# (what, file, text replaced, planted text, pytest arguments, a regex the failing test ids must match or None)
BUGS = [
    ("decay dropped on the carried-in state (gated_deltanet, multi-token call on a non-empty cache)",
     "src/attnzoo/ops/delta_rule.py", "        qd = q * eG\n",
     "        qd = q * eG if initial_state is None else q  # PLANTED\n", [CONTRACT, "-k", "gated_deltanet"],
     r"[\[-]gated_deltanet[-+\]]"),
    ("FLOPs 10x too large (gqa)",
     "src/attnzoo/mixers/attention.py", "        return proj + 2.0 * 2 * self.n_heads * self.head_dim * keys  # QK^T and PV\n",
     "        return 10 * (proj + 2.0 * 2 * self.n_heads * self.head_dim * keys)  # PLANTED\n", [CONTRACT, "-k", "gqa"],
     r"[\[-]gqa[-+\]]"),
    ("impl='reference' ignored (gqa)",
     "src/attnzoo/mixers/attention.py", 'q_offset=q_offset, dtype=q.dtype)\n        if self.impl == "reference":\n',
     "q_offset=q_offset, dtype=q.dtype)\n        if False:  # PLANTED: impl ignored\n", [CONTRACT, "-k", "gqa"],
     r"[\[-]gqa[-+\]]"),
    ("training FLOPs 2x forward instead of 3x (perf/flops_per_token, perf/mfu)",
     "src/attnzoo/models/flops.py", "    return 3.0 * model.flops_per_token(context_len)\n",
     "    return 2.0 * model.flops_per_token(context_len)  # PLANTED\n",
     ["tests/test_flops_exact.py", "tests/test_train_e2e.py", "-k", "three_forwards or loss_falls"], None),
    ("budget search rounds the width up instead of to the closest",
     "src/attnzoo/training/budget.py", "    best = min({max(1, lo - 1), lo}, key=lambda w: abs(f(w) - params))\n",
     "    best = lo  # PLANTED\n", ["tests/test_sweeps.py", "-k", "budget"], None),
    ("resume restores every random generator except numpy's",
     "src/attnzoo/training/lit_lm.py", '    np.random.set_state(("MT19937", nps["keys"].numpy().astype(np.uint32), nps["pos"], nps["has_gauss"], '
     'nps["cached"]))\n', "    pass  # PLANTED: numpy's state not restored\n",
     ["tests/test_resume.py", "-k", "generator"], None),
    ("MoBA's FLOPs one key per position off",
     "src/attnzoo/ops/sparse_attention.py", "        keys += min(topk - 1, blk) * block_size + p % block_size + 1\n",
     "        keys += min(topk - 1, blk) * block_size + p % block_size + 2  # PLANTED\n",
     ["tests/test_flops_exact.py", "tests/test_sparse_attention.py", "-k", "moba or flops"], None),
    ("MoBA with topk=1 counts router scores it never computes",
     "src/attnzoo/ops/sparse_attention.py", "        gate += blk if topk > 1 else 0\n", "        gate += blk  # PLANTED\n",
     ["tests/test_flops_exact.py", "-k", "moba"], None),
    ("linear attention's packed prefix sum leaks rounding across documents",
     "src/attnzoo/ops/linear_attention.py",
     '        starts = torch.einsum("bij,bhjkv->bhikv", segment.to(kv.dtype), kv)  # other segments\' chunks times exact 0\n',
     "        full = torch.cat([kv.new_zeros(B, H, 1, Dk, Dv), kv.cumsum(2)], dim=2)  # PLANTED: global prefix sum\n"
     "        starts = full - full.gather(2, last[:, None, :, None, None].expand_as(full).contiguous())\n",
     ["tests/test_packing.py", "-k", "bit_identical or equals_each_document"], None),
    # issue 46's mixers
    ("FoX's forget gate applied to the key itself (the sum from l = j instead of j + 1)",
     "src/attnzoo/ops/forgetting_attention.py", "    bias = c[..., Tk - q_len:, None] - c[..., None, :]  # (B, H, Tq, Tk)\n",
     "    bias = c[..., Tk - q_len:, None] - (c - log_f)[..., None, :]  # PLANTED\n", ["tests/test_fox.py"], None),
    ("Gated DeltaProduct drops a token's first Householder step",
     "src/attnzoo/ops/delta_product.py", "    qx = torch.zeros(B, H, T, n, Dk, dtype=q.dtype, device=q.device)\n",
     "    qx = torch.zeros(B, H, T, n, Dk, dtype=q.dtype, device=q.device)\n    beta = beta.clone()\n"
     "    beta[..., 0] = 0  # PLANTED\n", ["tests/test_deltaproduct.py"], None),
    ("KDA's decay per head where per key channel is due",
     "src/attnzoo/mixers/kda.py", "        return -self.A_log.to(f.dtype).exp()[:, None] * F.softplus(f)\n",
     "        return (-self.A_log.to(f.dtype).exp()[:, None] * F.softplus(f)).mean(-1, keepdim=True).expand_as(f)"
     "  # PLANTED\n", ["tests/test_kda.py"], None),
    ("GDN-2's write gate broadcast over the value channels (one per head)",
     "src/attnzoo/mixers/kda.py",
     "        write = torch.sigmoid(upcast(self.w_proj(x))).reshape(B, T, self.n_v_heads, self.v_dim)\n",
     "        write = torch.sigmoid(upcast(self.w_proj(x))).reshape(B, T, self.n_v_heads, self.v_dim)\n"
     "        write = write.mean(-1, keepdim=True).expand_as(write)  # PLANTED\n", ["tests/test_kda.py"], None),
    ("DSA's top-k off by one (each query keeps one key fewer)",
     "src/attnzoo/ops/dsa.py", "descending=True, stable=True).indices[..., : min(topk, S)]\n",
     "descending=True, stable=True).indices[..., : max(1, min(topk - 1, S))]  # PLANTED\n", ["tests/test_dsa.py"],
     None),
    ("Mamba-3's chunk form without the trapezoid's previous-token term",
     "src/attnzoo/ops/trapezoidal_ssd.py", "    u = gamma + F.pad(w[..., 1:], (0, 1))",
     "    u = gamma  # PLANTED", ["tests/test_mamba3.py"], None),
    # fla's own kernels, run on this CPU by Triton's interpreter (the ops process of the interpreter tier, ~1 min)
    ("KDA's fla path hands chunk_kda the decay where it takes the log-decay",
     "src/attnzoo/ops/fla_kernels.py", '                         c.seq_first(g, "k", torch.float32), c.seq_first(beta), ',
     '                         c.seq_first(g.exp(), "k", torch.float32), c.seq_first(beta), ',
     ["tests/test_fla_interpreter.py::test_interpreter_tier[test_fla_ops.py+test_fla_cli.py]"], None),
]


def main(words: list[str]) -> None:
    chosen = [b for b in BUGS if not words or any(w.lower() in b[0].lower() for w in words)]
    caught = 0
    for what, rel, old, new, args, must_match in chosen:
        path = ROOT / rel
        original = path.read_text()
        assert original.count(old) == 1, (rel, old)
        try:
            path.write_text(original.replace(old, new))
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *args],
                               capture_output=True, text=True, cwd=ROOT, timeout=1800)
        finally:
            path.write_text(original)
        failed = sorted(set(re.findall(r"FAILED (\S+)", r.stdout)))
        if must_match:
            failed = [f for f in failed if re.search(must_match, f)]
        caught += bool(failed)
        summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-300:]
        print(f"{'CAUGHT' if failed else 'MISSED'}: {what}: {len(failed)} failing tests ({summary})", flush=True)
        for f in failed[:8]:
            print(f"    {f}")
    print(f"{caught}/{len(chosen)} planted bugs caught")
    sys.exit(0 if caught == len(chosen) else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
