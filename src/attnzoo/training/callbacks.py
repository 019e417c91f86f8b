"""Callbacks: throughput / MFU / memory metrics logged during training; the run's checkpoints (the final
step's last.ckpt, best.ckpt over every validation, a preempted run's last.ckpt)."""
from __future__ import annotations

import os
import resource
import sys
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from attnzoo.distributed.checkpoint_files import step_checkpoint
from attnzoo.models.flops import peak_flops, train_flops_per_token


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return int(rss if sys.platform == "darwin" else rss * 1024)


def command_start() -> tuple[str, float]:
    """Where a run's wait for its first step is counted from: ("command", attnzoo.STARTED, its first import) in a
    process started as an attnzoo command (a console script, `python -m attnzoo.cli.*`), else ("train()", now): a
    library call in a longer-lived process (a notebook, pytest) times from the call. A DDP worker counts from its
    launcher's origin (ATTNZOO_COMMAND_START, training/launch.py): the wait includes starting the workers.
    time.perf_counter is CLOCK_MONOTONIC, one clock for every process of the machine."""
    import os
    import sys

    from attnzoo.training.launch import ORIGIN_ENV

    inherited = os.environ.get(ORIGIN_ENV)  # a DDP worker: its launcher's
    if inherited:
        kind, since = inherited.split()
        return kind, float(since)
    # the process's __main__, not sys.argv: argv is a global an in-process caller may rewrite (lm_eval's command
    # line is given through it), __main__ is fixed when the process starts
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    script = os.path.basename(getattr(main, "__file__", None) or "")
    if script.startswith("attnzoo-") or (spec is not None and spec.name.startswith("attnzoo.cli.")):
        # the package, imported before any of its modules (read, not imported: attnzoo/__init__ imports the api,
        # a layer above this one)
        return "command", sys.modules["attnzoo"].STARTED
    return "train()", time.perf_counter()


class ThroughputMonitor(L.Callback):
    """Logs perf/tokens_per_sec (all ranks), perf/step_ms, perf/flops_per_token, perf/mfu, mem/peak_bytes.

    Timed over windows of `window` optimizer steps of wall-clock time between batch ends (data loading
    and logging included, validation excluded); tokens are counted per micro-batch, so gradient
    accumulation does not inflate the rate. No host sync is added to the step.
    """

    def __init__(self, context_len: int, compute_dtype: torch.dtype, peak_override: float | None = None,
                 window: int = 10, cache_dir: str | None = None):
        self.context_len = context_len
        self.compute_dtype = compute_dtype  # the peak is this dtype's (ops/dispatch.run_compute_dtype)
        self.peak_override = peak_override
        self.cache_dir = cache_dir  # where a measured peak is kept (models/flops.cached_measurement)
        self.window = window
        self.peak = None
        self.peak_source = ""
        self.flops_per_token = 0.0
        self.last: dict = {}
        # seconds from the command's start to the end of this process's first optimizer step (imports, config,
        # data, model, checkpoint and the first step itself: what a user waits before training starts)
        self.first_step_seconds: float | None = None
        self.first_step_origin, self._origin = command_start()
        self._reset()

    def _reset(self) -> None:
        self._t0 = None  # start of the current timed stretch (None while paused)
        self._elapsed = 0.0  # seconds of training in this window before the current stretch
        self._tokens = 0
        self._steps = 0

    def _pause(self) -> None:
        if self._t0 is not None:
            self._elapsed += time.perf_counter() - self._t0
            self._t0 = None

    def on_fit_start(self, trainer, pl_module) -> None:
        model = pl_module.model
        self.flops_per_token = train_flops_per_token(model, self.context_len)
        self.peak, self.peak_source = peak_flops(pl_module.device, self.compute_dtype, self.peak_override,
                                                    self.cache_dir)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        # a module may say what a token is (image classifiers: patches per image); default: the input ids
        count = getattr(pl_module, "tokens_in_batch", None)
        self._tokens += count(batch) if count is not None else batch[0].numel()
        self._steps += 1
        if self.first_step_seconds is None and self._steps >= trainer.accumulate_grad_batches:
            self.first_step_seconds = time.perf_counter() - self._origin
        if self._steps >= self.window * trainer.accumulate_grad_batches:
            pl_module.log_dict(self._measure(trainer, pl_module), on_step=True, on_epoch=False)

    def on_train_end(self, trainer, pl_module) -> None:
        # runs shorter than one window (smoke runs) still report their throughput
        if self._steps > 0 and not self.last:
            metrics = self._measure(trainer, pl_module)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def _measure(self, trainer, pl_module) -> dict:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        self._pause()
        dt = self._elapsed
        world = trainer.world_size
        tps = self._tokens * world / dt
        opt_steps = self._steps / trainer.accumulate_grad_batches
        self.last = {
            "perf/tokens_per_sec": tps,
            "perf/step_ms": 1000.0 * dt / opt_steps,
            "perf/flops_per_token": self.flops_per_token,
            "perf/mfu": tps * self.flops_per_token / (self.peak * world),
            "mem/peak_bytes": float(peak_memory_bytes(pl_module.device)),
        }
        self._reset()
        return self.last

    def on_validation_start(self, trainer, pl_module) -> None:
        self._pause()  # validation and checkpoint time is not training throughput

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._pause()

    def state_dict(self) -> dict:
        """The window in progress goes into the checkpoint, so a resumed run logs its throughput at the same
        steps as an uninterrupted one (the first window after a resume counts only training time, the restart
        excluded)."""
        running = 0.0 if self._t0 is None else time.perf_counter() - self._t0
        return {"elapsed": self._elapsed + running, "tokens": self._tokens, "steps": self._steps}

    def load_state_dict(self, state: dict) -> None:
        self._t0 = None
        self._elapsed, self._tokens, self._steps = float(state["elapsed"]), int(state["tokens"]), int(state["steps"])


