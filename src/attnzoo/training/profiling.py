"""perf.profile: a torch.profiler trace of a window of training steps, written into the run folder.

    <run>/profile/trace.json           Chrome / Perfetto trace (chrome://tracing, https://ui.perfetto.dev)
    <run>/profile/top_ops.txt          torch.profiler's key_averages table, by self time
    <run>/profile/memory_snapshot.pickle   on CUDA: the allocator's history over the window
                                       (torch.cuda.memory._dump_snapshot; https://pytorch.org/memory_viz)

The window: `perf.profile_wait` optimizer steps are skipped (the first steps pay one-off costs: allocation, kernel
selection, compilation), then `perf.profile_steps` steps are recorded. The summary gets the trace's path, the steps
and the top ops (summary.json "profile", the printed summary's `profile` line)."""
from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

TOP_OPS = 8  # ops in the summary


class ProfileWindow(L.Callback):
    """Records optimizer steps [wait, wait + steps) of this process with torch.profiler (CPU, and CUDA when the
    model runs there), then writes the trace. Rank 0 only (each rank's trace would be the same program)."""

    def __init__(self, out: Path, wait: int, steps: int) -> None:
        self.folder = Path(out) / "profile"
        self.wait, self.steps = wait, steps
        self.prof = None
        self.record: dict | None = None
        self._first = None  # the optimizer step the window opened at
        self._memory = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self.prof is not None or self.record is not None or not trainer.is_global_zero:
            return
        step = trainer.global_step
        if step < self.wait or batch_idx % trainer.accumulate_grad_batches:  # a window opens at an optimizer step
            return
        from torch.profiler import ProfilerActivity, profile

        cuda = pl_module.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        if cuda:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            self._memory = True
        self.prof = profile(activities=activities, record_shapes=True, with_stack=False)
        self.prof.__enter__()
        self._first = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.prof is not None and trainer.global_step >= self._first + self.steps:
            self._finish(pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.prof is not None:  # the run ended inside the window: what was recorded
            self._finish(pl_module)

    def _finish(self, pl_module) -> None:
        last = self._first + self.steps
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / "trace.json"
        self.prof.export_chrome_trace(str(trace))
        cuda = pl_module.device.type == "cuda"
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        averages = self.prof.key_averages()
        (self.folder / "top_ops.txt").write_text(averages.table(sort_by=sort, row_limit=40) + "\n")
        if self._memory:
            torch.cuda.memory._dump_snapshot(str(self.folder / "memory_snapshot.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        ops = sorted(averages, key=lambda e: getattr(e, sort), reverse=True)[:TOP_OPS]
        steps = max(1, min(last, pl_module.trainer.global_step) - self._first)
        self.record = {
            "trace": str(trace), "steps": [self._first, self._first + steps], "sorted_by": sort,
            "top_ops": [{"name": e.key, "calls": e.count, "self_ms_per_step": getattr(e, sort) / 1000 / steps}
                        for e in ops],
        }
        self.prof = None

    def summary_section(self) -> dict:
        return {"profile": self.record} if self.record else {}
