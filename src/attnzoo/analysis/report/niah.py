"""The report's needle-in-a-haystack section, for a sweep whose jobs wrote the depth x length grid at the end of
their runs (`<job>/niah.json`, training/measure.py: `data=needle` with `eval.niah_depths`, its one task `needle`;
`data=text` with `eval.niah_tasks`, RULER's tasks): per task, one heatmap panel per variant (its best learning
rate's job, as the other tables) in `plots/niah.png` (one task) or `plots/niah_<task>.png` (several), and a table of
the accuracy at each length, averaged over the depths, with the mean over the whole grid."""
from __future__ import annotations

import html
import json
from pathlib import Path



def study(best: list[dict]) -> dict | None:
    """{task: {label: its grid}} for the variants whose job wrote niah.json; None when none did."""
    grids: dict = {}
    for row in best:
        path = Path(row["dir"]) / "niah.json"
        if row["status"] != "ok" or not path.is_file():
            continue
        try:
            result = json.loads(path.read_text())
            tasks = {t: {"accuracy": result["accuracy"][t], "by_length": result["by_length"][t],
                         "mean": result["by_task"][t]} for t in result["accuracy"]}
        except (ValueError, KeyError, TypeError):
            continue  # an unreadable grid: the job's own niah.json says what it holds
        label = row.get("variant") or row["job"]
        for task, grid in tasks.items():
            grids.setdefault(task, {})[label] = grid
    return grids or None


def png_name(grids: dict, task: str) -> str:
    return "niah.png" if len(grids) == 1 else f"niah_{task}.png"


def draw(grids: dict, plots_dir: Path) -> dict:
    """Per task one figure, a panel per variant (four to a row, titled by the swept values alone): needle depth x
    context length, accuracy 0-1 on one colour scale. {file name: path}."""
    from attnzoo.analysis.niah import heatmap  # torch with it: not on the path of `attnzoo-report --help`

    out = {}
    for task, variants in grids.items():
        what = ("val/acc on the needle's value" if task == "needle" else "string_match_all")
        path = plots_dir / png_name(grids, task)
        heatmap({"accuracy": {label: g["accuracy"] for label, g in variants.items()}}, path,
                f"needle in a haystack{'' if task == 'needle' else ': ' + task}: accuracy by needle depth and context "
                f"length (trained at data.seq_len)", f"accuracy ({what})", columns=4,
                titles={label: short(label) for label in variants})
        out[path.name] = path
    return out


def short(label: str) -> str:
    """A variant's swept values without their keys ('model/mixer=gqa model/position=rope' -> 'gqa, rope')."""
    parts = label.split(" ")
    return ", ".join(p.split("=", 1)[1] for p in parts) if all("=" in p for p in parts) else label


def _lengths(variants: dict) -> list[str]:
    return sorted({L for g in variants.values() for L in g["by_length"]}, key=int)


def markdown(grids: dict) -> str:
    out = ["## Needle in a haystack", "",
           "Accuracy at each context length, averaged over the needle depths (each variant's grid: "
           "`<job>/niah.json`; '-': a length too short for the task's question and needles).", ""]
    for task, variants in grids.items():
        lengths = _lengths(variants)
        rows = [f"| {label} | " + " | ".join(f"{g['by_length'][L]:.3f}" if L in g["by_length"] else "-"
                                             for L in lengths) + f" | {g['mean']:.3f} |" for label, g in variants.items()]
        out += ([f"### {task}", ""] if len(grids) > 1 else []) + [
            "| variant | " + " | ".join(f"{int(L):,} tokens" for L in lengths) + " | mean |",
            "|---|" + "---|" * (len(lengths) + 1), *rows, "", f"![niah](plots/{png_name(grids, task)})", ""]
    return "\n".join(out)


def html_section(grids: dict) -> str:
    parts = ["<h2>Needle in a haystack</h2><p>Accuracy at each context length, averaged over the needle depths "
             "(<code>&lt;job&gt;/niah.json</code>).</p>"]
    for task, variants in grids.items():
        lengths = _lengths(variants)
        head = "".join(f"<th>{int(L):,} tokens</th>" for L in lengths)
        body = "".join(
            "<tr><td>" + html.escape(label) + "</td>"
            + "".join(f"<td>{g['by_length'][L]:.3f}</td>" if L in g["by_length"] else "<td>-</td>" for L in lengths)
            + f"<td>{g['mean']:.3f}</td></tr>" for label, g in variants.items())
        parts.append((f"<h3>{html.escape(task)}</h3>" if len(grids) > 1 else "")
                     + f"<table><tr><th>variant</th>{head}<th>mean</th></tr>{body}</table>"
                     f"<p><img src=\"plots/{png_name(grids, task)}\" alt=\"needle in a haystack heatmaps: "
                     f"{html.escape(task)}\" style=\"max-width:100%\"></p>")
    return "".join(parts)
