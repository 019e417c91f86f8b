"""Keep Lightning's import lean in attnzoo's own processes (the console scripts and their DDP / FSDP workers).

`import lightning` imports torchmetrics (`lightning_utilities.compare_version("torchmetrics", ...)` imports the
package to read its version, and `LightningModule` subclasses-checks `torchmetrics.Metric`), and torchmetrics
imports at module level every optional back-end it finds installed: transformers (for BERTScore), scipy.signal
(audio metrics) and matplotlib (plots). attnzoo uses no torchmetrics metric, yet those three were 6.4 s of a
12 s `import lightning.pytorch` on a 2-core machine (`python -X importtime`, docs/benchmarks.md) in every CLI
start and every worker process.

`trim()` installs, before Lightning is imported, an import hook that runs `torchmetrics.utilities.imports` as
usual and then marks those back-ends unavailable *to torchmetrics only*: the packages stay installed and
importable, attnzoo's own lazy imports of them (the `transformers` interop, the report's plotting) are
unaffected, and torchmetrics' metrics that need them would say the package is missing. The hook is installed
only by attnzoo's entry points, never by `import attnzoo`, so a user's own process that imports attnzoo keeps
torchmetrics whole. `ATTNZOO_FULL_IMPORTS=1` turns it off.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

# torchmetrics' availability flags whose back-ends are imported when torchmetrics is (torchmetrics 1.x names)
TORCHMETRICS_FLAGS = ("_TRANSFORMERS_GREATER_EQUAL_4_4", "_TRANSFORMERS_GREATER_EQUAL_4_10", "_SCIPI_AVAILABLE",
                      "_MATPLOTLIB_AVAILABLE", "_SCIENCEPLOT_AVAILABLE")
# back-ends torchmetrics' own __init__ imports when `package_available(name)` says they are installed
TORCHMETRICS_PACKAGES = ("scipy",)
_TARGET = "torchmetrics.utilities.imports"


class _TrimTorchmetrics(importlib.abc.MetaPathFinder):
    """Finds `torchmetrics` and `torchmetrics.utilities.imports` as the path finder would, and wraps their
    execution: while the package's __init__ runs, `package_available` answers False for the packages above;
    once `utilities.imports` has run, the flags above are False, so every later
    `from torchmetrics.utilities.imports import _X` in torchmetrics sees False."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in ("torchmetrics", _TARGET):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module
        spec.loader.exec_module = _package_init(run) if fullname == "torchmetrics" else _flags_off(run)
        return spec


def _flags_off(run):
    def exec_module(module):
        run(module)
        for flag in TORCHMETRICS_FLAGS:
            if hasattr(module, flag):
                setattr(module, flag, False)
    return exec_module


def _package_init(run):
    def exec_module(module):
        from lightning_utilities.core import imports

        available = imports.package_available
        imports.package_available = lambda name: name not in TORCHMETRICS_PACKAGES and available(name)
        try:
            run(module)
        finally:
            imports.package_available = available
    return exec_module


def trim() -> None:
    """Install the hook (once), unless torchmetrics is imported already or ATTNZOO_FULL_IMPORTS=1."""
    if os.environ.get("ATTNZOO_FULL_IMPORTS") == "1" or _TARGET in sys.modules:
        return
    if not any(isinstance(f, _TrimTorchmetrics) for f in sys.meta_path):
        sys.meta_path.insert(0, _TrimTorchmetrics())
