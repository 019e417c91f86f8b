"""Per-job DDP worker launch, so Hydra multirun and DDP compose.

Lightning's default DDP launcher re-runs `sys.argv` for ranks > 0. Under `-m` that child re-runs the
whole sweep and pairs with the parent job by job; one failing job or a change of world size desyncs
everything after it (pytorch-lightning #11300, #18175). Instead, a job that asks for DDP on one node
writes its fully resolved config into its own output dir and starts `world_size` fresh worker
processes on it, with the torch.distributed environment set (MASTER_ADDR/PORT, WORLD_SIZE, NODE_RANK,
LOCAL_RANK). Lightning sees LOCAL_RANK and does not launch anything itself. The job waits for its workers,
so jobs stay isolated: the next job starts with fresh processes, and a failing worker fails only its own job.

The workers are forked from a fork server (multiprocessing's "forkserver" start method) that imported the
training stack once (`WORKER_MODULES`: torch, Lightning, attnzoo) and never computes, so it is safe to fork
from (a process that ran OpenMP or CUDA is not). Each worker is then what `python -m attnzoo.cli.worker
<job.yaml>` would be: the launcher's environment (plus the rank's), working directory, stdout / stderr (rank
0) or `launch/rank<N>.log`, and its own pid and exit code. The server lives as long as the launcher, so the
second and later jobs of a sweep run in one process, or a test session, start their workers without paying
the imports again (~4-5 s a worker on a 2-core machine), and the launcher starts it before preparing the data
(`warm_workers`), so the server's imports overlap that work. `ATTNZOO_WORKER_START=spawn` (or a platform
without forkserver) starts each worker as `python -m attnzoo.cli.worker <job.yaml>` instead.

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
    acc = str(trainer_cfg.accelerator)
    if acc != "auto":
        return acc in ("gpu", "cuda")
    from attnzoo.config.machine import cuda_available  # only auto asks the machine (torch only when it must)

    return cuda_available()


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


START_ENV = "ATTNZOO_WORKER_START"  # forkserver (the default) or spawn: how launch_workers starts a worker
ORIGIN_ENV = "ATTNZOO_COMMAND_START"  # "<origin> <perf_counter>": where a worker's first_step_seconds count from
# what the fork server imports once, for every worker it forks: the worker's entry and the training stack. The
# server's command line lists them, and a forked worker's command line is the server's: the run-dir lock counts a
# recorded pid as a live worker by "attnzoo.cli.worker" in it (rundir._live_workers)
WORKER_MODULES = ["attnzoo.cli.worker", "attnzoo.training.run"]


def start_method() -> str:
    """How workers start: "forkserver" (forked from a warm server) unless ATTNZOO_WORKER_START=spawn or the
    platform has no fork server (Windows), then "spawn" (a fresh `python -m attnzoo.cli.worker` each)."""
    import multiprocessing

    from attnzoo.config.errors import check

    method = os.environ.get(START_ENV, "forkserver")
    check(method in ("forkserver", "spawn"), START_ENV, f"{method!r}; allowed: forkserver, spawn")
    return method if method in multiprocessing.get_all_start_methods() else "spawn"


def _fork_context():
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(WORKER_MODULES)  # read when the server starts (a running server keeps its own)
    return ctx


def warm_workers() -> None:
    """Start the fork server the workers will be forked from, unless it runs already: it imports the training
    stack in the background while the launcher prepares the data (its first fork waits for it)."""
    if start_method() == "forkserver":
        from multiprocessing import forkserver

        _fork_context()
        forkserver.ensure_running()


class _Fd:
    """A file descriptor of the launcher handed to a forked worker (SCM_RIGHTS through the fork server)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):  # pickled while multiprocessing sends the process object: the fd travels with it
        from multiprocessing import reduction

        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup):
    return dup


def become_fresh_process(env: dict, cwd: str, stdout=None, stderr=None) -> None:
    """In a child forked from the fork server: take on what a process started for it with `env` in `cwd`, output to
    `stdout` / `stderr` (`_Fd`s; None: the server's, as multiprocessing leaves them), would have: that environment,
    directory and output; torch's thread count and Lightning's rank from that environment (both read at import, in
    the server's); the platform's default start
    method for the processes it starts (multiprocessing hands a forkserver child its own: a DataLoader's workers
    would come from a fork server of their own and, their parent not being the loader's process, outlive it)."""
    import multiprocessing

    import torch
    from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for target, handle in ((1, stdout), (2, stderr)):
        if handle is None:
            continue
        fd = handle.detach()
        os.dup2(fd, target)
        os.close(fd)
    multiprocessing.set_start_method(None, force=True)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    rank_zero_only.rank = _get_rank() or 0


