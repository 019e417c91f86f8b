"""Proof that the interpreter tier bites (issue 44 item 7): plant one bug at a time in ops/fla_kernels.py, run the
tests of tests/interp that should catch it under Triton's interpreter, and print a markdown table of which did.

    .venv/bin/python scripts/plant_fla_bugs.py            # ~10 minutes on 2 cores
    .venv/bin/python scripts/plant_fla_bugs.py --only scale

The file is restored after each run (also on Ctrl-C). A bug counts as caught when the tests fail (an assertion
or an error: fla refusing a wrong call is a catch too); the first failing line is shown.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "src" / "attnzoo" / "ops" / "fla_kernels.py"

# name: (what, old text, new text, the tests that should catch it)
BUGS = {
    "layout": ("heads-first passed as sequence-first (no transpose)",
               "    x = x.transpose(1, 2).to(dtype)\n", "    x = x.to(dtype)\n",
               ["tests/interp/test_fla_ops.py", "-k", "fp32 and gated_delta_rule and below"]),
    "gate-sign": ("the gated delta rule's log-decay with the wrong sign",
                  "c.seq_first(g, dtype=torch.float32), bs", "c.seq_first(-g, dtype=torch.float32), bs",
                  ["tests/interp/test_fla_ops.py", "-k", "fp32 and gated_delta_rule and below"]),
    "gate-not-log": ("GLA's per-channel gate passed as the decay e^g, not its log",
                     'chunk_gla(qs, ks, vs, c.seq_first(g, "k", torch.float32)',
                     'chunk_gla(qs, ks, vs, c.seq_first(g.exp(), "k", torch.float32)',
                     ["tests/interp/test_fla_ops.py", "-k", "fp32 and gla and below and not simple"]),
    "scale": ("the d_k^-1/2 scale dropped",
              "self.scale = self.K ** -0.5 if scale is None else scale", "self.scale = 1.0",
              ["tests/interp/test_fla_ops.py", "-k", "fp32 and gated_delta_rule and below"]),
    "state-dtype": ("the final state returned in the compute dtype (fp16), not fp32",
                    "state[..., :self.K, :self.V].float()", "state[..., :self.K, :self.V].to(self.dtype)",
                    ["tests/interp/test_fla_ops.py", "-k", "fp16 and simple_gla and below"]),
    "chunk-size": ("the mixer's chunk size not passed through (always 64)",
                   "cs = chunk_size if chunk_size in FLA_CHUNK_SIZES else 64", "cs = 64",
                   ["tests/interp/test_fla_ops.py", "-k", "chunk16 and gated"]),
    "no-padding": ("odd value width not padded in fp16 (linear attention's ones column)",
                   'self.pad = {"k": self.K % 2, "v": self.V % 2} if dtype in _16BIT else {"k": 0, "v": 0}',
                   'self.pad = {"k": 0, "v": 0}',
                   ["tests/interp/test_fla_models_fp16.py", "-k", "fp16 and linear_attention and not unnormalized"]),
    "initial-state": ("the initial state not passed to the gated delta rule",
                      "bs, scale=c.scale,\n                                          initial_state=c.h0,",
                      "bs, scale=c.scale,\n                                          initial_state=None,",
                      ["tests/interp/test_fla_ops.py", "-k", "fp32 and gated_delta_rule and ragged"]),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=list(BUGS))
    p.add_argument("--triton-site", default=os.environ.get("ATTNZOO_TRITON_SITE", str(ROOT / ".venv" / "triton-site")))
    args = p.parse_args()
    env = {**os.environ, "TRITON_INTERPRET": "1", "ATTNZOO_INTERP_TESTS": "1",
           "PYTHONPATH": os.pathsep.join([args.triton_site, str(ROOT)])}
    original = TARGET.read_text()
    rows = []
    for name in args.only or BUGS:
        what, old, new, tests = BUGS[name]
        if original.count(old) != 1:
            rows.append((name, what, "NOT PLANTED (the text moved: update this script)", "", 0.0))
            continue
        t0 = time.perf_counter()
        try:
            TARGET.write_text(original.replace(old, new))
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-x", "-p", "no:cacheprovider",
                                "-W", "ignore::UserWarning", "-W", "ignore::RuntimeWarning", *tests],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        finally:
            TARGET.write_text(original)
        out = (r.stdout + r.stderr).splitlines()
        first = next((ln.strip() for ln in out if ln.startswith("E ")), out[-1] if out else "")
        caught = "caught" if r.returncode != 0 else "NOT CAUGHT"
        rows.append((name, what, caught, first[:160].replace("|", "/"), time.perf_counter() - t0))
        print(f"{name}: {caught} ({rows[-1][-1]:.0f} s)", flush=True)
    print("\n| planted bug | what | result | first failure | s |\n|---|---|---|---|---|")
    for name, what, caught, first, secs in rows:
        print(f"| {name} | {what} | {caught} | `{first}` | {secs:.0f} |")
    return 0 if all(r[2] == "caught" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
