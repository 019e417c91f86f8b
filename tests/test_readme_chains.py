"""The README's commands that read what an earlier one made (generate / eval / export / lm-eval on the run
before them, fine-tuning from `~/exported`, a report of a sweep): each chain runs in README order in its own
sandbox (scripts/check_readme.py chains), one test per chain."""
from pathlib import Path

import pytest

from scripts import check_readme

ROOT = Path(__file__).resolve().parents[1]
CMDS = check_readme.commands(ROOT / "README.md")
CHAINS = check_readme.chains(CMDS)


@pytest.mark.parametrize("chain", CHAINS, ids=[f"{c[0]}-{len(c)}-commands" for c in CHAINS])
def test_readme_chain(chain, tmp_path):
    env, sweep_dirs = check_readme.sandbox(tmp_path), {}
    for n in chain:
        ok, line = check_readme.run_checked(CMDS, n, tmp_path, env, sweep_dirs)
        assert ok, line