class TrainingSpend(L.Callback):
    """Logs `train/tokens` and `train/flops` after every optimizer step: what the run has trained on so far,
    all ranks together (steps x tokens per step, x the model's training FLOPs per token; attnzoo/config/stops.py),
    counted from what the run had spent when it started (`length.start`: a resumed run's checkpoint holds this
    callback's count, `state_dict`). A data module that counts what its loader delivered (data=shards:
    `tokens_seen()`, from the consumed position) adds `train/tokens_seen`, the same count from the data side
    (ahead of train/tokens by the micro-batches of an optimizer step in progress); one that mixes sources
    (data.mixture: `tokens_by_source()`) adds `data/tokens/<name>` per source."""

    def __init__(self, length) -> None:
        self.length = length
        self._trainer = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._trainer = trainer

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        spent = self.length.spent_at(trainer.global_step)
        metrics = {"train/tokens": float(spent.tokens), "train/flops": float(spent.flops)}
        seen = getattr(trainer.datamodule, "tokens_seen", None)
        if seen is not None and seen() is not None:
            metrics["train/tokens_seen"] = float(seen())
        by_source = getattr(trainer.datamodule, "tokens_by_source", lambda: None)()  # data.mixture: per source
        metrics.update({f"data/tokens/{name}": float(n) for name, n in (by_source or {}).items()})
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)

    def state_dict(self) -> dict:
        """The count at the checkpoint's step, read back before a resumed run is sized (training/build.py)."""
        step = self._trainer.global_step if self._trainer is not None else self.length.start.steps
        spent = self.length.spent_at(step)
        return {"steps": spent.steps, "tokens": spent.tokens, "flops": spent.flops}


