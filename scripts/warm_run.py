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
import subprocess
import sys
import tempfile


def _child(argv: list[str], env: dict, cwd: str, out, err) -> None:
    import atexit
    import runpy
    import time
    import warnings

    import attnzoo
    from attnzoo.training.launch import become_fresh_process

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
