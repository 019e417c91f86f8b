"""`attnzoo-train` (= `python -m attnzoo.cli.train`): the Hydra app over conf/train.yaml around
`attnzoo.training.run.train`.

Before Hydra sees the command line: `--resume RUN_DIR` is expanded into that run's own overrides, and an
unknown config-group option or key is refused in one line (Hydra's own report takes several). Under `-m`
(multirun) a failing job is recorded in its own directory and the sweep goes on; a sweep rerun into the same
sweep dir skips its finished jobs and resumes the interrupted ones.
"""
from __future__ import annotations

import difflib
import json
import os
import sys
import traceback
from pathlib import Path

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Transformer
from hydra.errors import ConfigCompositionException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from attnzoo.config.errors import ConfigError
from attnzoo.config.overrides import check_group_overrides  # noqa: F401 (re-exported: tests, sweep.py)
from attnzoo.config.paths import CONF_DIR, sweeps_dir
from attnzoo.config.schema import parse_pattern
from attnzoo.training.launch import launched_externally
from attnzoo.training.launch import close_process_group


def main() -> None:
    """The console script: `attnzoo-train [--resume RUN_DIR] [overrides...] [-m]`.

    A refused command line or config prints `attnzoo: error: <one line>` on stderr and exits 2, leaving no
    run dir behind that Hydra made for it; a run stopped by SIGTERM exits 0 (resume it with --resume). Under
    `-m` the value a sweeper optimises is the job's `optimized_metric` (default val/loss), NaN for a failed job."""
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    if {"--help", "-h"} & set(sys.argv[1:]):
        sys.exit(print_help(sys.argv[1:]))
    try:
        sys.argv[1:] = resume_argv(sys.argv[1:])
    except ConfigError as e:
        print(f"attnzoo: error: {e}", file=sys.stderr)
        sys.exit(2)
    problem = check_group_overrides(sys.argv[1:]) or check_unknown_keys(sys.argv[1:]) or early_preflight()
    if problem:
        print(f"attnzoo: error: {problem}", file=sys.stderr)
        sys.exit(2)
    hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")(_run_job)()


HELP = """attnzoo-train: train one model, composed from the config groups below (a Hydra app over conf/train.yaml).

  attnzoo-train [--resume RUN_DIR] [group=option ...] [key=value ...] [-m]

  attnzoo-train debug=smoke                      a tiny run in seconds
  attnzoo-train model/mixer=gated_deltanet       swap the token mixer (every layer)
  attnzoo-train --resume outputs/train/RUN       continue a run from its last.ckpt
  attnzoo-train -m model/mixer=mha,gla           one job per value (attnzoo-sweep NAME runs the named sweeps)

Docs: README.md (the config groups, the mixer table), docs/architecture.md.

== Configuration groups ==
Compose your configuration from those groups (group=option)

{groups}


== Config ==
Override anything in the config (foo.bar=value)

{config}
Powered by Hydra (https://hydra.cc)
Use --hydra-help to view Hydra specific help
"""


def config_groups(root: Path = CONF_DIR) -> list[tuple[str, list[str]]]:
    """The config groups under conf/ and their options (the yaml files), as Hydra lists them in its help; read
    from the folder (Hydra's own listing builds a config repository per group: ~1.5 s of a 1.8 s --help)."""
    out = []
    for d in sorted(p for p in root.rglob("*") if p.is_dir()):
        group = d.relative_to(root).as_posix()
        options = sorted(f.stem for f in d.glob("*.yaml"))
        if options and group.split("/")[0] != "hydra":
            out.append((group, options))
    return out


def print_help(args: list[str]) -> int:
    """`attnzoo-train --help [overrides...]`: the groups and the config those overrides compose (issue 45: in the
    time of one composition). A command line that does not compose gets Hydra's own report."""
    overrides = [a for a in args if "=" in a and not a.startswith(("-", "hydra.", "hydra/"))]
    problem = check_group_overrides(overrides)
    if problem:
        print(f"attnzoo: error: {problem}", file=sys.stderr)
        return 2
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="train", overrides=overrides)
    except Exception as e:  # noqa: BLE001
        print(f"attnzoo: error: {e}".splitlines()[0], file=sys.stderr)
        return 2
    finally:
        GlobalHydra.instance().clear()
    groups = "\n".join(f"{g}: {', '.join(opts)}" for g, opts in config_groups())
    print(HELP.format(groups=groups, config=OmegaConf.to_yaml(cfg)), end="")
    return 0


