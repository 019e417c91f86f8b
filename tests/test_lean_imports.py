"""The console scripts' lean import of Lightning (attnzoo/_lean_imports.py, issue 45 item 2): through attnzoo.cli,
`import lightning.pytorch` leaves transformers, scipy and matplotlib unimported (torchmetrics, which Lightning
imports unconditionally, sees them as absent); through plain `import attnzoo` nothing changes. Both in fresh
processes (started together), since an import cannot be undone in this one."""
from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("transformers", "scipy", "matplotlib")
PROBE = """
import json, sys
{first}
import lightning.pytorch
import torchmetrics.utilities.imports as flags
seen = {{m: m in sys.modules for m in {heavy!r}}}
import transformers  # still importable for attnzoo's own use
print(json.dumps({{"seen": seen, "bert": bool(flags._TRANSFORMERS_GREATER_EQUAL_4_4),
                   "tm": "torchmetrics" in sys.modules, "tf": transformers.__name__}}))
"""


def _probe(first: str) -> subprocess.Popen:
    env_clean = {k: v for k, v in __import__("os").environ.items() if k != "ATTNZOO_FULL_IMPORTS"}
    return subprocess.Popen([sys.executable, "-c", PROBE.format(first=first, heavy=HEAVY)], env=env_clean,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_entry_points_import_lightning_without_torchmetrics_backends_and_the_library_leaves_it_whole():
    lean, whole = _probe("import attnzoo.cli"), _probe("import attnzoo")
    results = {}
    for name, proc in (("lean", lean), ("whole", whole)):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        results[name] = json.loads(out.strip().splitlines()[-1])
    assert results["lean"]["seen"] == {m: False for m in HEAVY}, results["lean"]
    assert results["lean"]["tm"] and not results["lean"]["bert"] and results["lean"]["tf"] == "transformers"
    # the library alone changes nothing: torchmetrics imports its back-ends as it always does
    assert results["whole"]["bert"] and results["whole"]["seen"]["transformers"], results["whole"]


def test_every_console_script_enters_through_attnzoo_cli():
    """A script entered elsewhere would import Lightning whole (pyproject.toml's [project.scripts])."""
    import importlib
    import tomllib
    from pathlib import Path

    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    assert len(scripts) >= 10
    for name, target in scripts.items():
        module, func = target.split(":")
        # attnzoo-bench, the layer above attnzoo.cli (docs/architecture.md), imports it first itself
        assert module.startswith("attnzoo.cli.") or module == "attnzoo.bench.cli", (name, target)
        assert callable(getattr(importlib.import_module(module), func)), (name, target)
