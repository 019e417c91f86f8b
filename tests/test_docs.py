"""The README's commands, each run in smoke form (scripts/check_readme.py): a command a newcomer copies
must work as written (GPU / SLURM / multi-node ones: composed and validated as attnzoo-train would)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_readme_command_runs_in_smoke_form():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_readme.py")], capture_output=True, text=True,
                       timeout=1200, cwd=ROOT)
    assert r.returncode == 0 and "every README command passed" in r.stdout, r.stdout[-6000:] + r.stderr[-3000:]
    assert r.stdout.count("\nok ") + r.stdout.startswith("ok ") >= 20  # every command was seen
