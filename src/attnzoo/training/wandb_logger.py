"""wandb logging that never blocks or stops training.

Offline automatically when no credentials are found (sync later with `wandb sync <dir>`), never prompts;
one run per job, grouped by sweep, named from the job's overrides, tagged by mixer; a wandb failure
(import, init, network) downgrades to a warning and training continues without it.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("attnzoo")


def has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return netrc.is_file() and "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


def _job_identity() -> tuple[str | None, str | None]:
    """(sweep group, run name) from Hydra's runtime config, when running under Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
    except Exception:
        return None, None
    overrides = [o for o in hc.overrides.task if not o.startswith(("hydra.", "paths.", "+sweeps="))]
    name = ",".join(overrides) or hc.job.name
    group = None
    if hc.mode.name == "MULTIRUN":
        # one group per sweep directory, prefixed by the sweep's name (`attnzoo-sweep NAME` passes +sweeps=NAME):
        # a new sweep (a new dated dir) is a new group; rerunning into the same dir (resume) continues its group
        named = [o.split("=", 1)[1] for o in hc.overrides.task if o.startswith("+sweeps=")]
        sweep_dir = Path(hc.sweep.dir).name
        group = f"{named[0]}/{sweep_dir}" if named and not sweep_dir.startswith(named[0] + "/") else sweep_dir
    return group, name


RUN_ID_FILE = "wandb_run_id"  # in the run dir: a resumed run continues the same wandb run


def make_wandb_logger(opts: dict, out: Path, container: dict, resume: bool = False):
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_CONSOLE", "off")
    offline = opts.get("offline")
    if offline is None:
        offline = not has_credentials()
    if offline:
        os.environ["WANDB_MODE"] = "offline"
    group, name = _job_identity()
    mixers = container.get("model", {}).get("mixer", {}) or {}
    tags = [t for t in [mixers.get("name"), container.get("data", {}).get("name")] if t] + list(opts.get("tags") or [])
    try:
        return _build(opts, out, group, name, tags, offline, resume)
    except Exception as e:  # noqa: BLE001
        if not offline:  # credentials but no reachable server (within init_timeout): keep the run, offline
            print(f"attnzoo: wandb online init failed ({type(e).__name__}); logging offline instead", flush=True)
            try:
                os.environ["WANDB_MODE"] = "offline"
                return _build(opts, out, group, name, tags, True, resume)
            except Exception as e2:  # noqa: BLE001
                e = e2
        log.warning("wandb disabled for this run: %s: %s", type(e).__name__, e)
        return None


def _build(opts, out, group, name, tags, offline, resume=False):
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    id_file = Path(out) / RUN_ID_FILE
    earlier = id_file.read_text().strip() if resume and id_file.exists() else None
    run = wandb.init(
        id=earlier,  # None: a new run; a resume: the run's own id, continued (resume="allow")
        resume="allow" if earlier else None,
        project=opts.get("project") or "attnzoo",
        entity=opts.get("entity"),
        group=opts.get("group") or group,
        name=opts.get("name") or name,
        tags=tags,
        dir=str(out),
        mode="offline" if offline else "online",
        reinit="finish_previous",
        # an unreachable server costs at most init_timeout seconds (wandb's default is 90, retried)
        settings=wandb.Settings(silent=True, console="off", init_timeout=float(opts.get("init_timeout") or 30)),
    )
    id_file.write_text(run.id)
    # one line per run: where it went (nothing else on the console mentions it)
    where = f"offline run in {run.dir} (upload later: wandb sync {Path(run.dir).parent})" if offline else \
        f"online run {getattr(run, 'url', None) or run.id} (local files in {run.dir})"
    where += f", continuing run {earlier}" if earlier else ""
    print(f"attnzoo: wandb {where}; project {run.project}, group {run.group or '-'}, name {run.name}", flush=True)
    return WandbLogger(experiment=run, save_dir=str(out))
