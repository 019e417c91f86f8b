"""Per-job DDP worker launch, so Hydra multirun and DDP compose.

Lightning's default DDP launcher re-runs `sys.argv` for ranks > 0. Under `-m` that child re-runs the
whole sweep and pairs with the parent job by job; one failing job or a change of world size desyncs
everything after it (pytorch-lightning #11300, #18175). Instead, a job that asks for DDP on one node
writes its fully resolved config into its own output dir and starts `world_size` fresh worker
processes on it (`python -m attnzoo.cli.worker <job.yaml>`), with the torch.distributed environment set
(MASTER_ADDR/PORT, WORLD_SIZE, NODE_RANK, LOCAL_RANK). Lightning sees LOCAL_RANK and does not launch
anything itself. The job waits for its workers, so jobs stay isolated: the next job starts with fresh
processes, and a failing worker fails only its own job.

The workers live no longer than their launcher: each asks the kernel to kill it when the launcher dies
(`procs.die_with_parent`, Linux), a SIGTERM to the launcher is passed on to them (they save last.ckpt and
stop, as a preempted run does) and waited for, and any still running when the launcher ends is stopped.
The run-dir lock records their pids, so the run dir stays locked while any of them lives.

Processes started by torchrun or SLURM (multi-node) are detected from the environment and run as is.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from omegaconf import OmegaConf

from attnzoo.training.rundir import record_workers

WORKER_ENV = "ATTNZOO_WORKER"
LAUNCHER_ENV = "ATTNZOO_LAUNCHER_PID"  # a worker's launcher: the worker dies with it (procs.die_with_parent)


def launched_externally() -> bool:
    env = os.environ
    if env.get(WORKER_ENV) or "LOCAL_RANK" in env or "TORCHELASTIC_RUN_ID" in env:
        return True
    return int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env


def global_rank() -> int:
    """This process's global rank under a distributed launch (attnzoo's workers and torchrun: RANK; srun with several
    tasks: SLURM_PROCID), 0 otherwise."""
    env = os.environ
    if "RANK" in env:
        return int(env["RANK"])
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return int(env["SLURM_PROCID"])
    return 0


def on_gpus(trainer_cfg) -> bool:
    import torch

    acc = str(trainer_cfg.accelerator)
    return acc in ("gpu", "cuda") or (acc == "auto" and torch.cuda.is_available())


def requested_devices(trainer_cfg) -> int:
    """How many devices (= processes on one node) trainer.devices asks for, as Lightning counts them: a
    list's length, a count, every visible GPU for -1 / auto on GPUs, every core for -1 on CPU, 1 for auto."""
    devices = trainer_cfg.devices
    if isinstance(devices, (list, tuple)) or (hasattr(devices, "__len__") and not isinstance(devices, str)):
        return len(devices)
    if devices in (-1, "-1", "auto"):
        import torch

        if on_gpus(trainer_cfg):
            return torch.cuda.device_count()
        return (os.cpu_count() or 1) if devices != "auto" else 1
    return int(devices)


def check_launchable(trainer_cfg) -> None:
    """Several devices without a DDP strategy: Lightning would pick DDP itself and re-run this command once
    per rank into the same run dir (whose lock refuses ranks > 0, leaving a force-killed run and a stale
    lock). Refused in one line before any work; the ranks are this launcher's to start (trainer=ddp_cpu / ddp)."""
    from attnzoo.config.errors import check

    strategy = str(trainer_cfg.strategy or "auto")
    nodes = trainer_cfg.num_nodes
    # several nodes: each node's processes come from torchrun / srun (run time, not config: the same config is valid
    # under the launcher); without one, Lightning would re-run this command per rank on this node alone
    check(nodes == 1 or launched_externally(), "trainer.num_nodes",
          f"{nodes} nodes need one launch per node (torchrun --nnodes {nodes} or srun; docs/distributed.md); "
          f"allowed here: 1")
    if is_data_parallel(strategy) or launched_externally():
        return
    n = requested_devices(trainer_cfg)
    preset = "ddp" if on_gpus(trainer_cfg) else "ddp_cpu"
    check(n <= 1, "trainer.devices", f"{trainer_cfg.devices!r} is {n} processes, which strategy={strategy} cannot "
          f"start here; allowed: 1, or DDP through attnzoo's launcher: trainer={preset} trainer.devices={n}")


