"""The needle-in-a-haystack grid's computation and figure, below the training layer (the end of a run computes it:
training/measure.py eval.niah_depths / eval.niah_tasks; attnzoo-eval --task niah: inference/niah.py): `needle_cells`
(a data=needle module's task regenerated per length and depth, scored by val/acc), `text_cells` (RULER's tasks as
text prompts, completed greedily through the static-cache decoder, scored by string_match_all), `heatmap` (depth x
length per task) and `write` (the JSON and its heatmap beside it)."""
from __future__ import annotations

import json
from pathlib import Path

import torch


@torch.no_grad()
def needle_cells(lit, dm, data_cfg, lengths, depths, samples: int, batch_size: int) -> dict:
    """needle_grid's work on a LightningModule and its data=needle module (also the end of a run: eval.niah_depths,
    training/measure.py)."""
    import dataclasses

    from torch.utils.data import DataLoader

    from attnzoo.analysis.extrapolation import evaluate_loader

    cells: dict = {}
    for length in lengths:
        for depth in depths:
            cfg = dataclasses.replace(data_cfg, seq_len=int(length), depth=float(depth),
                                      train_size=data_cfg.batch_size, val_size=samples)
            other = type(dm)(cfg, seed=dm.seed)
            other.setup("validate")
            loader = DataLoader(other.val_set, batch_size=batch_size, shuffle=False, collate_fn=other.collate_fn)
            cells.setdefault(int(length), {})[float(depth)] = [evaluate_loader(lit, loader)["val/acc"]]
    return summarise_cells({"needle": cells})


def completion_tokens(encode, samples, given=None) -> int:
    """New tokens per prompt: `given`, or enough for every sample's answers written out (RULER generates 128
    for NIAH; these answers are a few dozen characters)."""
    if given is not None:
        return given
    return max(len(encode(" " + ", ".join(s.answers) + ".")) for s in samples) + 4


@torch.no_grad()
def evaluate_needles(model, encode, decode, samples, new_tokens: int, batch: int = 4) -> list[float]:
    """The score of each sample's greedy completion (static-cache decode, `batch` prompts at a time)."""
    from attnzoo.data.needles import score
    from attnzoo.models.decoding import Decoder

    out: list[float] = []
    ids = [encode(s.prompt) for s in samples]
    dec = Decoder(model, min(batch, len(samples)), max(map(len, ids)) + new_tokens, compile=False)
    for start in range(0, len(samples), dec.batch):
        gen = dec.generate(ids[start:start + dec.batch], new_tokens, temperature=0.0, decode=decode)
        out += [score(text, s.answers) for text, s in zip(gen.text, samples[start:start + dec.batch])]
    return out


def summarise(samples, scores) -> dict:
    """accuracy[task][length][depth], by_length[task][length], by_task[task]: means of the samples' scores."""
    cells: dict = {}
    for s, v in zip(samples, scores):
        cells.setdefault(s.task, {}).setdefault(s.length, {}).setdefault(s.depth, []).append(v)
    return summarise_cells(cells)


def text_cells(model, encode, decode, text: str, tasks, lengths, depths, samples: int, seed: int = 0,
               batch: int = 4, new_tokens: int | None = None) -> dict:
    """RULER's tasks (data/needles.py) at each (task, length, depth), `samples` prompts a cell from the haystack
    `text`, completed greedily and scored: summarise's dict and the completion length (`new_tokens`)."""
    from attnzoo.data.needles import make_samples

    prompts = make_samples(list(tasks), list(lengths), list(depths), samples, encode, text, seed)
    n = completion_tokens(encode, prompts, new_tokens)
    return {"new_tokens": n, **summarise(prompts, evaluate_needles(model, encode, decode, prompts, n, batch))}


def summarise_cells(cells: dict) -> dict:
    """{task: {length: {depth: [scores]}}} -> accuracy[task][length][depth], by_length[task][length] and
    by_task[task], each the mean of the scores under it (keys as strings, as in the JSON)."""
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "accuracy": {t: {str(L): {str(d): mean(v) for d, v in ds.items()} for L, ds in ls.items()} for t, ls in cells.items()},
        "by_length": {t: {str(L): mean([x for v in ds.values() for x in v]) for L, ds in ls.items()}
                      for t, ls in cells.items()},
        "by_task": {t: mean([x for ds in ls.values() for v in ds.values() for x in v]) for t, ls in cells.items()},
    }


def heatmap(result: dict, path: Path, title: str, label: str = "accuracy (string_match_all)",
            columns: int | None = None, titles: dict | None = None) -> None:
    """One panel per task: needle depth (rows, 0 = first) x context length (columns), accuracy 0-1 annotated.
    `columns`: panels per row (default: all in one row); `titles`: a panel's title per task (default: the task)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(result["accuracy"])
    ncols = min(columns or len(tasks), len(tasks))
    nrows = -(-len(tasks) // ncols)
    fig, grid_axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols + 1.2, 3.4 * nrows), squeeze=False, sharey=True,
                                  # several rows: room between them for the panels' titles, and half an inch above
                                  # the first for the figure's own
                                  **({"gridspec_kw": {"hspace": 0.55, "top": 1 - 0.55 / (3.4 * nrows)}}
                                     if nrows > 1 else {}))
    flat = [ax for row in grid_axes for ax in row]
    for ax in flat[len(tasks):]:  # the last row's empty places
        ax.set_visible(False)
    axes = [flat]  # the code below reads axes[0]: every panel, in order
    for ax, task in zip(axes[0], tasks):
        cells = result["accuracy"][task]
        lengths = sorted(cells, key=int)
        depths = sorted({d for ds in cells.values() for d in ds}, key=float)
        grid = [[cells[L].get(d, float("nan")) for L in lengths] for d in depths]
        im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [f"{int(L):,}" for L in lengths])
        ax.set_yticks(range(len(depths)), [f"{float(d):.0%}" for d in depths])
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xlabel("context length (tokens)")
        ax.set_title((titles or {}).get(task, task), fontsize=10)
    for i, ax in enumerate(axes[0][:len(tasks)]):  # one depth axis per row, labelled once (the panels share it)
        if i % ncols:
            ax.tick_params(labelleft=False)
        else:
            ax.set_ylabel("needle depth")
    fig.colorbar(im, ax=axes[0][:len(tasks)], label=label, shrink=1.0 if nrows == 1 else 0.6)
    fig.suptitle(title, fontsize=10, **({"y": 1.03} if nrows == 1 else {"y": 1 - 0.05 / (3.4 * nrows), "va": "top"}))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write(result: dict, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    png = out.with_suffix(".png")
    heatmap(result, png, f"needle in a haystack: {Path(result['checkpoint']).parent.parent.name} "
                         f"(step {result['global_step']})",
            "accuracy (val/acc)" if result["metric"].startswith("val/acc") else "accuracy (string_match_all)")
    return png
