"""`python -m MODULE ARGS` / `python -c CODE ARGS` as a process forked from a warm fork server.

What `subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=t)` gives (a
process of its own: pid, environment, working directory, stdout / stderr, exit code, a kill at the timeout), minus
the ~4-5 s of importing torch, Lightning and attnzoo on a 2-core machine: the child is forked from the fork server
the DDP launcher forks its workers from (attnzoo/training/launch.py), which imported them once and never computes.
The README checks (scripts/check_readme.py, tests/test_readme_*.py) run their commands this way.

The child starts as a fresh interpreter would for these commands (launch.become_fresh_process): the environment,
working directory and output are the caller's, torch's thread count, Lightning's rank and multiprocessing's start
method are a fresh process's, and attnzoo.STARTED (where a command's first_step_seconds counts from) is the fork. What differs: the imports were made under the server's
environment (read at import time by nothing attnzoo runs, besides the two just reset), and a `sitecustomize` or a
PYTHONPATH change in `env` reaches only modules not imported yet. `ATTNZOO_WORKER_START=spawn` (or a platform
without a fork server) runs a real `python` instead.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile


def _child(argv: list[str], env: dict, cwd: str, out, err, new_session: bool = False) -> None:
    import atexit
    import runpy
    import time
    import warnings

    import attnzoo
    from attnzoo.training.launch import become_fresh_process

    if new_session:  # Popen(start_new_session=True)
        os.setsid()
    become_fresh_process(env, cwd, out, err)
    attnzoo.STARTED = time.perf_counter()
    try:
        if argv[0] == "-m":
            # the module may be imported already (the server's preload): runpy says so; a fresh `python -m` runs it
            # as __main__ beside any copy other modules import, the same as here
            warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package",
                                    category=RuntimeWarning)
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    finally:  # multiprocessing ends its children with os._exit: flush, and run what a process runs at exit
        sys.stdout.flush()
        sys.stderr.flush()
        atexit._run_exitfuncs()


def run_python(argv: list[str], env: dict | None = None, timeout: float | None = None, cwd=None,
               fresh: bool = False) -> subprocess.CompletedProcess:
    """argv: ["-m", MODULE, *args] or ["-c", CODE, *args]. Returns a CompletedProcess with text stdout / stderr;
    raises subprocess.TimeoutExpired (the child killed) after `timeout` seconds. `fresh`: a real `python` process
    (what attnzoo-sweep needs: its loky workers with wandb never finished under a forked parent, not diagnosed)."""
    from attnzoo.training.launch import _Fd, _fork_context, start_method

    assert argv[0] in ("-m", "-c"), argv
    env = dict(os.environ if env is None else env)
    if fresh or start_method() == "spawn":
        return subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=cwd)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = _fork_context().Process(target=_child, args=(argv, env, str(cwd or os.getcwd()), _Fd(out.fileno()),
                                                            _Fd(err.fileno())), name=f"run {argv[1][:40]}")
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
    return subprocess.CompletedProcess([sys.executable, *argv], proc.exitcode, *texts)


class WarmProcess:
    """What `subprocess.Popen([sys.executable, *argv], env=env, stdout=PIPE, stderr=STDOUT, text=True)` gives the
    tests that signal a running command (pid, poll, send_signal, kill, wait, communicate, returncode, stdout.read),
    forked from the warm fork server as `run_python` (its output, stdout and stderr together, goes to a temporary
    file read back once it ends). `start_python` makes one."""

    def __init__(self, proc, out) -> None:
        self._proc, self._out = proc, out
        self.pid, self.args = proc.pid, None
        self.stdout = self  # `.stdout.read()`: the output so far

    @property
    def returncode(self):
        return self._proc.exitcode  # a signal's death is -signum, as Popen's

    def poll(self):
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._proc.exitcode

    def read(self) -> str:
        self._out.seek(0)
        return self._out.read().decode(errors="replace")

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        return self.read(), None


def start_python(argv: list[str], env: dict | None = None, cwd=None, start_new_session: bool = False):
    """`python ARGV` started and not waited for: a `WarmProcess` forked from the warm fork server (see the module's
    docstring for what differs from a fresh interpreter), or a real `subprocess.Popen` (stdout=PIPE, stderr=STDOUT,
    text) where the platform has no fork server or ATTNZOO_WORKER_START=spawn."""
    from attnzoo.training.launch import _Fd, _fork_context, start_method

    assert argv[0] in ("-m", "-c"), argv
    env = dict(os.environ if env is None else env)
    if start_method() == "spawn":
        return subprocess.Popen([sys.executable, *argv], env=env, cwd=cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=start_new_session)
    out = tempfile.TemporaryFile()
    proc = _fork_context().Process(target=_child, args=(argv, env, str(cwd or os.getcwd()), _Fd(out.fileno()),
                                                        _Fd(out.fileno()), start_new_session),
                                   name=f"start {argv[1][:40]}")
    proc.start()
    return WarmProcess(proc, out)