def is_data_parallel(strategy: str) -> bool:
    """The strategies whose ranks attnzoo's launcher starts: DDP and FSDP (training/fsdp.py)."""
    return strategy.startswith("ddp") or strategy == "fsdp"


def processes_to_launch(trainer_cfg) -> int:
    """How many local worker processes this job must start itself (0: run in this process)."""
    strategy = str(trainer_cfg.strategy or "auto")
    if launched_externally() or not is_data_parallel(strategy) or strategy == "ddp_spawn" or trainer_cfg.num_nodes > 1:
        return 0
    n = requested_devices(trainer_cfg)
    return n if n > 1 else 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_workers(container: dict, out: Path, n: int, timeout: float | None = None) -> None:
    """Run the job on `n` local worker processes; raise RuntimeError (naming the rank and its log) on failure."""
    launch_dir = out / "launch"
    launch_dir.mkdir(parents=True, exist_ok=True)
    job = launch_dir / "job.yaml"
    OmegaConf.save(OmegaConf.create(container), job)
    port = _free_port()
    procs, logs = [], []
    threads = max(1, (os.cpu_count() or 1) // n)
    for rank in range(n):
        env = dict(os.environ)
        env.update({WORKER_ENV: "1", LAUNCHER_ENV: str(os.getpid()), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), "WORLD_SIZE": str(n), "NODE_RANK": "0", "LOCAL_RANK": str(rank),
                    "RANK": str(rank), "OMP_NUM_THREADS": str(threads)})
        if rank == 0:
            log, stdout = None, None  # rank 0 prints the progress bar and the summary
        else:
            log = launch_dir / f"rank{rank}.log"
            stdout = open(log, "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-m", "attnzoo.cli.worker", str(job)], env=env,
                                      stdout=stdout, stderr=subprocess.STDOUT if stdout else None))
        if stdout is not None:
            stdout.close()  # the worker holds its own copy of the descriptor
    record_workers(out, [p.pid for p in procs])  # the run dir stays locked while any of them lives
    with _forward_sigterm(procs):
        try:
            failed = _wait(procs, timeout)
        finally:  # this launcher is ending (normally they all have): no worker outlives it
            _stop(procs)
    if failed:
        rank, code = failed
        reported = read_worker_error(job, rank)
        if code == 2 and reported is not None:  # the worker's own one-line error (cli/worker.py): the run's
            raise reported
        where = logs[rank] if rank >= 0 and logs[rank] else "the output above"
        raise RuntimeError(f"DDP worker rank {rank} exited with code {code}; see {where}")


def _error_file(job, rank: int) -> Path:
    return Path(job).parent / f"rank{rank}.error.json"


def write_worker_error(job, e) -> None:
    """A worker's ConfigError (field, message) beside its job file, for the launcher to report as the run's."""
    import json

    rank = int(os.environ.get("RANK", "0"))
    _error_file(job, rank).write_text(json.dumps({"field": e.field, "message": str(e)}))


def read_worker_error(job, rank: int):
    """The ConfigError worker `rank` wrote, or None."""
    import json

    from attnzoo.config.errors import ConfigError

    path = _error_file(job, rank)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    for other in path.parent.glob("rank*.error.json"):  # every rank reported alike: read once
        other.unlink(missing_ok=True)
    message = data["message"].removeprefix(f"{data['field']}: ") if data.get("field") else data["message"]
    return ConfigError(message, field=data.get("field"))


@contextlib.contextmanager
def _forward_sigterm(procs):
    """SIGTERM to the launcher (a preemption, a `kill`) goes to the workers, which save last.ckpt and exit
    (PreemptionCheckpoint); the launcher waits for them instead of dying first and taking them along."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop(procs, grace: float = 10.0) -> None:
    """SIGTERM the workers still running, SIGKILL those left after `grace` seconds, and reap them all."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.terminate()
    deadline = time.time() + grace
    for p in running:
        try:
            p.wait(max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _wait(procs, timeout: float | None):
    """Wait for every worker; (rank, exit code) of the first that failed, or None. A failure stops the rest."""
    start = time.time()
    failed = None
    while True:
        codes = [p.poll() for p in procs]
        bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if bad and failed is None:
            failed = bad[0]
            time.sleep(2)  # let the other ranks notice and exit on their own, then stop them
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if all(c is not None for c in [p.poll() for p in procs]):
            break
        if timeout and time.time() - start > timeout:
            for p in procs:
                p.kill()
            failed = failed or (-1, "timeout")
        time.sleep(0.2)
    return failed

