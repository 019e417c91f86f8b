"""The report's tables: report.csv (every job, full precision), and the best-of-lr, length-extrapolation and
all-jobs tables as cells (text, sort value) that report.md and report.html both show."""
from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Any

from attnzoo.analysis.report.load import finite

METRIC_ORDER = ["val/acc", "val/loss", "val/ppl", "train/loss", "perf/tokens_per_sec", "cache/bytes_per_token",
                "params/total", "params/active", "params/non_embedding", "perf/step_ms", "perf/mfu", "perf/flops_per_token",
                "cache/bytes_at_ctx", "perf/decode_tokens_per_sec", "mem/peak_bytes"]
MD_METRICS = ["val/acc", "val/loss", "val/ppl", "perf/tokens_per_sec", "cache/bytes_per_token", "params/total"]

# a table cell: the text shown and the number it sorts by (None: it sorts by its text)
Cell = tuple[str, Any]


def metric_columns(jobs: list[dict]) -> list[str]:
    present = {k for j in jobs for k in j["metrics"]}
    return [k for k in METRIC_ORDER if k in present] + sorted(present - set(METRIC_ORDER))


def write_csv(jobs: list[dict], path: Path) -> None:
    cols = metric_columns(jobs)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["job", "status", "overrides", "mixer", "layers", "lr", *cols, "global_step", "wall_seconds", "error"])
        for j in jobs:
            m = j["metrics"]
            w.writerow([j["job"], j["status"], " ".join(j["overrides"]), j["mixer"], layers_text(j), _raw(j["lr"]),
                        *[_raw(m.get(c)) for c in cols], _raw(j["summary"].get("global_step")),
                        _raw(j["summary"].get("wall_seconds")), j["error"]])


def _raw(v: Any) -> str:
    """Full precision (repr round-trips a float exactly), so the CSV equals summary.json."""
    return "" if v is None else repr(v) if isinstance(v, float) else str(v)


_SHAPE_ABBREV = {"n_heads": "h", "n_kv_heads": "kv", "head_dim": "d", "window": "W", "conv": "conv"}


def layers_text(j: dict) -> str:
    """What the job's layers really were (summary.json's per-layer shapes), compact: runs of equal layers
    as `4x gqa h4 kv2 d32`, joined by ' + ' in stack order."""
    layers = ((j.get("summary") or {}).get("model") or {}).get("layers") or []
    runs: list[list] = []
    for shape in layers:
        desc = " ".join([str(shape.get("mixer", "?"))] + [
            f"{_SHAPE_ABBREV.get(k, k + '=')}{'x'.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in shape.items() if k != "mixer"])
        if runs and runs[-1][1] == desc:
            runs[-1][0] += 1
        else:
            runs.append([1, desc])
    return " + ".join(f"{n}x {d}" for n, d in runs)


def fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):  # counts (params, bytes, tokens/s) with thousands separators, rates to 4 digits
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def _cell(v: Any) -> Cell:
    return fmt(v), v if finite(v) and not isinstance(v, bool) else None


def table(rows: list[dict], cols: list[str], extra: list[tuple[str, Any]] = ()) -> tuple[list[str], list[list[Cell]]]:
    """The best-of-lr table (`extra` columns, e.g. best lr) or the all-jobs table (each job's built layers):
    the header and, per row, its cells (the layers column only where summary.json holds the layers)."""
    per_job = not extra
    if per_job:
        extra = [("layers", layers_text)] if any(layers_text(j) for j in rows) else []
    head = ["job", "overrides" if per_job else "variant", "mixer", "status", *[h for h, _ in extra], *cols]
    cells = [[_cell(j["job"]), _cell(j["label"] if per_job else j["variant"]), _cell(j["mixer"]), _cell(j["status"]),
              *[_cell(fn(j)) for _, fn in extra], *[_cell(j["metrics"].get(c)) for c in cols]] for j in rows]
    return head, cells


def markdown_table(rows: list[dict], cols: list[str], extra: list[tuple[str, Any]] = ()) -> str:
    head, cells = table(rows, cols, extra)
    return _markdown(head, [[text if i != 3 or text == "ok" else f"**{text.upper()}**" for i, (text, _) in enumerate(row)]
                            for row in cells])


def _markdown(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(t.replace("|", "\\|") for t in row) + " |" for row in rows])


def length_table(best: list[dict], metric: str) -> tuple[list[str], list[list[Cell]]]:
    """The length-extrapolation table (eval.context_lengths): per best variant, the ranking metric at the
    training length and at every evaluated one, then the cache bytes and the decode rate at each of them.
    No evaluated lengths: no rows."""
    lengths = sorted({int(m.group(1)) for j in best for k in j["metrics"]
                      if (m := re.fullmatch(re.escape(metric) + r"@(\d+)", k))})
    head = (["variant", "mixer", "trained at", metric] + [f"{metric}@{L}" for L in lengths]
            + [f"cache bytes@{L}" for L in lengths] + [f"decode tok/s@{L}" for L in lengths])
    if not lengths:
        return head, []
    rows = []
    for j in best:
        m = j["metrics"]
        L0 = (j["summary"].get("data") or {}).get("seq_len") or j["summary"].get("context_len")
        rows.append([_cell(j["variant"]), _cell(j["mixer"]), _cell(L0), _cell(m.get(metric)),
                     *[_cell(m.get(f"{metric}@{L}")) for L in lengths],
                     *[_cell(m.get(f"cache/bytes_at_ctx@{L}")) for L in lengths],
                     *[_cell(m.get(f"perf/decode_tokens_per_sec@{L}")) for L in lengths]])
    return head, rows


def lengths_md(best: list[dict], metric: str) -> str:
    head, rows = length_table(best, metric)
    if not rows:
        return ""
    return "\n".join(["## Length extrapolation", "",
                      f"`{metric}` at the training length and at each `eval.context_lengths` entry; the inference cache "
                      "(bytes, batch 1) and the batch-1 decode rate after a prefill of that length.", "",
                      _markdown(head, [[t for t, _ in row] for row in rows])]) + "\n"


def failures_md(jobs: list[dict]) -> str:
    bad = [j for j in jobs if j["status"] != "ok"]
    if not bad:
        return ""
    return "\n".join(["## Failed jobs", ""] + [f"- job {j['job']} ({j['label']}): {j['status']}: {j['error']}" for j in bad]) + "\n"
