"""The run's file loggers: a CSV logger whose `metrics.csv` survives a resume, and a TensorBoard logger
that fills the HParams tab and writes one event file per run.

Lightning's CSVLogger deletes an existing metrics file when it starts, so every resumed run lost the
curve before the resume step (and the sweep report's curves started there). `ResumableCSVLogger` keeps
the rows logged before the checkpoint's step, drops the ones after it (the resumed run logs those steps
again) and appends from there; a fresh run starts a fresh file as before.
"""
from __future__ import annotations

import csv
import os
from typing import Optional

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter


def _write_atomically(path: str, keys: list, rows: list) -> None:
    """Rewrite a CSV through a temp file and os.replace: a kill mid-write leaves the old file, never a
    truncated one (Lightning rewrites metrics.csv in place whenever a new column appears)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _ContinuingWriter(ExperimentWriter):
    def __init__(self, log_dir: str, keep_before: Optional[int]) -> None:
        self.keep_before = keep_before
        super().__init__(log_dir)

    def _rewrite_with_new_header(self, fieldnames: list) -> None:
        with open(self.metrics_file_path, newline="") as f:
            rows = list(csv.DictReader(f))
        _write_atomically(self.metrics_file_path, fieldnames, rows)

    def _check_log_dir_exists(self) -> None:
        if self.keep_before is None or not os.path.isfile(self.metrics_file_path):
            super()._check_log_dir_exists()  # a fresh run: an old file is removed
            return
        with open(self.metrics_file_path, newline="") as f:
            reader = csv.DictReader(f)
            keys = list(reader.fieldnames or [])
            rows = [r for r in reader if r.get("step") and int(float(r["step"])) < self.keep_before]
        _write_atomically(self.metrics_file_path, keys, rows)
        self.metrics_keys = sorted(keys)  # new columns later rewrite the header, as Lightning does


class ResumableCSVLogger(CSVLogger):
    """CSVLogger(save_dir, name, version) that continues `metrics.csv` from `resume_step` when given."""

    def __init__(self, *args, resume_step: Optional[int] = None, **kwargs) -> None:
        # every logged row goes to disk at once (an append of a few rows): Lightning's default keeps 100 steps
        # in memory, and it logs a step after the callbacks (checkpoints) of that step ran, so a SIGKILL lost
        # rows from before the checkpoint the run resumes from
        kwargs.setdefault("flush_logs_every_n_steps", 1)
        super().__init__(*args, **kwargs)
        self._resume_step = resume_step

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuingWriter(self.log_dir, self._resume_step)
        return self._experiment

    @rank_zero_only
    def log_metrics(self, metrics: dict, step: Optional[int] = None) -> None:
        # RowBeforeCheckpoint wrote this step's row already, before the checkpoint of the same batch: the
        # loop's own call repeats it (plus anything logged by later callbacks): write only what is new
        last_step, last = getattr(self, "_last_row", (None, {}))
        values = {k: float(v) for k, v in metrics.items()}
        if step == last_step and all(values.get(k) == v for k, v in last.items()):
            new = {k: v for k, v in values.items() if k not in last or k == "epoch"}
            self._last_row = (step, {**last, **values})
            if set(new) - {"epoch"}:
                super().log_metrics(new, step)
            return
        self._last_row = (step, values)
        super().log_metrics(metrics, step)

    def after_save_checkpoint(self, checkpoint_callback) -> None:
        """Every checkpoint also puts the rows logged so far on disk (Lightning flushes every 100 steps): a
        SIGKILL then loses only rows after the last checkpoint, which the resumed run logs again."""
        self.save()


class RowBeforeCheckpoint(Callback):
    """Puts a training step's CSV row on disk before the checkpoint callbacks of the same batch run.

    Lightning calls the callbacks' on_train_batch_end (ModelCheckpoint writes last.ckpt at global step N)
    before it logs that batch's metrics (as step N-1), so a SIGKILL between the two lost row N-1 for good:
    the run resumes from step N. Placed before the checkpoint callbacks, this logs the same row to the CSV
    logger first; the loop's own call then repeats it, and the CSV logger skips the exact repeat."""

    def __init__(self, csv_logger: "ResumableCSVLogger") -> None:
        self.csv = csv_logger

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars

        conn = trainer._logger_connector
        if trainer.fit_loop._should_accumulate() or not conn.should_update_logs:
            return
        metrics = convert_tensors_to_scalars(dict(conn.metrics["log"]))
        if not metrics:
            return
        if "step" in metrics:  # the same step and keys as LoggerConnector.log_metrics will use
            step = int(metrics.pop("step"))
        else:
            metrics.setdefault("epoch", trainer.current_epoch)
            step = trainer.fit_loop.epoch_loop._batches_that_stepped
        self.csv.log_metrics(metrics, step)


# what the HParams tab lists per run (those present), as hparams/<name> so the single end-of-run points do
# not sit among the training curves
HPARAM_METRICS = ("val/acc", "val/loss", "val/ppl", "train/loss", "perf/tokens_per_sec", "perf/mfu",
                  "cache/bytes_per_token", "cache/bytes_at_ctx", "params/total", "perf/decode_tokens_per_sec")


# after a run's own overrides, the fields every run's HParams row shows (those present in its config)
KEY_HPARAMS = ("model.name", "model.pattern", "model.mixer.name", "model.d_model", "model.n_layers", "model.n_heads",
               "model.n_kv_heads", "model.ffn.name", "model.position.name", "data.name", "data.seq_len",
               "data.batch_size", "optim.lr", "scheduler.name", "trainer.max_steps", "trainer.precision", "seed")
_NOT_HPARAMS = ("hydra", "paths", "ckpt_path", "sweeps", "logger")  # where a run writes, not what it is


def run_hparams(flat_config: dict, overrides: list[str]) -> dict:
    """The HParams tab's columns for one run, in order: the run's own overrides (under a sweep: the swept keys,
    the same in every job, so the columns that vary come first; `model/mixer=gqa` as `model/mixer: gqa`), then
    KEY_HPARAMS. Not the whole config: its ~100 constant columns, `callbacks.*` first, buried the few that vary
    (the whole config stays in hparams.yaml and summary.json)."""
    params: dict = {}
    for override in overrides:
        key, _, value = str(override).lstrip("+~").partition("=")
        if key.split(".")[0].split("/")[0] in _NOT_HPARAMS:
            continue
        params[key] = flat_config.get(key, value)
    for key in KEY_HPARAMS:
        if key in flat_config:
            params.setdefault(key, flat_config[key])
    return {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in params.items()}


class RunTensorBoardLogger(TensorBoardLogger):
    """TensorBoard with the HParams tab filled: `log_final(hparams, metrics, step)` declares the experiment, its
    hyper-parameters (`run_hparams`: the run's overrides first, then the key fields) and its metrics, the final
    values as `hparams/<name>` (HPARAM_METRICS), so the runs of a sweep are compared on what was swept. One
    event file per run: Lightning closes the writer at the end of `fit`, and the final validation and the
    hparams would each open another; here `finalize` flushes and `log_final` closes."""

    def finalize(self, status: str) -> None:
        if self._experiment is not None:
            self._experiment.flush()
        if status == "success":
            self.save()

    def log_final(self, hparams: dict, metrics: dict, step: int) -> None:
        final = {f"hparams/{k}": float(metrics[k]) for k in HPARAM_METRICS if k in metrics}
        self.log_hyperparams(hparams, metrics=final, step=step)
        if self._experiment is not None:
            self._experiment.flush()
            self._experiment.close()
        self.save()