def _die_with_the_sweep() -> None:
    """In a sweep's worker process (the parallel launcher's loky workers): the kernel kills this worker when the
    sweep process ends, SIGKILL included (issue 43 item 7: they outlived a SIGKILLed attnzoo-sweep; SIGTERM and
    Ctrl-C already stop them, cli/sweep._stop_everything). A job's DDP workers die with it in turn
    (training/launch.py). Nothing in the sweep's own process (hydra/launcher=basic)."""
    import multiprocessing

    if multiprocessing.parent_process() is None and "Loky" not in multiprocessing.current_process().name:
        return
    from attnzoo.distributed.processes import die_with_parent

    die_with_parent(os.getppid())


def _run_job(cfg: DictConfig) -> float | None:
    """One Hydra job: train(cfg), with the CLI's refusals and the multirun rules above."""
    # Lightning's import (~6 s on a 2-core machine) comes after the command line's own checks and the config's
    # (preflight: torch only), so a refused option, key or value is reported before it
    from attnzoo.training.rundir import holds_checkpoints, is_new_run_dir, remove_new_run_dir

    try:
        multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    except ValueError:
        multirun = False
    target = cfg.get("optimized_metric") or "val/loss"
    if multirun:
        _die_with_the_sweep()
        # a sweep rerun into the same sweep dir: finished jobs are skipped, interrupted ones resume
        out = Path(cfg.paths.output_dir)
        if _previous_status(out) == "ok":
            print(f"attnzoo: {out} finished earlier; skipped", flush=True)
            return json.loads((out / "summary.json").read_text())["metrics"].get(target)
        if cfg.get("ckpt_path") is None and (out / "checkpoints" / "last.ckpt").exists():
            with open_dict(cfg):
                cfg.ckpt_path = "last"
            print(f"attnzoo: resuming {out} from its last.ckpt", flush=True)
    out = Path(cfg.paths.output_dir)
    new_dir = not multirun and is_new_run_dir(out)  # Hydra made it for this run: a refusal leaves nothing
    if (out / ".hydra").exists():  # an earlier run's dir: its record is rewritten only once this run is accepted
        on_accept = lambda: save_hydra_record(cfg, out)  # noqa: E731
    else:  # a new dir: recorded now, so a job refused in a sweep still shows its overrides in the report
        on_accept = None
        try:
            save_hydra_record(cfg, out)
        except OSError:  # an output dir that cannot be written (under a file, read-only): preflight's one line
            pass
    try:
        from attnzoo.training.config_checks import preflight

        preflight(cfg)
        from attnzoo.training.run import train

        metrics = train(cfg, on_accept=on_accept)
        if launched_externally():  # torchrun / srun ranks: leave the process group together (cli/worker.py)
            close_process_group()
    except (ConfigError, FileNotFoundError) as e:
        if not multirun:
            if new_dir and not holds_checkpoints(out):  # a fault mid-run (a full disk) keeps what it saved
                remove_new_run_dir(out)
            print(f"attnzoo: error: {e}", file=sys.stderr)
            sys.exit(2)
        _record_failure(cfg, e)
        return float("nan")  # a failed trial to a sweeper that optimizes (Optuna), ignored by the others
    except Exception as e:  # noqa: BLE001 - a failing sweep job must not take the others with it
        if not multirun:
            raise
        _record_failure(cfg, e)
        return float("nan")  # a failed trial to a sweeper that optimizes (Optuna), ignored by the others
    if metrics.get("status") == "preempted":
        # SIGTERM ends the process, not just this job: a local sweep stops, a requeued job resumes
        sys.exit(0)
    return metrics.get(target)


