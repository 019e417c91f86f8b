"""The README's commands, each run in smoke form (scripts/check_readme.py): a command a newcomer copies must
work as written (GPU / SLURM / multi-node ones: composed and validated as attnzoo-train would). Here: every
command that reads nothing an earlier one made, one test each (its own sandbox and timeout); the dependent
ones are tests/test_readme_chains.py."""
from pathlib import Path

import pytest

from scripts import check_readme

ROOT = Path(__file__).resolve().parents[1]
CMDS = check_readme.commands(ROOT / "README.md")
SERIAL, INDEPENDENT = check_readme.lanes(CMDS)


def test_the_readme_is_covered():
    """Every command is in exactly one test: the independent ones here, the rest in one of the chains."""
    chained = [n for chain in check_readme.chains(CMDS) for n in chain]
    assert sorted(chained + INDEPENDENT) == list(range(len(CMDS))) and len(CMDS) >= 20
    assert all(not check_readme.reads_earlier(CMDS[chain[0]]) for chain in check_readme.chains(CMDS))


@pytest.mark.parametrize("n", INDEPENDENT, ids=[f"{n}-{CMDS[n].split('#')[0].strip()[:60]}" for n in INDEPENDENT])
def test_readme_command(n, tmp_path):
    ok, line = check_readme.run_checked(CMDS, n, tmp_path, check_readme.sandbox(tmp_path), {})
    assert ok, line