def _forked_worker(job: str, env: dict, cwd: str, stdout, stderr) -> None:
    """A worker forked from the fork server, made what `python -m attnzoo.cli.worker <job>` started by this
    launcher would be (`become_fresh_process`); then the worker's main."""
    import atexit

    server = os.getppid()
    become_fresh_process(env, cwd, stdout, stderr)
    sys.argv = ["attnzoo.cli.worker", job]
    try:
        run_worker(job, server=server)
    finally:  # multiprocessing ends its children with os._exit: run what a process runs at exit (log flushes)
        atexit._run_exitfuncs()


def run_worker(job: str, server: int | None = None) -> None:
    """A DDP worker's life: train the job's resolved config as this process's rank (the environment says which).
    `server`: the fork server this worker was forked from, not its launcher (None: started as a process of its
    own, `python -m attnzoo.cli.worker`)."""
    from attnzoo.distributed.processes import die_with, die_with_parent

    if os.environ.get(LAUNCHER_ENV):  # first: a worker never outlives its launcher (no orphan after a SIGKILL)
        launcher = int(os.environ[LAUNCHER_ENV])
        # a forked worker's parent is the fork server (which lives while any of its children holds the pipe it
        # watches): the worker watches its launcher itself
        if server:
            die_with(launcher)
        else:
            die_with_parent(launcher)
    from attnzoo.config.errors import ConfigError
    from attnzoo.training.run import train

    try:
        train(OmegaConf.load(job))
    except ConfigError as e:  # a fault every rank reports alike (a full disk): one line, handed to the launcher
        write_worker_error(job, e)
        if not (os.environ.get(LAUNCHER_ENV) and os.environ.get("RANK") == "0"):  # rank 0's launcher says it
            print(f"attnzoo: error: {e}", file=sys.stderr)  # (the other ranks' stderr is their launch/ log)
        sys.exit(2)
    close_process_group()


def close_process_group() -> None:
    """Leave the process group together: without it, a rank that exits while another is still inside its
    last collective (rank 0 writes the summary after the final validation) makes gloo abort that other
    rank with SIGABRT at exit (seen as `exit code -6` on CI). A barrier, then an orderly destroy."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class _Forked:
    """A forked worker behind the part of subprocess.Popen's interface the launcher uses."""

    def __init__(self, proc):
        self.proc = proc
        self.pid = proc.pid

    def poll(self):
        return self.proc.exitcode

    def wait(self, timeout: float | None = None):
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired("attnzoo.cli.worker", timeout)
        return self.proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self.proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _start_worker(method: str, job: Path, env: dict, log: Path | None):
    """One worker on `job` with `env`; its output to `log`, or to the launcher's stdout / stderr."""
    out = open(log, "w") if log is not None else None
    try:
        if method == "spawn":
            return subprocess.Popen([sys.executable, "-m", "attnzoo.cli.worker", str(job)], env=env, stdout=out,
                                    stderr=subprocess.STDOUT if out else None)
        fds = (out.fileno(), out.fileno()) if out is not None else (1, 2)
        proc = _fork_context().Process(target=_forked_worker, name=f"attnzoo-worker-{env['RANK']}",
                                       args=(str(job), env, os.getcwd(), _Fd(fds[0]), _Fd(fds[1])))
        proc.start()
        return _Forked(proc)
    finally:
        if out is not None:
            out.close()  # the worker holds its own copy of the descriptor


def launch_workers(container: dict, out: Path, n: int, origin: tuple[str, float],
                   timeout: float | None = None) -> None:
    """Run the job on `n` local worker processes; raise RuntimeError (naming the rank and its log) on failure.
    `origin`: (kind, perf_counter) the workers' first_step_seconds count from (callbacks.command_start)."""
    method = start_method()
    launch_dir = out / "launch"
    launch_dir.mkdir(parents=True, exist_ok=True)
    job = launch_dir / "job.yaml"
    OmegaConf.save(OmegaConf.create(container), job)
    port = _free_port()
    kind, since = origin
    procs, logs = [], []
    threads = max(1, (os.cpu_count() or 1) // n)
    for rank in range(n):
        env = dict(os.environ)
        env.update({WORKER_ENV: "1", LAUNCHER_ENV: str(os.getpid()), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), "WORLD_SIZE": str(n), "NODE_RANK": "0", "LOCAL_RANK": str(rank),
                    "RANK": str(rank), "OMP_NUM_THREADS": str(threads), ORIGIN_ENV: f"{kind} {since!r}"})
        # rank 0 prints the progress bar and the summary; the others write launch/rank<N>.log
        logs.append(None if rank == 0 else launch_dir / f"rank{rank}.log")
        procs.append(_start_worker(method, job, env, logs[-1]))
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

