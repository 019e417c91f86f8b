"""The report's needle-in-a-haystack section, for a sweep whose jobs wrote the depth x length grid at the end of
their runs (`data=needle` with `eval.niah_depths`: `<job>/niah.json`, training/measure.py): one heatmap panel per
variant (its best learning rate's job, as the other tables) in `plots/niah.png`, and a table of the accuracy at each
length, averaged over the depths, with the mean over the whole grid."""
from __future__ import annotations

import html
import json
from pathlib import Path

from attnzoo.analysis.niah import heatmap


def study(best: list[dict]) -> dict | None:
    """{label: its grid} for the variants whose job wrote niah.json; None when none did. A grid's first task is
    taken (a training run's grid has one, `needle`)."""
    grids: dict = {}
    for row in best:
        path = Path(row["dir"]) / "niah.json"
        if row["status"] != "ok" or not path.is_file():
            continue
        try:
            result = json.loads(path.read_text())
            task = next(iter(result["accuracy"]))
        except (ValueError, KeyError, StopIteration):
            continue  # an unreadable grid: the job's own niah.json says what it holds
        label = row.get("variant") or row["job"]
        grids[label] = {"accuracy": result["accuracy"][task], "by_length": result["by_length"][task],
                        "mean": result["by_task"][task]}
    return grids or None


def draw(grids: dict, path: Path) -> None:
    """One panel per variant (four to a row, titled by the swept values alone): needle depth x context length,
    accuracy 0-1 on one colour scale."""
    heatmap({"accuracy": {label: g["accuracy"] for label, g in grids.items()}}, path,
            "needle in a haystack: accuracy by needle depth and context length (trained at data.seq_len)",
            "accuracy (val/acc on the needle's value)", columns=4,
            titles={label: short(label) for label in grids})


def short(label: str) -> str:
    """A variant's swept values without their keys ('model/mixer=gqa model/position=rope' -> 'gqa, rope')."""
    parts = label.split(" ")
    return ", ".join(p.split("=", 1)[1] for p in parts) if all("=" in p for p in parts) else label


def _lengths(grids: dict) -> list[str]:
    return sorted({L for g in grids.values() for L in g["by_length"]}, key=int)


def markdown(grids: dict) -> str:
    lengths = _lengths(grids)
    head = "| variant | " + " | ".join(f"{int(L):,} tokens" for L in lengths) + " | mean |"
    rows = [f"| {label} | " + " | ".join(f"{g['by_length'][L]:.3f}" if L in g["by_length"] else "-" for L in lengths)
            + f" | {g['mean']:.3f} |" for label, g in grids.items()]
    return "\n".join(["## Needle in a haystack", "",
                      "Accuracy at each context length, averaged over the needle depths (each variant's grid: "
                      "`<job>/niah.json`; the heatmaps: `plots/niah.png`).", "",
                      head, "|---|" + "---|" * (len(lengths) + 1), *rows, "", "![niah](plots/niah.png)", ""])


def html_section(grids: dict) -> str:
    lengths = _lengths(grids)
    head = "".join(f"<th>{int(L):,} tokens</th>" for L in lengths)
    body = "".join(
        "<tr><td>" + html.escape(label) + "</td>"
        + "".join(f"<td>{g['by_length'][L]:.3f}</td>" if L in g["by_length"] else "<td>-</td>" for L in lengths)
        + f"<td>{g['mean']:.3f}</td></tr>" for label, g in grids.items())
    return ("<h2>Needle in a haystack</h2><p>Accuracy at each context length, averaged over the needle depths "
            "(<code>&lt;job&gt;/niah.json</code>).</p>"
            f"<table><tr><th>variant</th>{head}<th>mean</th></tr>{body}</table>"
            "<p><img src=\"plots/niah.png\" alt=\"needle in a haystack heatmaps\" style=\"max-width:100%\"></p>")
