"""`attnzoo-sweep NAME [overrides...]`: run the named ablation `sweeps/NAME.yaml` as a Hydra multirun.

A sweep file is a Hydra config (`# @package _global_`) that picks an experiment (`override /experiment: ...`,
which sits before `debug` in the defaults list, so `debug=smoke` still shrinks it), may set a few fixed
values, and lists its grid under `hydra.sweeper.params`. This command runs attnzoo-train's Hydra app as

    attnzoo-train -m hydra.searchpath=[file://<dir holding sweeps/>] +sweeps=NAME [overrides...]

Extra overrides pass through: `debug=smoke`, `logger=wandb`, `hydra.sweep.dir=...`, or a grid key given
again (`model/mixer=gqa,mha`) which replaces that key's values from the sweep file (Hydra's basic sweeper:
the command line wins per key). Jobs run one after another in this process; a failing job is recorded
in its own directory (error.txt, summary.json status "failed") and the sweep goes on.
Afterwards: `attnzoo-report <the sweep dir>`.
"""
from __future__ import annotations

import sys

from .paths import sweeps_dir

USAGE = "usage: attnzoo-sweep NAME [hydra overrides...]   (NAME: one of {names})"


def available() -> list[str]:
    return sorted(p.stem for p in sweeps_dir().glob("*.yaml"))


def hydra_argv(name: str, overrides: list[str]) -> list[str]:
    """The attnzoo-train command line (without the program name) that runs sweep `name`."""
    root = sweeps_dir().parent
    return ["-m", f"hydra.searchpath=[file://{root}]", f"+{sweeps_dir().name}={name}", *overrides]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE.format(names=", ".join(names)))
        print(__doc__)
        return
    name, overrides = argv[0], argv[1:]
    if name not in names:
        print(f"attnzoo-sweep: error: unknown sweep {name!r}; allowed: {', '.join(names)}", file=sys.stderr)
        sys.exit(2)
    from hydra.core.global_hydra import GlobalHydra

    from . import train

    GlobalHydra.instance().clear()  # a previous in-process compose/run would block hydra.main
    saved = sys.argv
    sys.argv = [f"attnzoo-sweep-{name}", *hydra_argv(name, overrides)]
    try:
        train.main()
    finally:
        sys.argv = saved
        GlobalHydra.instance().clear()


if __name__ == "__main__":
    main()
