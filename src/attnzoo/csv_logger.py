"""A CSV logger whose `metrics.csv` survives a resume.

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
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter


class _ContinuingWriter(ExperimentWriter):
    def __init__(self, log_dir: str, keep_before: Optional[int]) -> None:
        self.keep_before = keep_before
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        if self.keep_before is None or not os.path.isfile(self.metrics_file_path):
            super()._check_log_dir_exists()  # a fresh run: an old file is removed
            return
        with open(self.metrics_file_path, newline="") as f:
            reader = csv.DictReader(f)
            keys = list(reader.fieldnames or [])
            rows = [r for r in reader if r.get("step") and int(float(r["step"])) < self.keep_before]
        with open(self.metrics_file_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
        self.metrics_keys = sorted(keys)  # new columns later rewrite the header, as Lightning does


class ResumableCSVLogger(CSVLogger):
    """CSVLogger(save_dir, name, version) that continues `metrics.csv` from `resume_step` when given."""

    def __init__(self, *args, resume_step: Optional[int] = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._resume_step = resume_step

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuingWriter(self.log_dir, self._resume_step)
        return self._experiment
