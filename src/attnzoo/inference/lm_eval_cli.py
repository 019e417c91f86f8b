"""`attnzoo-lm-eval`: lm_eval's own command line with the "attnzoo" model registered lazily (issue 45): lm_eval's
registry holds "attnzoo.inference.lm_eval:AttnzooLM" and imports it (torch, the run) only when a task asks for
the model, so `--help`, a listed task or a refused option costs lm_eval's import alone (~0.3 s, not ~4 s)."""
from __future__ import annotations

import sys
from pathlib import Path

from attnzoo.config.errors import ConfigError

TARGET = "attnzoo.inference.lm_eval:AttnzooLM"
# the offline needle-in-a-haystack tasks (tag attnzoo_niah; lm_eval_tasks/niah_utils.py): on --include_path always
TASKS_DIR = Path(__file__).with_name("lm_eval_tasks")


def register_lazily() -> None:
    import lm_eval.models  # noqa: F401 - lm_eval's own models first (it imports them only into an empty registry)
    from lm_eval.api import registry

    models = getattr(registry, "model_registry", None)
    try:
        models.register("attnzoo", target=TARGET)  # type: ignore[union-attr]
    except (AttributeError, TypeError):  # an lm_eval without lazy placeholders: the class itself
        import attnzoo.inference.lm_eval  # noqa: F401
    except ValueError:  # registered already (this process imported the class)
        pass


def option(argv: list[str], name: str) -> str | None:
    """The value of `--name VALUE` / `--name=VALUE` in argv (the last one), or None."""
    value = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def precheck(argv: list[str]) -> None:
    """`--model attnzoo --model_args path=RUN`: the run's path and checkpoint file, before lm_eval builds its task
    index (~15 s on a 2-core machine) and before torch's import."""
    if option(argv, "--model") != "attnzoo":
        return
    args = dict(kv.split("=", 1) for kv in (option(argv, "--model_args") or "").split(",") if "=" in kv)
    if args.get("path"):
        from attnzoo.inference.commands import precheck_checkpoint

        precheck_checkpoint(args["path"].strip(), args.get("best", "").strip() in ("true", "True", "1"))


def add_our_tasks() -> None:
    """lm_eval's CLI builds `lm_eval.tasks.TaskManager(include_path=<--include_path>)` (one folder in 0.4.13): in this
    process it gets a TaskManager that also indexes TASKS_DIR, after the caller's own folder."""
    import lm_eval.tasks

    base = lm_eval.tasks.TaskManager
    if getattr(base, "attnzoo_tasks", False):
        return

    class TaskManager(base):  # type: ignore[misc, valid-type]
        attnzoo_tasks = True

        def __init__(self, verbosity=None, include_path=None, include_defaults=True, metadata=None):
            paths = ([] if include_path is None else
                     list(include_path) if isinstance(include_path, (list, tuple)) else [include_path])
            super().__init__(verbosity, [*paths, str(TASKS_DIR)], include_defaults, metadata)

    lm_eval.tasks.TaskManager = TaskManager


def main(argv: list[str] | None = None) -> None:
    """`attnzoo-lm-eval ...`: lm_eval's own command line (same arguments), with "attnzoo" registered and the
    `attnzoo_niah` tasks on its include path."""
    argv = sys.argv[1:] if argv is None else argv
    saved = sys.argv
    sys.argv = ["attnzoo-lm-eval", *argv]
    try:
        precheck(argv)
        register_lazily()
        add_our_tasks()
        from lm_eval.__main__ import cli_evaluate

        cli_evaluate()
    except ConfigError as e:
        print(f"attnzoo-lm-eval: error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        sys.argv = saved  # an in-process caller (a test, a notebook) gets its own back
