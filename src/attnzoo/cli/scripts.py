"""The console scripts whose code lives in the layers below attnzoo.cli, entered through it so that the lean
import of Lightning comes first (attnzoo/cli/__init__.py); each imports its library only when called.
attnzoo-bench, the layer above, imports attnzoo.cli itself."""
from __future__ import annotations


def generate() -> None:
    from attnzoo.inference.commands import generate_main

    generate_main()


def evaluate() -> None:
    from attnzoo.inference.commands import eval_main

    eval_main()


def lm_eval() -> None:
    from attnzoo.inference.lm_eval_cli import main

    main()


def report() -> None:
    from attnzoo.analysis.report import main

    main()
