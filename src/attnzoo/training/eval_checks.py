"""The end-of-run needle-in-a-haystack grid's settings (eval.niah_depths / niah_tasks / niah_samples; training/measure.py
niah_at_the_end), checked before any work, torch-free: `check_niah` from the composed config, `check_niah_prompts`
with the data's tokenizer (a length too short for a task's question and needles: preflight, with the tokenizer
check_corpus loads, and train() again once the data module has it)."""
from __future__ import annotations

from typing import Any

from attnzoo.config.errors import ConfigError, check
from attnzoo.data.needles import TASKS

TEXT_DEPTHS = (0.0, 0.5, 1.0)  # eval.niah_depths: [] with niah_tasks
ANSWER_ROOM = 64  # tokens kept free for the completion past the longest prompt, under a learned position table


def niah_lengths(ev, data: Any) -> list[int]:
    """The grid's lengths: data.seq_len and each eval.context_lengths entry."""
    seq = int(data.seq_len)
    return [seq, *[int(L) for L in ev.context_lengths or [] if int(L) != seq]]


def check_niah(ev, model, data: Any) -> None:
    depths, tasks, name = list(ev.niah_depths or []), list(ev.niah_tasks or []), getattr(data, "name", "?")
    if tasks:
        check(name == "text", "eval.niah_tasks", f"are RULER's text prompts, for data=text runs; allowed with data="
              f"{name}: [] (data=needle: eval.niah_depths alone; a shards run: attnzoo-eval RUN --task niah --haystack FILE)")
        unknown = [t for t in tasks if t not in TASKS]
        if unknown:
            raise ConfigError(f"unknown task {unknown[0]!r}; allowed: {', '.join(TASKS)}", field="eval.niah_tasks")
        if model.position.name == "learned":
            longest = max(niah_lengths(ev, data))
            check(longest + ANSWER_ROOM <= model.max_seq_len, "eval.niah_tasks",
                  f"prompts of {longest} tokens and their answers exceed the learned position table (model.max_seq_len="
                  f"{model.max_seq_len}); allowed: lengths <= {model.max_seq_len - ANSWER_ROOM}, or another position")
    if depths and not tasks:
        check(name == "needle", "eval.niah_depths", f"is for data=needle runs (the task they trained on), or with "
              f"eval.niah_tasks on data=text; allowed with data={name}: [] (or attnzoo-eval RUN --task niah)")
    if depths or tasks:
        check(all(isinstance(d, (int, float)) and 0.0 <= d <= 1.0 for d in depths), "eval.niah_depths",
              f"got {depths}; allowed: fractions of the haystack in [0, 1], e.g. [0, 0.5, 1]")
        check(ev.niah_samples is None or ev.niah_samples >= 1, "eval.niah_samples",
              f"must be >= 1 or null, got {ev.niah_samples}")


def niah_haystack(data_cfg) -> tuple[str, str]:
    """(the text haystack, where it came from): the run's corpus (data.path; the embedded one for null)."""
    from attnzoo.data.corpus import load_corpus

    return load_corpus(data_cfg.path, 1 << 22)


def check_niah_prompts(ev, data: Any, encode, text: str) -> dict:
    """{task: the grid's lengths that hold its question and needles} in the data module's own tokens (one prompt
    per task and length, built as the end of the run builds them), before training. A length too short for a
    task is left out of that task's grid (said in niah.json and the log); a task no length holds is refused."""
    from attnzoo.data.needles import corpus_lines, make_sample

    lines = corpus_lines(text) if any(TASKS[t].haystack == "text" for t in ev.niah_tasks) else []
    fits: dict = {}
    for task in ev.niah_tasks:
        lengths, need = niah_lengths(ev, data), ""
        for length in lengths:
            try:
                make_sample(task, length, 0.0, encode, lines, 0)
                fits.setdefault(task, []).append(length)
            except ConfigError as e:  # "<L> tokens cannot hold <task>'s question and needle(s) alone (<n> tokens)..."
                need = str(e).split("alone (", 1)[-1].split(")", 1)[0]
        if task not in fits:
            raise ConfigError(f"{task}'s question and needles alone take {need}; no length of the grid "
                              f"({', '.join(map(str, lengths))}: data.seq_len and eval.context_lengths) holds them; "
                              f"allowed: an eval.context_lengths entry that does", field="eval.niah_tasks")
    return fits
