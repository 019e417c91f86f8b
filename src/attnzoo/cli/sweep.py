"""`attnzoo-sweep NAME [overrides...]`: run the named ablation `sweeps/NAME.yaml` as a Hydra multirun.

A sweep file is a Hydra config (`# @package _global_`) that picks an experiment (`override /experiment: ...`,
which sits before `debug` in the defaults list, so `debug=smoke` still shrinks it), may set a few fixed
values, and lists its grid under `hydra.sweeper.params`. This command runs attnzoo-train's Hydra app as

    attnzoo-train -m hydra.searchpath=[file://<dir holding sweeps/>] +sweeps=NAME [overrides...]

Extra overrides pass through: `debug=smoke`, `logger=wandb`, `hydra.sweep.dir=...`, or a grid key given
again (`model/mixer=gqa,mha`) which replaces that key's values from the sweep file (Hydra's basic sweeper:
the command line wins per key). Jobs run two at a time in worker processes (`hydra/launcher=parallel`;
`hydra/launcher=basic` runs them one after another in this process); a failing job is recorded in its own
directory (error.txt, summary.json status "failed") and the sweep goes on; the sweep then prints
"N ok, M failed" and exits 1 if any failed. SIGTERM or Ctrl-C stops the sweep with every process it
started (worker processes, their resource trackers, the jobs' DDP workers) and exits 143 / 130.
Rerun with the same `hydra.sweep.dir` to skip finished jobs and resume interrupted ones from their last.ckpt.
Afterwards: `attnzoo-report <the sweep dir>`.

`debug=smoke` shrinks a sweep's experiment; a sweep whose grid itself must shrink (a budget sweep: its budgets and
sizes are grid values, which debug=smoke cannot reach) also ships `sweeps/smoke/NAME.yaml`, composed after the
sweep file under debug=smoke (`+sweeps/smoke=NAME`): its values and its `hydra.sweeper.params` replace the sweep
file's (grid keys given on the command line still win).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback

from attnzoo.config.paths import sweeps_dir
from attnzoo.distributed.processes import kill_tree

USAGE = "usage: attnzoo-sweep NAME [hydra overrides...]   (NAME: one of {names})"


def available() -> list[str]:
    return sorted(p.stem for p in sweeps_dir().glob("*.yaml"))


def hydra_argv(name: str, overrides: list[str]) -> list[str]:
    """The attnzoo-train command line (without the program name) that runs sweep `name`: jobs side by side
    on the `parallel` launcher (one per core pair of threads) unless the overrides pick a launcher."""
    root = sweeps_dir().parent
    launcher = [] if any(o.startswith(("hydra/launcher=", "hydra.launcher.")) for o in overrides) else [
        "hydra/launcher=parallel", f"hydra.launcher.n_jobs={PARALLEL_JOBS}"]
    return ["-m", f"hydra.searchpath=[file://{root}]", f"+{sweeps_dir().name}={name}", *smoke_overlay(name, overrides),
            *launcher, *overrides]


def smoke_overlay(name: str, overrides: list[str]) -> list[str]:
    """`+sweeps/smoke=NAME` when the overrides ask for debug=smoke and the sweep ships sweeps/smoke/NAME.yaml."""
    smoke = "debug=smoke" in overrides and (sweeps_dir() / "smoke" / f"{name}.yaml").is_file()
    return [f"+{sweeps_dir().name}/smoke={name}"] if smoke else []


# jobs side by side on a local sweep: two (each on half the cores), or one on a single-core machine
PARALLEL_JOBS = max(1, min(2, os.cpu_count() or 1))


class SweepTally(Callback):
    """After a multirun (any launcher): one line "N ok, M failed[, K skipped]" from the jobs' own
    summary.json files, and exit status 1 when a job failed, so a script or CI notices. A job whose
    summary predates this multirun was finished earlier and skipped (a rerun into the same sweep dir)."""

    def on_multirun_start(self, config, **kwargs) -> None:
        global _sweep_dir
        self.start = time.time()
        _sweep_dir = str(config.hydra.sweep.dir)  # named by the SIGTERM / SIGINT message

    def on_multirun_end(self, config, **kwargs) -> None:
        counts = {"ok": 0, "failed": 0, "skipped": 0, "incomplete": 0}
        for job in Path(config.hydra.sweep.dir).iterdir():
            summary = job / "summary.json"
            if not (job.is_dir() and job.name.isdigit()):
                continue
            try:
                status = json.loads(summary.read_text()).get("status")
            except (OSError, ValueError):
                status = None
            if status == "ok" and summary.stat().st_mtime < getattr(self, "start", 0):
                status = "skipped"
            counts[status if status in counts else "incomplete"] += 1
        line = f"attnzoo: {counts['ok']} ok, {counts['failed']} failed"
        line += "".join(f", {counts[k]} {k}" for k in ("skipped", "incomplete") if counts[k])
        print(line + (" (skipped: finished earlier)" if counts["skipped"] else ""), flush=True)
        if counts["failed"]:
            sys.exit(1)


class SearchSpaceCheck(Callback):
    """Before a multirun starts (nothing written yet): an Optuna study that cannot be sampled, or a grid with a value
    a job would refuse (check_grid), is refused in one line, exit status 2, instead of a traceback from inside the
    sweeper (or, for zero trials, after it) or jobs that run before the bad one fails."""

    def on_multirun_start(self, config, **kwargs) -> None:
        problem = check_search_space(config.hydra.sweeper, list(config.hydra.overrides.task)) or check_grid(config)
        if problem:
            print(f"attnzoo: error: {problem}", file=sys.stderr, flush=True)
            sys.exit(2)


def check_search_space(sweeper, task_overrides: list[str]) -> str | None:
    """One line naming the first setting of an Optuna sweeper (hydra-optuna-sweeper) that cannot run: a
    search range (`hydra.sweeper.params.KEY`, or a `KEY=interval(..)` / `range(..)` override on the command
    line, which the sweeper adds to the space) that is empty or a log range reaching 0, a study of no
    trials, a failure rate outside [0, 1]. None for any other sweeper (grid sweeps enumerate their values)."""
    if "optuna" not in str(sweeper.get("_target_", "")).lower():
        return None
    import logging

    # importing optuna sets up alembic, whose INFO lines ("setup plugin ...") Hydra's console logger would show
    logging.getLogger("alembic").setLevel(logging.WARNING)
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra_plugins.hydra_optuna_sweeper._impl import create_optuna_distribution_from_override

    n_trials, n_jobs = sweeper.get("n_trials"), sweeper.get("n_jobs")
    if not (isinstance(n_trials, int) and n_trials >= 1):
        return f"hydra.sweeper.n_trials: {n_trials}; allowed: an integer >= 1 (trials in the study)"
    if not (isinstance(n_jobs, int) and n_jobs >= 1):
        return f"hydra.sweeper.n_jobs: {n_jobs}; allowed: an integer >= 1 (trials launched at a time)"
    rate = sweeper.get("max_failure_rate", 0.0)
    if not 0.0 <= rate <= 1.0:
        return f"hydra.sweeper.max_failure_rate: {rate}; allowed: [0, 1]"
    space = [(f"hydra.sweeper.params.{k}", f"{k}={v}") for k, v in (sweeper.get("params") or {}).items()]
    space += [(o.split("=", 1)[0], o) for o in task_overrides if "=" in o]
    parser = OverridesParser.create()
    for field, line in space:
        given = line.split("=", 1)[1]
        try:
            o = parser.parse_override(line)
        except Exception as e:  # noqa: BLE001 - Hydra's parser: its message's first line
            return f"{field}: cannot parse {given!r} ({str(e).strip().splitlines()[0]})"
        if not o.is_sweep_override():
            continue  # a fixed value
        v = o.value()
        if o.is_interval_sweep():
            if v.start > v.end:
                return f"{field}: {given} has low > high; allowed: low <= high"
            if "log" in v.tags and v.start <= 0:
                return f"{field}: {given} is a log range with low <= 0; allowed: 0 < low <= high"
        elif o.is_range_sweep() and not v.shuffle and (v.step <= 0 or v.start > v.stop):
            return f"{field}: {given} is an empty range; allowed: range(start, stop, step) with start <= stop, step > 0"
        try:  # anything else Optuna itself cannot sample
            create_optuna_distribution_from_override(o)
        except Exception as e:  # noqa: BLE001 - Optuna's ValueError / the sweeper's assertions
            return f"{field}: {given} cannot be sampled by Optuna ({str(e).strip().splitlines()[0] or type(e).__name__})"
    return None


def check_grid(config) -> str | None:
    """A grid sweep (Hydra's basic sweeper) whose values include one that a job would refuse (a negative or
    non-numeric budget, an unknown mixer name in a pattern): one line naming the key and the value, before any job
    runs (was: the jobs before it ran, then that one failed). Each grid key's values are checked one at a time with
    the other keys at their first value (the sum of the grid's sizes, not its product, in composed configs).
    None for other sweepers, or when a job config cannot be composed here (Hydra then reports it as usual)."""
    if "basicsweeper" not in str(config.hydra.sweeper.get("_target_", "")).lower():
        return None
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    lines = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    lines += [o for o in config.hydra.overrides.task if "=" in o]
    grid: dict[str, list[str]] = {}  # every job's overrides, as the basic sweeper builds them: key -> its values
    try:
        for o in OverridesParser.create().parse_overrides(lines):  # the command line's values win per key
            key = o.get_key_element()
            grid.pop(key, None)
            grid[key] = ([(str(v), t) for v, t in zip(o.sweep_string_iterator(), o.sweep_iterator())]
                         if o.is_sweep_override() else [(o.input_line, None)])
        loader = GlobalHydra.instance().config_loader()
    except Exception:  # noqa: BLE001 - a grid Hydra cannot enumerate: its own report
        return None
    line = lambda k, v: v if v.startswith(f"{k}=") else f"{k}={v}"  # noqa: E731 - a fixed override: as given
    first = {k: line(k, v[0][0]) for k, v in grid.items()}
    try:
        with _config_files_read_once():
            return _first_refused(config, loader, grid, first, line)
    finally:
        HydraConfig.instance().set_config(config)  # the multirun's own, for the sweeper


@contextlib.contextmanager
def _config_files_read_once():
    """While the grid is checked, each YAML file of the config search path is parsed once and handed out as a copy
    (Hydra parses every file again for each compose: ~40% of a compose, and a grid composes once per value). The
    files do not change during the check; copies, because a compose may edit what it loads (the defaults list).
    Hydra's own file source is wrapped for the duration and restored after."""
    import copy

    from hydra._internal.core_plugins.file_config_source import FileConfigSource

    read, parsed = FileConfigSource.load_config, {}

    def load_config(self, config_path: str):
        key = (self.path, config_path)
        if key not in parsed:
            parsed[key] = read(self, config_path)
        return copy.deepcopy(parsed[key])

    FileConfigSource.load_config = load_config
    try:
        yield
    finally:
        FileConfigSource.load_config = read


def _first_refused(config, loader, grid: dict, first: dict, line) -> str | None:
    import copy

    from omegaconf import OmegaConf, open_dict

    from attnzoo.config.errors import ConfigError
    from attnzoo.training.config_checks import validate

    def job_config(overrides: list):
        cfg = loader.load_sweep_config(config, overrides)
        with open_dict(cfg):  # what the launcher sets for each job (its number and directory)
            cfg.hydra.job.num, cfg.hydra.job.id = 0, "grid_check"
            cfg.hydra.runtime.output_dir = str(Path(tempfile.gettempdir()) / "attnzoo-grid-check")
        return cfg

    # the first job, then each swept key's other values with the rest at their first: a plain key's value set on a
    # copy of the first job's config when it is a number, anything else (a config group, a string, a list) composed
    checks = [(None, None, None)] + [(key, text, typed) for key, values in grid.items() for text, typed in values[1:]]
    base = None
    for key, text, typed in checks:
        try:
            plain = isinstance(typed, (int, float)) and "/" not in key and not key.startswith(("+", "~"))
            if key is None or not plain:
                cfg = job_config([*(o for k, o in first.items() if k != key)] + ([line(key, text)] if key else []))
                base = cfg if key is None else base
            else:
                cfg = copy.deepcopy(base)
                with open_dict(cfg):
                    OmegaConf.update(cfg, key, typed, merge=False)
            HydraConfig.instance().set_config(cfg)  # as the launcher does for a job: ${hydra:...} resolves
            validate(cfg)
        except ConfigError as e:
            where = f"the grid's {key}={text}" if key is not None else "the first job"
            return f"{e} ({where}: no job has run)"
        except Exception:  # noqa: BLE001 - not composable or not checkable here: the job reports it
            if base is None:
                return None
            continue
    return None


_sweep_dir = None  # this process's running multirun (SweepTally.on_multirun_start)


def _launcher(overrides: list[str]) -> str:
    picked = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra/launcher=")]
    return picked[-1] if picked else "parallel"


def _stop_everything(signum, frame) -> None:
    """SIGTERM / SIGINT to a sweep whose jobs run in worker processes (joblib/loky): kill every process
    the sweep started (the workers, their resource trackers, the jobs' DDP workers), say how to resume, and
    exit 128 + the signal number. Without it the loky workers and trackers outlived the sweep by minutes.
    A job's last.ckpt (written atomically) is where a rerun into the same sweep dir resumes it."""
    killed = kill_tree()
    where = f" with hydra.sweep.dir={_sweep_dir}" if _sweep_dir else ""
    try:
        print(f"attnzoo-sweep: {signal.Signals(signum).name}: stopped the sweep and its {len(killed)} worker "
              f"processes; rerun the same command{where} to skip finished jobs and resume the others",
              file=sys.stderr, flush=True)
    except (OSError, RuntimeError):  # the signal came in the middle of a write to stderr (reentrant call)
        pass
    os._exit(128 + signum)


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

    from attnzoo.cli import train

    GlobalHydra.instance().clear()  # a previous in-process compose/run would block hydra.main
    # the parallel launcher's worker processes read this when they import torch: half the cores each
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // PARALLEL_JOBS)))
    previous = {}
    if _launcher(overrides) != "basic" and threading.current_thread() is threading.main_thread():
        # jobs in worker processes: they end with the sweep (basic: in this process, preemption as in train)
        previous = {sig: signal.signal(sig, _stop_everything) for sig in (signal.SIGTERM, signal.SIGINT)}
    saved = sys.argv
    sys.argv = [f"attnzoo-sweep-{name}", *hydra_argv(name, overrides)]
    try:
        train.main()
    finally:
        sys.argv = saved
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None  # no sweep's config left for a later run in this process
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    main()
