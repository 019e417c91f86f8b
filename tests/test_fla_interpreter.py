"""fla's Triton kernels executed on this CPU by Triton's interpreter (tests/interp; ops/triton_interpreter.py).

triton must never be importable beside fla-core in the processes of the rest of the suite (DESIGN 6.7: it sends
transformers' Qwen3-Next to Triton kernels on a CPU and breaks the transformers oracles). So scripts/setup.sh
installs triton into a folder of its own (.venv/triton-site, or ATTNZOO_TRITON_SITE), and each test here starts
one pytest process over a file of tests/interp with that folder on PYTHONPATH and TRITON_INTERPRET=1.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# two processes of about equal length (each pays ~4 s of python, torch, triton and fla imports), so the suite's two
# workers can take one each
PARTS = [("test_fla_ops.py", "test_fla_cli.py"), ("test_fla_models.py", "test_fla_models_fp16.py")]


def triton_site() -> Path:
    return Path(os.environ.get("ATTNZOO_TRITON_SITE", ROOT / ".venv" / "triton-site"))


def test_triton_is_not_importable_here():
    """The rest of the suite sees what it always saw: no triton."""
    assert importlib.util.find_spec("triton") is None, "triton is importable in the main test environment (DESIGN 6.7)"


@pytest.mark.slow  # minutes of numpy per file: CI runs it, `pytest -m "not slow"` leaves it out
@pytest.mark.parametrize("files", PARTS, ids="+".join)
def test_interpreter_tier(files):
    site = triton_site()
    assert (site / "triton").is_dir(), (f"no triton at {site} for the interpreter tests: `bash scripts/setup.sh` "
                                        f"installs it there (or set ATTNZOO_TRITON_SITE)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "ATTNZOO_INTERP_TESTS": "1",
           "PYTHONPATH": os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                        "-W", "ignore::UserWarning", "-W", "ignore::RuntimeWarning", *(f"tests/interp/{f}" for f in files)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    lines = (r.stdout + r.stderr).strip().splitlines()
    tail = "\n".join(lines[-40:])
    assert r.returncode == 0, f"tests/interp/{' '.join(files)} under the interpreter failed:\n{tail}"
    summary = lines[-1]  # e.g. "25 passed in 122.26s (0:02:02)"
    assert re.match(r"^\d+ passed(, \d+ warnings?)? in ", summary), tail  # nothing failed, skipped, errored or deselected
