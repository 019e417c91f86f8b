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


VALIDATE_PROBE = """
import json, sys
import attnzoo.training.families, attnzoo.models.encdec_options, attnzoo.models.vision.options
no_torch = "torch" not in sys.modules
import attnzoo.mixers, attnzoo.layers.moe, attnzoo.config.registry as r
r.FFNS.names()
print(json.dumps({"no_torch": no_torch, "no_dynamo": "torch._dynamo" not in sys.modules}))
"""


def test_validation_modules_leave_torch_and_the_zoo_leaves_dynamo_unimported():
    """What a refused value costs (issue 45 item 1): the families and the encoder-decoder / vision options that
    validate() reads import no torch; the mixer and FFN registries (which validate() loads: their config classes
    live beside the modules) import torch but not torch._dynamo (~2 s on a 2-core machine)."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "ATTNZOO_FULL_IMPORTS"}
    out = subprocess.run([sys.executable, "-c", VALIDATE_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"no_torch": True, "no_dynamo": True}


def test_constant_result_sets_the_mark_torch_sets():
    """ops/dispatch.constant_result stands in for torch.compiler.assume_constant_result without importing Dynamo:
    it must leave a function exactly as torch's decorator does (a torch release that changes the mark fails here)."""
    import torch

    from attnzoo.ops.dispatch import constant_result

    def ours():
        return True

    def theirs():
        return True

    import attnzoo.ops.dispatch as d

    saved = sys.modules.pop("torch._dynamo", None)  # the path taken when Dynamo is not loaded yet
    try:
        constant_result(ours)
    finally:
        if saved is not None:
            sys.modules["torch._dynamo"] = saved
    torch.compiler.assume_constant_result(theirs)
    assert vars(ours) == vars(theirs) and vars(ours), (vars(ours), vars(theirs))
    assert vars(d.fla_available) == vars(theirs) and vars(d.flex_available) == vars(theirs)