def _previous_status(out: Path) -> str | None:
    try:
        return json.loads((out / "summary.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return None


def save_hydra_record(cfg: DictConfig, out: Path) -> None:
    """What Hydra writes to <run dir>/.hydra (config.yaml, hydra.yaml, overrides.yaml), written by us
    (conf/hydra/default.yaml sets output_subdir: null) so that a refused run cannot overwrite the
    record of the run that owns the directory (issue 12: the report then listed the refused overrides)."""
    try:
        hc = HydraConfig.get()
    except ValueError:  # not under Hydra (tests call train() directly)
        return
    d = out / ".hydra"
    d.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, d / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": hc}), d / "hydra.yaml")
    OmegaConf.save(hc.overrides.task, d / "overrides.yaml")


def _record_failure(cfg: DictConfig, err: BaseException) -> None:
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "error.txt").write_text("".join(traceback.format_exception(type(err), err, err.__traceback__)))
    (out / "summary.json").write_text(json.dumps({"status": "failed", "error": f"{type(err).__name__}: {err}",
                                                 "output_dir": str(out)}, indent=2))
    print(f"attnzoo: job failed ({type(err).__name__}: {err}); recorded in {out}/error.txt", file=sys.stderr)


# ------------------------------------------------------------------------------ the command line, before Hydra

def resume_argv(argv: list[str]) -> list[str]:
    """`--resume RUN_DIR [overrides...]` -> the run's own overrides (from RUN_DIR/.hydra/overrides.yaml),
    then the given ones, then `hydra.run.dir=RUN_DIR ckpt_path=last`. Other argv pass through unchanged."""
    if "--resume" not in argv:
        return argv
    i = argv.index("--resume")
    if i + 1 >= len(argv):
        raise ConfigError("needs the run directory: attnzoo-train --resume RUN_DIR [overrides...]", field="--resume")
    run_dir = Path(argv[i + 1]).expanduser().resolve()
    saved = run_dir / ".hydra" / "overrides.yaml"
    if not saved.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no .hydra/overrides.yaml)", field="--resume")
    if not (run_dir / "checkpoints" / "last.ckpt").exists():  # a file, or a sharded folder (trainer=fsdp)
        raise ConfigError(f"{run_dir} has no checkpoints/last.ckpt to resume from", field="--resume")
    own = [o for o in (OmegaConf.load(saved) or []) if not str(o).startswith(("ckpt_path=", "hydra.run.dir="))]
    if any(str(o).startswith("+sweeps=") for o in own):  # a sweep job: its sweep file must be found again
        own.insert(0, f"hydra.searchpath=[file://{sweeps_dir().parent}]")
    rest = argv[:i] + argv[i + 2:]
    return [*map(str, own), *rest, f"hydra.run.dir={run_dir}", "ckpt_path=last"]


def first_job_override(arg: str) -> str | None:
    """`key=a,b`, `key=range(1,5)`, `key=tag(log, interval(1e-4, 3e-2))` -> `key=<its first value>`: one
    job's form of a sweep override, so a multirun's keys can be checked by composing one job. Other
    overrides unchanged; None when Hydra cannot parse or enumerate it (`glob(*)`): Hydra reports it."""
    try:
        o = OverridesParser.create().parse_override(arg)
        if not o.is_sweep_override():
            return arg
        first = o.value().start if o.is_interval_sweep() else next(iter(o.sweep_iterator(Transformer.encode)))
    except Exception:  # noqa: BLE001 - any parse problem: Hydra's own report
        return None
    return f"{arg.split('=', 1)[0]}={first}"


