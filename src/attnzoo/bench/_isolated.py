"""Checks that must end: named cases run one by one in a worker process the parent kills at a per-case limit or
when a budget runs out (attnzoo-bench gpu_check).

A signal in the main thread (signal.alarm) could not bound them: a hung Triton compile or autotune, or a kernel that
never returns, sits in C code that never reaches the Python interpreter's signal check; a killed process always
ends, and the driver frees its GPU memory. One worker runs the cases in order (so fla kernels compiled and autotuned
for one case serve the next; Triton's disk cache also survives a killed worker); after a kill or a crash a fresh
worker takes the remaining cases. On CUDA the worker is spawned (CUDA cannot be used in a forked child); on a CPU it
is forked (fast, and it sees the cases a test swaps in).

The module that owns the cases (`cases_module`, imported by name in the worker) has `CASES` (objects with `.name`)
and `check_case(case, ctx, on_first=...) -> row dict`; `ctx` has `.device` and `.threads` and is picklable.
"""
from __future__ import annotations

import importlib
import math
import time
from typing import Callable, Optional

import torch

START_METHOD = {"cuda": "spawn", "cpu": "fork"}


def worker(cases_module: str, names: list, ctx, conn) -> None:
    """The child: runs the named cases of `cases_module`.CASES in order, telling the parent ("start", name),
    ("first", seconds) and ("row", row) as each goes, and starting the next case once the parent has written the
    row (its reply)."""
    torch.set_num_threads(ctx.threads)
    mod = importlib.import_module(cases_module)
    by_name = {c.name: c for c in mod.CASES}
    for name in names:
        conn.send(("start", name))
        conn.send(("row", mod.check_case(by_name[name], ctx, on_first=lambda s: conn.send(("first", s)))))
        conn.recv()
    conn.close()


def run_cases(cases_module: str, names: list, ctx, *, case_limit: float, budget: Optional[float],
              row_of: Callable[[str], dict], on_row: Callable[[dict], None]) -> list:
    """Every named case's row, in order, each handed to `on_row` as it ends: the worker's row, or `row_of(name)`
    with the status `timeout` (the case passed `case_limit` seconds, first call and check together, or the `budget`
    ran out while it ran), `error` (the worker died in it) or `not run` (the budget ran out before it started)."""
    import multiprocessing

    mp = multiprocessing.get_context(START_METHOD[ctx.device.type])
    deadline = time.monotonic() + budget if budget else math.inf
    pending, rows = list(names), []

    def emit(row: dict) -> None:
        rows.append(row)
        pending.remove(row["case"])
        on_row(row)

    while pending and time.monotonic() < deadline:
        conn, child = mp.Pipe()
        proc = mp.Process(target=worker, args=(cases_module, list(pending), ctx, child), daemon=True, name="gpu_check-worker")
        proc.start()
        child.close()
        current = started = first_s = None
        try:
            while pending:
                now = time.monotonic()
                limit_at = started + case_limit if current else math.inf
                wait = min(deadline, limit_at) - now
                if not conn.poll(None if wait == math.inf else max(0.0, wait)):  # the limit or the budget is reached
                    if current is None:  # between cases (the worker starting): what is left is not run
                        break
                    phase = "the first call" if first_s is None else "the check"
                    why = (f"> {case_limit:g} s per case, in {phase}" if limit_at <= deadline
                           else f"the --budget of {budget:g} s ran out in {phase}")
                    emit({**row_of(current), "status": f"timeout ({why})", "first s": first_s,
                          "check s": None if first_s is None else time.monotonic() - started - first_s})
                    break
                try:
                    kind, payload = conn.recv()
                except EOFError:  # the worker died: a crash in a kernel, the out-of-memory killer
                    proc.join(5)
                    if current is None:
                        for name in list(pending):
                            emit({**row_of(name), "status": f"error: the worker process exited "
                                  f"(code {proc.exitcode}) before running a case"})
                        break
                    emit({**row_of(current), "status": f"error: the worker process died in this "
                          f"case (exit code {proc.exitcode})", "first s": first_s})
                    break
                if kind == "start":
                    current, started, first_s = payload, time.monotonic(), None
                elif kind == "first":
                    first_s = payload
                else:
                    emit(payload)  # written before the worker goes on
                    current = None
                    conn.send("next")
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join()
            conn.close()
    for name in list(pending):
        emit({**row_of(name), "status": f"not run (the --budget of {budget:g} s ran out)"})
    return rows
