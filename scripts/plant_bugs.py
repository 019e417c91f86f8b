"""Plant the three bugs the mixer contract must catch, one at a time, run the contract tests on the
planted mixer, and restore the file (try/finally). A bug is "caught" when at least one test fails.

    .venv/bin/python scripts/plant_bugs.py        # prints, per bug, the tests that failed

1. Gated DeltaNet drops the decay on the state carried in from the cache during a multi-token call
   (training forward and one-token decode are untouched: only chunked prefill on a non-empty cache sees it).
2. GQA's FLOPs formula is 10x too large.
3. GQA's `impl = "reference"` switch is ignored (the reference-vs-fast comparison compares a path with itself).
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUGS = [
    ("decay dropped on the carried-in state (gated_deltanet, multi-token call on a non-empty cache)",
     "src/attnzoo/ops/delta_rule.py", "        qd = q * eG\n",
     "        qd = q * eG if initial_state is None else q  # PLANTED\n", "gated_deltanet"),
    ("FLOPs 10x too large (gqa)",
     "src/attnzoo/mixers/attention.py", "        return proj + 2.0 * 2 * self.n_heads * self.head_dim * keys  # QK^T and PV\n",
     "        return 10 * (proj + 2.0 * 2 * self.n_heads * self.head_dim * keys)  # PLANTED\n", "gqa"),
    ("impl='reference' ignored (gqa)",
     "src/attnzoo/mixers/attention.py", '        if self.impl == "reference":\n',
     "        if False:  # PLANTED: impl ignored\n", "gqa"),
]


def main() -> None:
    caught = 0
    for what, rel, old, new, mixer in BUGS:
        path = ROOT / rel
        original = path.read_text()
        assert original.count(old) == 1, (rel, old)
        try:
            path.write_text(original.replace(old, new))
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                str(ROOT / "tests" / "test_mixers_contract.py"), "-k", mixer],
                               capture_output=True, text=True, cwd=ROOT, timeout=900)
        finally:
            path.write_text(original)
        failed = sorted(set(re.findall(r"FAILED tests/test_mixers_contract.py::(\S+)", r.stdout)))
        failed = [f for f in failed if re.search(rf"[\[-]{mixer}[-+\]]", f)]
        caught += bool(failed)
        summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-300:]
        print(f"{'CAUGHT' if failed else 'MISSED'}: {what}: {len(failed)} failing tests ({summary})")
        for f in failed[:8]:
            print(f"    {f}")
    print(f"{caught}/{len(BUGS)} planted bugs caught")
    sys.exit(0 if caught == len(BUGS) else 1)


if __name__ == "__main__":
    main()
