"""The console scripts whose code lives outside attnzoo.cli, entered through it (attnzoo/cli/__init__.py: the
lean import of Lightning comes first); each imports its library only when called."""
from __future__ import annotations


def bench() -> None:
    from attnzoo.bench.cli import main

    main()


def generate() -> None:
    from attnzoo.inference.generate import generate_main

    generate_main()


def evaluate() -> None:
    from attnzoo.inference.generate import eval_main

    eval_main()


def lm_eval() -> None:
    from attnzoo.inference.lm_eval import main

    main()


def report() -> None:
    from attnzoo.analysis.report import main

    main()
