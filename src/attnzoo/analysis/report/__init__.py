"""`attnzoo-report <multirun dir>`: a sweep report built offline from the jobs' own files.

For every job directory (one holding `.hydra/overrides.yaml` or `summary.json`) it reads summary.json
(status, final metrics, the resolved config), csv/metrics.csv (curves) and .hydra/overrides.yaml, and
writes into the multirun dir:

  report.csv    one row per job: job, status, overrides, every final metric (the exact summary.json
                numbers), steps, wall seconds, error
  report.md     the best-of-learning-rate table (one row per variant) and the full per-job table
  plots/*.png   matplotlib, for papers: curves.png (loss / accuracy vs step, best lr per variant),
                acc_vs_cache.png (val/acc or val/loss vs cache/bytes_per_token), tokens_per_sec.png,
                mqar_difficulty.png (MQAR accuracy vs key-value pairs per mixer, one panel per width),
                recall_vs_state.png (MQAR accuracy vs cache/bytes_at_ctx, Zoology's view), lengths.png
  report.html   self-contained and offline (plotly.js embedded once): the same charts as Plotly figures
                (hover, zoom, legend toggling) and the tables as Plotly tables (sort and filter menus)

A *variant* is a job's swept overrides minus `optim.lr` and `seed`; its best learning rate is the one with the
best `val/acc` (max) or, without accuracy, `val/loss` (min) — the Zoology convention of best-of-lr — averaged
over seeds when seeds are swept (the row then shows the means and the spread; the charts, error bars).

Modules: load (job dirs -> jobs, variants, best-of-lr), tables (CSV, markdown and the tables' cells),
charts (what each plot shows, once), plots (matplotlib PNGs), figures / datatable (Plotly charts and
tables), page (report.html), build (build_report), cli (main).
"""
from attnzoo.analysis.report.build import build_report
from attnzoo.analysis.report.cli import main

__all__ = ["build_report", "main"]
