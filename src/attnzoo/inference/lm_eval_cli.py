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


def light_index_holds(manager, wanted: list[str]) -> bool:
    """Whether an index built without lm_eval's own tasks (the caller's --include_path and TASKS_DIR) resolves every
    requested name as the full one would: each is a task there (a task of an include path overrides a default of the
    same name, so the full index gives the same one), or a tag of ours (attnzoo_niah: lm_eval's tasks carry none).
    A group, another tag, a yaml path or a pattern may reach lm_eval's tasks: the full index decides those."""
    ours = {t for e in manager._index.values() if e.yaml_path and Path(e.yaml_path).parent == TASKS_DIR
            for t in (e.tags or ())}
    for name in wanted:
        entry = manager._index.get(name)
        kind = getattr(getattr(entry, "kind", None), "name", None)  # lm_eval's Kind (a private module's enum)
        if not (kind in ("TASK", "PY_TASK") or (kind == "TAG" and name in ours)):
            return False
    return True


def add_our_tasks(wanted: list[str] | None = None) -> None:
    """lm_eval's CLI builds `lm_eval.tasks.TaskManager(include_path=<--include_path>)` (one folder in 0.4.13): in this
    process it gets a TaskManager that also indexes TASKS_DIR, after the caller's own folder. `wanted` (the --tasks
    names): when the caller's folder and TASKS_DIR hold them all (light_index_holds), lm_eval's own ~15,000 task files
    are not indexed (~10 s of every run on a 2-core machine); otherwise they are, as lm_eval does."""
    import lm_eval.tasks

    base = getattr(lm_eval.tasks.TaskManager, "attnzoo_base", lm_eval.tasks.TaskManager)

    class TaskManager(base):  # type: ignore[misc, valid-type]
        attnzoo_base = base

        def __init__(self, verbosity=None, include_path=None, include_defaults=True, metadata=None):
            paths = ([] if include_path is None else
                     list(include_path) if isinstance(include_path, (list, tuple)) else [include_path])
            paths.append(str(TASKS_DIR))
            if include_defaults and wanted:
                super().__init__(verbosity, paths, False, metadata)
                if light_index_holds(self, wanted):
                    return
            super().__init__(verbosity, paths, include_defaults, metadata)

    lm_eval.tasks.TaskManager = TaskManager


def requested_tasks(argv: list[str]) -> list[str] | None:
    """The names of `--tasks a,b` (None when not given)."""
    value = option(argv, "--tasks")
    return None if value is None else [t.strip() for t in value.split(",") if t.strip()]


def main(argv: list[str] | None = None) -> None:
    """`attnzoo-lm-eval ...`: lm_eval's own command line (same arguments), with "attnzoo" registered and the
    `attnzoo_niah` tasks on its include path."""
    argv = sys.argv[1:] if argv is None else argv
    saved = sys.argv
    sys.argv = ["attnzoo-lm-eval", *argv]
    try:
        precheck(argv)
        register_lazily()
        if not {"-h", "--help"} & set(argv):  # argparse answers a help before any task is looked up: lm_eval.tasks
            add_our_tasks(requested_tasks(argv))  # (datasets, pandas: ~0.8 s) is imported for a run only
        from lm_eval.__main__ import cli_evaluate

        cli_evaluate()
    except ConfigError as e:
        print(f"attnzoo-lm-eval: error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        sys.argv = saved  # an in-process caller (a test, a notebook) gets its own back
