"""Where the shipped configs live: `conf/` inside an installed wheel, the repo's top-level `conf/` in a checkout."""
from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def _find(name: str) -> Path:
    for candidate in (_PKG / name, _PKG.parent.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"attnzoo: cannot find the '{name}/' folder next to the package or the repository root")


CONF_DIR = _find("conf")


def sweeps_dir() -> Path:
    return _find("sweeps")