def check_unknown_keys(args: list[str]) -> str | None:
    """One-line error for `a.b=value` naming a key the composed config does not have (`model.n_head=4`:
    Hydra reports it in five lines; here `model.n_head: unknown key; did you mean model.n_heads? ...`).
    A multirun (`-m`, attnzoo-sweep's `hydra.searchpath` + `+sweeps=NAME`, Optuna's search ranges) is
    checked as its first job would be composed. Any other composition problem is left to Hydra's report."""
    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in args):
        return None  # --help, --cfg, shell completion (-sc install=bash): Hydra's own business
    overrides = [a for a in args if "=" in a and (a.startswith("hydra.searchpath=")  # attnzoo-sweep's sweeps/
                                                  or not a.startswith(("-", "hydra.", "hydra/")))]
    one_job = {a: first_job_override(a) for a in overrides}  # each override as the first job sees it
    if None in one_job.values():
        return None
    # a single run: composed as Hydra will run it (its hydra.* overrides too), kept for early_preflight
    single = [a for a in args if "=" in a and a.startswith(("hydra.", "hydra/")) and a not in overrides] \
        if not ({"-m", "--multirun"} & set(args)) else None

    def composed(ov, kept=False):
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                if not kept:
                    return compose(config_name="train", overrides=[one_job[a] for a in ov])
                cfg = compose(config_name="train", overrides=[*single, *(one_job[a] for a in ov)],
                              return_hydra_config=True)
                _FIRST_JOB[:] = [cfg]
                return cfg
        finally:
            GlobalHydra.instance().clear()

    _FIRST_JOB.clear()
    try:
        return shadowed_mixer_override(composed(overrides, kept=single is not None), [one_job[a] for a in overrides])
    except ConfigCompositionException as e:
        bad = next((a for a in overrides if f"'{a.split('=', 1)[0]}'" in str(e)), None)
        if bad is None or bad.startswith(("+", "~", "hydra.")) or "/" in bad.split("=", 1)[0]:
            return None
    except Exception:  # noqa: BLE001 - anything else: Hydra reports it as usual
        return None
    key = bad.split("=", 1)[0]
    parent, _, leaf = key.rpartition(".")
    try:
        node = composed([a for a in overrides if a != bad])
        node = OmegaConf.select(node, parent) if parent else node
    except Exception:  # noqa: BLE001
        return None
    if parent == "trainer.fsdp" and not isinstance(node, DictConfig):  # a preset without the section (trainer=cpu)
        return (f"{key}: the trainer.fsdp options are read with trainer.strategy=fsdp, and this trainer preset has "
                f"none; allowed: trainer=fsdp_cpu (or trainer=fsdp on GPUs) with {bad}")
    keys = list(node.keys()) if isinstance(node, DictConfig) else []
    close = difflib.get_close_matches(leaf, keys, n=1)
    hint = f"did you mean {parent + '.' if parent else ''}{close[0]}? " if close else ""
    return f"{key}: unknown key; {hint}allowed keys: {', '.join(map(str, keys))} (add a new key with +{bad})"


_FIRST_JOB: list = []  # the config check_unknown_keys composed for a single run (with its hydra node)


def early_preflight() -> str | None:
    """The refusals of `preflight` (training/config_checks.py), made on the config check_unknown_keys composed,
    before `hydra.main` composes it twice more (issue 45: ~0.5 s of a 1.3 s refusal): the one line, or None
    (accepted, or a single run's config was not kept; `_run_job` makes the same checks again). Anything but a
    ConfigError is left to the run, which reports it as usual."""
    if not _FIRST_JOB:
        return None
    cfg = _FIRST_JOB.pop()
    try:
        with open_dict(cfg):  # what Hydra sets when the job starts: ${hydra:runtime.output_dir} resolves
            cfg.hydra.runtime.output_dir = str(Path(str(cfg.hydra.run.dir)).absolute())
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg):
            cfg.pop("hydra")  # the job's config, as _run_job sees it
        from attnzoo.training.config_checks import preflight

        preflight(cfg)
    except ConfigError as e:
        return str(e)
    except Exception:  # noqa: BLE001 - the run reports it, as it would have without this early look
        return None
    finally:
        HydraConfig.instance().cfg = None
    return None


def shadowed_mixer_override(cfg: DictConfig, overrides: list[str]) -> str | None:
    """`model.mixer.K=V` where every layer takes its settings from `model.mixers.<name>` (experiment=mqar's recipe
    for some mixers): the value would reach no layer, so it is refused with the key that would."""
    model = cfg.get("model") or {}
    name = OmegaConf.select(cfg, "model.mixer.name")
    items = parse_pattern(OmegaConf.select(cfg, "model.pattern"))
    mixers = model.get("mixers") or {}
    if not items or name not in mixers or not all(i in mixers for i in items):
        return None
    for o in overrides:
        key, _, value = o.partition("=")
        if key.startswith("model.mixer.") and key != "model.mixer.name":
            leaf = key.removeprefix("model.mixer.")
            return (f"{key}: every layer ({'/'.join(items)}) takes its settings from model.mixers.{name} (the "
                    f"experiment's recipe), which this value would not reach; allowed: model.mixers.{name}.{leaf}={value}")
    return None


if __name__ == "__main__":
    main()