class PreemptionCheckpoint(L.Callback):
    """On SIGTERM (what SLURM sends before preemption) every rank stops after the same batch and this writes
    last.ckpt (atomically) so a requeued job resumes.

    Lightning's own SIGTERM handler broadcasts from inside the signal handler, at whatever moment the signal
    lands - under DDP that collective can interleave with the backward's asynchronous all-reduce (gloo: a
    reset connection, an aborted rank), and each rank then stops after the batch in which *its* signal
    arrived, which need not be the same batch. So during training the handler here only notes the signal,
    and at the end of every batch the ranks agree (one all-reduce of a 1-element flag: any rank signalled)
    before Lightning's flag is set on all of them at once; Lightning then raises SIGTERMException after that
    same batch everywhere.

    Without a host sync in the step: the agreed flag of one batch is read at the end of the next (copied to
    the host behind the batch's kernels, with an event; by then the copy is long done), so every rank stops one
    batch after the signal, the same batch everywhere, and the GPU queue is never drained to read it."""

    def __init__(self, path):
        self.path = str(path)
        self._signalled = False
        self._agreed = None  # (device flag, host copy, copy event) of the previous batch

    def on_train_start(self, trainer, pl_module) -> None:
        import signal
        import threading

        # Lightning registered its handler when the run started (trainer._run); replace it for the training
        # loop (its teardown restores the handler the process had before fit)
        self._agreed = None
        if threading.current_thread() is threading.main_thread():
            self._signalled = False
            signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum, frame) -> None:
        self._signalled = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized() and trainer.world_size > 1):
            if self._signalled:
                trainer._signal_connector.received_sigterm = True
            return
        if self._agreed is None:
            device = trainer.strategy.root_device
            cuda = device.type == "cuda"
            self._agreed = (torch.zeros(1, dtype=torch.int32, device=device),
                            torch.zeros(1, dtype=torch.int32, pin_memory=cuda), torch.cuda.Event() if cuda else None)
        else:  # the previous batch's agreement, on the host since that batch: no wait here
            flag, host, event = self._agreed
            if event is not None:
                event.synchronize()
            if host.item():
                trainer._signal_connector.received_sigterm = True
                return
        flag, host, event = self._agreed
        flag.fill_(1 if self._signalled else 0)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        host.copy_(flag, non_blocking=event is not None)
        if event is not None:
            event.record()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if isinstance(exception, SIGTERMException):
            trainer.save_checkpoint(self.path)
            for lg in trainer.loggers:  # the curves up to this checkpoint on disk too
                lg.save()


class RunCheckpoint(ModelCheckpoint):
    """ModelCheckpoint whose files say what their names say at the end of a run.

    Lightning writes `last.ckpt` only on its schedule (every_n_train_steps) and on train end only when it
    never wrote one, so a run of 8 steps checkpointed every 3 ended with last.ckpt at step 6 while its
    summary described step 8. Here the end of training always writes last.ckpt at the final step (through
    the trainer's atomic checkpoint IO: temp file, fsync, rename). `best.ckpt` also considers the end-of-run
    validation of the final weights (`consider_final_validation`, called after it), so it holds the best
    monitored value of every validation the run made, the final one included.

    The state key stays ModelCheckpoint's, so checkpoints written before this class existed resume with
    their best score."""

    @property
    def state_key(self) -> str:
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.save_last and self._last_global_step_saved != trainer.global_step and not trainer.fast_dev_run:
            # the module's non-finite check of the last step first (on a GPU it reads the flag a step late,
            # in its own on_train_end, which Lightning calls after this): no non-finite weights in last.ckpt
            check_deferred = getattr(pl_module, "_check_deferred", None)
            if check_deferred is not None:
                check_deferred()
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def load_state_dict(self, state_dict: dict) -> None:
        """A resume from last.ckpt: that file was written before the end-of-run validation, which may have
        replaced best.ckpt since; best.ckpt's own record of the best is then the current one."""
        super().load_state_dict(state_dict)
        path = self.best_model_path
        if self.monitor and path and os.path.exists(path) and self.dirpath == state_dict.get("dirpath"):
            # a sharded checkpoint (trainer=fsdp) keeps its callbacks in the folder's meta.pt
            meta = os.path.join(path, "meta.pt") if os.path.isdir(path) else path
            try:
                own = torch.load(meta, map_location="cpu", weights_only=True, mmap=True)["callbacks"][self.state_key]
            except (OSError, RuntimeError, KeyError, ValueError):
                return  # unreadable: keep the record from the resumed checkpoint
            if own.get("best_model_path") == path:
                super().load_state_dict(own)

    def consider_final_validation(self, trainer) -> None:
        """After `trainer.validate` of the final weights (all ranks): keep them as best.ckpt if their
        monitored value beats the best so far (Lightning skips saving outside fit)."""
        candidates = self._monitor_candidates(trainer)
        if self.monitor and self.save_top_k and self.monitor in candidates and not trainer.fast_dev_run:
            self._save_topk_checkpoint(trainer, candidates)


class KeepSteps(L.Callback):
    """Saves `checkpoints/step-<N>.ckpt` at each of the given optimizer steps (callbacks.branch_budgets: where the
    cooldowns of FLOP budgets start, docs/recipes.md), once each, through the trainer (file or sharded folder)."""

    def __init__(self, run_dir, steps) -> None:
        self.run_dir = run_dir
        self.steps = set(int(s) for s in steps)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step in self.steps:  # after the optimizer step that reached it (micro-batches after it: not again)
            self.steps.discard(step)
            trainer.save_checkpoint(step_checkpoint(self.run_dir, step))
