"""lm_eval tasks `attnzoo_<name>` (tag `attnzoo_niah`): RULER's needle-in-a-haystack family and passkey, generated
offline by attnzoo/data/needles.py, for any model lm_eval runs (issue 48 item 2; docs/lm_eval.md).

    attnzoo-lm-eval --model attnzoo --model_args path=RUN --tasks attnzoo_niah --metadata '{"max_seq_lengths": [256, 512]}'
    lm_eval --model hf --model_args pretrained=NAME --include_path <this folder> --tasks attnzoo_passkey ...

lm_eval's own RULER tasks (`niah_single_1`, ...) download their haystack essays and need a transformers tokenizer;
these need neither: the haystack is the run's corpus (or the embedded one, or `haystack` = a text file), and the
prompts are sized in the run's own tokens (`path`, a run: the `--model attnzoo` model_args) or in a transformers
tokenizer's (`tokenizer` / `pretrained`, as RULER's tasks take it). Keys read from the metadata (lm_eval passes
the model_args and `--metadata` to the dataset function):

    max_seq_lengths   context lengths in tokens (RULER's key); powers of two 64 .. 131072, the metric columns
                      (default: a run's data.seq_len x 1, 2, 4; RULER's 4096 for a tokenizer)
    depths            needle depths in [0, 1] (default 0, 0.25, 0.5, 0.75, 1)
    num_samples       samples per (length, depth) (default 4)
    seed              (default 0)       haystack   a text file for the text haystacks

The prompts are exactly attnzoo-eval --task niah's for the same settings and seed; the score of a completion is
RULER's string_match_all, reported as RULER's tasks do: per context length (-1 for a length not asked for) and
`acc` over every sample. The depth breakdown and its heatmap are attnzoo-eval's (`--task niah`).
"""
from __future__ import annotations

import functools
import os

from attnzoo.config.errors import ConfigError
from attnzoo.data.needles import make_samples, score

LENGTHS = tuple(2 ** i for i in range(6, 18))  # the metric columns of _niah_template_yaml
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@functools.cache
def _run(path: str):
    from attnzoo.inference.generate import load

    return load(path)


def _encoder_and_text(kw: dict):
    """(encode, haystack corpus, default lengths): a run's tokenizer and corpus (`path`), else a transformers
    tokenizer (`tokenizer` / `pretrained`) and the embedded corpus; `haystack` replaces the corpus."""
    from attnzoo.data.corpus import load_corpus

    haystack = kw.get("haystack")
    if haystack is not None and not os.path.isfile(str(haystack)):
        raise ConfigError(f"{haystack} is not a file; allowed: a text file for the text haystacks",
                          field="metadata.haystack")
    if kw.get("path"):
        from attnzoo.inference.niah import haystack_text

        run = _run(str(kw["path"]))
        seq = int((run.config.get("data") or {}).get("seq_len") or run.model.cfg.max_seq_len)
        return run.encode, haystack_text(run, haystack)[0], [seq, 2 * seq, 4 * seq]
    name = kw.get("tokenizer") or kw.get("pretrained")
    if not isinstance(name, str) or not name:
        raise ConfigError("no tokenizer to size the prompts with; allowed: model_args path=RUN (--model attnzoo) or "
                          "tokenizer=NAME / pretrained=NAME (a transformers tokenizer)", field="metadata.tokenizer")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name)
    return (lambda s: tok(s, add_special_tokens=False).input_ids), load_corpus(haystack, 1 << 22)[0], [4096]


def dataset(task: str, **kw) -> dict:
    """{"test": datasets.Dataset}: `num_samples` prompts of `task` per (length, depth), one row each."""
    import datasets

    encode, text, default = _encoder_and_text(kw)
    lengths = [int(L) for L in kw.get("max_seq_lengths") or default]
    if bad := [L for L in lengths if L not in LENGTHS]:
        raise ConfigError(f"got {bad[0]}; allowed: powers of two {LENGTHS[0]} .. {LENGTHS[-1]} (the tasks' metric "
                          f"columns, as RULER's)", field="metadata.max_seq_lengths")
    depths = [float(d) for d in kw.get("depths") or DEPTHS]
    samples = make_samples([task], lengths, depths, int(kw.get("num_samples") or 4), encode, text,
                           int(kw.get("seed") or 0))
    rows = [{"input": s.prompt, "outputs": list(s.answers), "max_length": s.length, "depth": s.depth,
             "n_tokens": s.n_tokens} for s in samples]
    return {"test": datasets.Dataset.from_list(rows, split=datasets.Split.TEST)}


def process_results(doc: dict, results: list[str]) -> dict:
    """RULER's: the completion's string_match_all under its length's column, -1 under the others; and `acc`."""
    value = score(results[0].strip(), doc["outputs"])
    return {"acc": value, **{str(L): -1.0 for L in LENGTHS}, str(doc["max_length"]): value}


def aggregate(values: list[float]) -> float:
    """The mean over the samples of one length (-1: that length was not asked for)."""
    asked = [v for v in values if v != -1]
    return sum(asked) / len(asked) if asked else -1.0


niah_single_1 = functools.partial(dataset, "niah_single_1")
niah_single_2 = functools.partial(dataset, "niah_single_2")
niah_single_3 = functools.partial(dataset, "niah_single_3")
niah_multikey_1 = functools.partial(dataset, "niah_multikey_1")
niah_multikey_2 = functools.partial(dataset, "niah_multikey_2")
niah_multikey_3 = functools.partial(dataset, "niah_multikey_3")
niah_multivalue = functools.partial(dataset, "niah_multivalue")
niah_multiquery = functools.partial(dataset, "niah_multiquery")
passkey = functools.partial(dataset, "passkey")
