"""What a run prints, and its copy in `<run dir>/train.log`.

- `RunProgressBar`: Lightning's tqdm bar counted in optimizer steps up to `trainer.max_steps` (runs stop there,
  not at an epoch's end), so its total and ETA are the run's; a resumed run's bar starts at its step.
- `RunHeader`: one line at the start (the model as built, parameters, training FLOPs per token) in place of
  Lightning's module table, whose FLOPs column reads 0 (Lightning counts FLOPs only with an
  `example_input_array`; attnzoo counts them analytically, docs/benchmarks.md).
- `ConsoleLog`: a copy of everything the run prints (stdout and stderr, Lightning's own logger lines included)
  in `train.log`; progress bars appear there as their final state, one line per bar, without the `\\r`
  redraws or cursor moves.
- `quiet_lightning()`: the two fixes to Lightning's start-up output (see there).
"""
from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_only


class RunProgressBar(TQDMProgressBar):
    """The training bar counts optimizer steps to `trainer.max_steps` (its total, so tqdm's ETA is the run's);
    the epoch stays in the description. Without max_steps (-1) it is Lightning's per-epoch bar. The logger's
    version (the run's overrides, under TensorBoard) is not repeated after every update."""

    def _steps_total(self, trainer) -> int | None:
        return trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        total = self._steps_total(trainer)
        if total is not None:
            bar = self.train_progress_bar
            bar.reset(total=total)
            bar.initial = bar.n = trainer.global_step  # a resumed run: the rate and ETA count this run's steps
            bar.set_description(f"Epoch {trainer.current_epoch}")
            bar.refresh()

    def on_train_epoch_start(self, trainer, *args) -> None:
        if self._steps_total(trainer) is None:
            super().on_train_epoch_start(trainer, *args)
        else:
            self.train_progress_bar.set_description(f"Epoch {trainer.current_epoch}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        total = self._steps_total(trainer)
        if total is None:
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        bar, step = self.train_progress_bar, trainer.global_step
        if bar is not None and not bar.disable and bar.n != step and self._should_update(step, total):
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._steps_total(trainer) is None:
            return super().on_train_epoch_end(trainer, pl_module)
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics


class RunHeader(L.Callback):
    """Prints, once at the start of training (rank 0), what is being trained:
    `attnzoo: training gqa x4 d_model=128 heads=4/2kv ... | params 1,000,576 (active 1,000,576) | 6.2 MFLOPs/token`.
    `describe(model) -> str` is the run summary's model line (attnzoo.training.summary.describe_model, passed in)."""

    def __init__(self, describe) -> None:
        self.describe = describe

    @rank_zero_only
    def on_fit_start(self, trainer, pl_module) -> None:
        from attnzoo.models.flops import train_flops_per_token

        describe_model, model = self.describe, pl_module.model
        ctx = getattr(getattr(trainer, "datamodule", None), "cfg", None)
        ctx = getattr(ctx, "seq_len", None)
        flops = f" | {train_flops_per_token(model, ctx) / 1e6:,.2f} MFLOPs/token (training, at {ctx} tokens)" if ctx else ""
        print(f"attnzoo: training {describe_model(model)} | params {model.num_params():,} "
              f"(active {model.active_params():,}){flops}", flush=True)


# ------------------------------------------------------------------------------------------ Lightning's output

_TIP = "💡 Tip:"


class _NoAdvertTips(logging.Filter):
    """Drops Lightning's "💡 Tip: ... try installing litlogger / litmodels" lines (logged through rank_zero_info
    whenever no LitLogger / LitModelCheckpoint is used; Lightning has no setting that turns them off)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_TIP)


def quiet_lightning() -> None:
    """Idempotent; called before a Trainer is built.

    1. The litlogger / litmodels tips: filtered on the logger they are emitted through
       (`lightning.pytorch.utilities.rank_zero`), nothing else of Lightning's output is touched.
    2. The FutureWarning "`isinstance(treespec, LeafSpec)` is deprecated" printed by every fit: Lightning 2.6's
       CombinedLoader flattens the dataloaders with its own `_tree_flatten`, which still constructs
       `torch.utils._pytree.LeafSpec()` (deprecated since torch 2.9, Lightning-AI/pytorch-lightning#21326).
       Torch's replacement is `treespec_leaf()` (the same leaf spec, pytorch/pytorch#160843); Lightning's module
       gets that constructor, so the deprecated class is no longer instantiated. Nothing is silenced: a
       deprecation raised anywhere else still shows."""
    rank_zero_logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _NoAdvertTips) for f in rank_zero_logger.filters):
        rank_zero_logger.addFilter(_NoAdvertTips())
    import torch.utils._pytree as torch_pytree
    from lightning.pytorch.utilities import _pytree as lightning_pytree

    if hasattr(torch_pytree, "treespec_leaf") and getattr(lightning_pytree, "LeafSpec", None) is torch_pytree.LeafSpec:
        lightning_pytree.LeafSpec = torch_pytree.treespec_leaf


# ------------------------------------------------------------------------------------------ train.log

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class _Tee:
    """A text stream that writes to `stream` and hands the same text to `sink` (ConsoleLog)."""

    def __init__(self, stream, sink: "ConsoleLog", name: str):
        self._stream, self._sink, self._name = stream, sink, name

    def write(self, text: str) -> int:
        self._sink.feed(self._name, text)
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding, ...: the console's own
        return getattr(self._stream, name)


class ConsoleLog:
    """Copies what this process prints (sys.stdout, sys.stderr, and logging handlers that write to them, as
    Lightning's does) into `path`, appended, between `__enter__` and `__exit__`. Text printed before `start()`
    is held in memory and written at `start()` (the run was accepted), or dropped if it never comes (a refused
    run leaves the run dir as it was). Each stream's text goes to the file line by line: a line redrawn with
    `\\r` (progress bars) as its last state, terminal escape sequences removed."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self._file = None
        self._held: list[str] = []
        self._partial = {"stdout": "", "stderr": ""}
        self._saved: list = []

    def __enter__(self) -> "ConsoleLog":
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(out, self, "stdout"), _Tee(err, self, "stderr")
        self._saved = [("sys", out, err)]
        for handler in _stream_handlers((out, err)):
            self._saved.append((handler, handler.stream))
            handler.setStream(sys.stdout if handler.stream is out else sys.stderr)
        return self

    def start(self) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
            self._file.writelines(self._held)
            self._file.flush()
            self._held = []

    def feed(self, name: str, text: str) -> None:
        lines = (self._partial[name] + text).split("\n")
        self._partial[name] = lines.pop()
        if lines:
            self._emit([_ANSI.sub("", line.rsplit("\r", 1)[-1]) + "\n" for line in lines])

    def _emit(self, lines: list[str]) -> None:
        lines = [ln for ln in lines if ln.strip()]
        if self._file is None:
            self._held.extend(lines)
        else:
            self._file.writelines(lines)
            self._file.flush()

    def __exit__(self, *exc) -> None:
        for entry in reversed(self._saved):
            if entry[0] == "sys":
                sys.stdout.flush()
                sys.stderr.flush()
                sys.stdout, sys.stderr = entry[1], entry[2]
            else:
                entry[0].setStream(entry[1])
        self._emit([_ANSI.sub("", p.rsplit("\r", 1)[-1]) + "\n" for p in self._partial.values() if p])
        if self._file is not None:
            self._file.close()
            self._file = None


def _stream_handlers(streams) -> list[logging.StreamHandler]:
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    return [h for lg in loggers for h in lg.handlers
            if type(h) is logging.StreamHandler and any(h.stream is s for s in streams)]


# refused runs: is_new_run_dir / remove_new_run_dir live in rundir.py (no Lightning: the CLI uses them first)
from attnzoo.training.rundir import is_new_run_dir, remove_new_run_dir  # noqa: E402,F401
