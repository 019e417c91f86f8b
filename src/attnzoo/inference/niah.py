"""`attnzoo-eval RUN --task niah`: needle-in-a-haystack retrieval of a trained text run, offline (issue 48).

The prompts are RULER's NIAH tasks and passkey (attnzoo/data/needles.py) at each (task, context length, needle
depth), in the run's own tokens; each is completed greedily through the run's static-cache decode path
(models/decoding.Decoder, the path attnzoo-generate takes), and scored by RULER's string_match_all (the fraction of
the answers in the completion). Writes a JSON (accuracy per task, length and depth; per task and length; per
task) and a heatmap PNG beside it: depth (rows) x length (columns) per task, the figure long-context papers show.

The haystack of the text tasks is the run's own corpus (data.path of a data=text run; the embedded corpus for
data.path null) unless `--haystack PATH` names another. A length past the model's positions (model.max_seq_len
with its completion) is refused unless --extrapolate (computed positions only: a learned table cannot grow).
"""
from __future__ import annotations

import argparse

import torch

from attnzoo.analysis.niah import (completion_tokens, evaluate_needles, heatmap, needle_cells,  # noqa: F401 (re-exported)
                                   summarise, summarise_cells, write)
from attnzoo.config.errors import ConfigError
from attnzoo.data.corpus import load_corpus
from attnzoo.data.needles import make_samples
from attnzoo.models.decoding import position_table


def check_lengths(run, lengths, new_tokens: int, extrapolate: bool) -> None:
    """Each length with its completion within the model's positions (a learned table: always; computed positions:
    unless --extrapolate)."""
    cfg = run.model.cfg
    table = position_table(run.model)
    longest = max(lengths) + new_tokens
    if table is not None and longest > table:
        raise ConfigError(f"{max(lengths)} tokens + {new_tokens} new ones exceed the learned position table "
                          f"(model.max_seq_len={table}); allowed: lengths <= {table - new_tokens}", field="--lengths")
    if table is None and not extrapolate and longest > cfg.max_seq_len:
        raise ConfigError(f"{max(lengths)} tokens + {new_tokens} new ones exceed model.max_seq_len={cfg.max_seq_len} "
                          f"({cfg.position.name} positions: lengths the model is not sized for); allowed: lengths "
                          f"<= {cfg.max_seq_len - new_tokens}, or --extrapolate to go past it", field="--lengths")


def haystack_text(run, path) -> tuple[str, str]:
    """(the text haystack's corpus, where it came from): --haystack, else the run's own text corpus."""
    if path is not None:
        return load_corpus(str(path), 1 << 22)
    data = run.config.get("data") or {}
    return load_corpus(data.get("path") if data.get("name", "text") == "text" else None, 1 << 22)


@torch.no_grad()
def needle_grid(args: argparse.Namespace, run) -> dict:
    """A data=needle run (data/needle.py, the token task it trained on) at each length and depth: `args.samples`
    fresh validation examples per cell (the task regenerated with seq_len = length and depth = depth, as
    eval.context_lengths regenerates it), scored by val/acc (the answer tokens right, teacher-forced)."""
    from attnzoo.config.schema import tagged
    from attnzoo.data import DATAMODULES

    data_cfg = tagged(DATAMODULES, run.config["data"], "data")
    check_lengths(run, args.lengths, 0, args.extrapolate)
    return needle_cells(run.lit, run.datamodule, data_cfg, args.lengths, args.depths, args.samples, args.batch_size)




def run_niah(args: argparse.Namespace, run) -> dict:
    """attnzoo-eval --task niah on a loaded run (inference/generate.run_eval dispatches here)."""
    from attnzoo.training.families import family_of

    if run.config["data"].get("name") == "needle" and family_of(run.config["model"]).decoder_only:
        args.samples = args.samples or 256
        return {"task": "niah", "checkpoint": str(run.checkpoint), "global_step": run.global_step,
                "haystack": "data=needle (the token task the run trained on)", "samples_per_cell": args.samples,
                "metric": "val/acc: the needle's value tokens right after the query (teacher-forced)",
                **needle_grid(args, run)}
    args.samples = args.samples or 4
    if not family_of(run.config["model"]).decoder_only or not hasattr(run.datamodule, "encode"):
        raise ConfigError(f"the run is a {family_of(run.config['model']).name} model on data="
                          f"{run.config['data'].get('name', 'text')}; allowed with --task niah: a decoder LM trained on "
                          f"text (its prompts are English) or on data=needle", field="--task")
    text, source = haystack_text(run, args.haystack)
    samples = make_samples(args.niah_tasks, args.lengths, args.depths, args.samples, run.encode, text, args.seed)
    new_tokens = completion_tokens(run.encode, samples, args.max_new_tokens)
    check_lengths(run, args.lengths, new_tokens, args.extrapolate)
    scores = evaluate_needles(run.model, run.encode, run.decode, samples, new_tokens, args.batch_size)
    result = {"task": "niah", "checkpoint": str(run.checkpoint), "global_step": run.global_step,
              "haystack": source, "samples_per_cell": args.samples, "seed": args.seed, "new_tokens": new_tokens,
              "metric": "string_match_all (RULER): the fraction of a sample's answers in its greedy completion",
              **summarise(samples, scores)}
    return result
