"""Needle-in-a-haystack tasks generated offline, as RULER defines its NIAH family (Hsieh et al. 2024, "RULER: What's
the Real Context Size of Your Long-Context Language Models?", arXiv:2404.06654, its `synthetic.yaml` and
`niah.py`) and the passkey task (Mohtashami & Jaggi 2023, "Landmark Attention"), at chosen context lengths (in the
model's own tokens) and needle depths, deterministic under a seed. Torch-free: strings in, strings out.

Tasks (RULER's names; haystack / key / value kinds as in its synthetic.yaml):

    niah_single_1    noise haystack (the repeated "The grass is green. ..." lines)   key: a word   value: a 7-digit number
    niah_single_2    text haystack (the corpus)                                       key: a word   value: a 7-digit number
    niah_single_3    text haystack                                                    key: a word   value: a UUID
    niah_multikey_1  text haystack, 4 needles with different keys (3 distractors)     key: a word   value: a number
    niah_multikey_2  a haystack made of needles (every line a key-value needle)       key: a word   value: a number
    niah_multikey_3  a haystack made of needles                                       key: a UUID   value: a UUID
    niah_multivalue  text haystack, one key with 4 values (4 needles)                  key: a word   value: numbers
    niah_multiquery  text haystack, 4 keys asked together (4 needles)                  key: words    value: numbers
    passkey          noise haystack, "The pass key is N. Remember it. N is the pass key."

A sample is the prompt (instruction, haystack with the needles, question, answer prefix: RULER's templates) and
its answers; the score of a completion is RULER's `string_match_all`: the fraction of the answers found in it.

Where ours differs from RULER: the text haystack is any corpus (the embedded one by default, RULER uses Paul
Graham's essays), cut into lines rather than sentences (the embedded corpus is code); keys are drawn from a fixed
list of 2,500 adjective-noun pairs (RULER: the `wonderwords` package); the depth of a single needle is the
fraction of the haystack's lines before it (RULER: of its sentences), and several needles (multi-key, -value,
-query) are spread from that depth to the end evenly (RULER: at random depths); lengths count the prompt and the
answer prefix in the model's tokens, as RULER does with the model's tokenizer.
"""
from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

from attnzoo.config.errors import ConfigError

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
ADJECTIVES = ("able ancient angry bitter blue brave bright broad calm cheap clean clever cold cool curly damp dark "
              "deep dizzy dry dusty eager early easy empty fair fancy fast fierce flat fresh gentle giant glad "
              "golden grand green happy hard heavy hollow huge icy jolly kind large late lazy light little lively "
              "long loud lucky mellow mighty modern narrow neat new noisy odd old orange pale plain polite proud "
              "purple quick quiet rapid rare red rich rough round rusty sad safe sharp shiny short silent silly "
              "slow small smooth soft solid sour spicy steep sticky strong sunny sweet swift tall tame tender thin "
              "tidy tiny tough vast warm wet white wide wild wise witty young").split()
NOUNS = ("acorn anchor apple arrow badge basket beacon bell bird blanket boat bottle bridge brush bucket button "
         "cabin camera candle canyon carpet castle cherry cliff cloud comet compass copper cotton crayon crown "
         "desk diamond drum eagle engine falcon feather fence fiddle flag forest fountain garden glacier glove "
         "harbor hammer helmet island jacket kettle kite ladder lantern lemon lily magnet maple marble meadow "
         "mirror motor needle ocean orchard otter paddle palace parrot pebble pencil pepper piano pillow planet "
         "pocket quilt rabbit river rocket saddle sail scarf shell shovel silver spoon statue stone summit "
         "teapot tiger tower trumpet tunnel valley violin wagon walnut whistle window wizard").split()


@dataclass(frozen=True)
class Task:
    haystack: str  # noise | text | needles
    key: str  # words | uuids
    value: str  # numbers | uuids
    n_keys: int = 1  # needles with different keys (the first is asked; the rest distract), or asked together (queries)
    n_values: int = 1  # values of the asked key, one needle each
    n_queries: int = 1  # keys asked in one question
    passkey: bool = False


TASKS = {
    "niah_single_1": Task("noise", "words", "numbers"),
    "niah_single_2": Task("text", "words", "numbers"),
    "niah_single_3": Task("text", "words", "uuids"),
    "niah_multikey_1": Task("text", "words", "numbers", n_keys=4),
    "niah_multikey_2": Task("needles", "words", "numbers"),
    "niah_multikey_3": Task("needles", "uuids", "uuids"),
    "niah_multivalue": Task("text", "words", "numbers", n_values=4),
    "niah_multiquery": Task("text", "words", "numbers", n_keys=4, n_queries=4),
    "passkey": Task("noise", "words", "numbers", passkey=True),
}


@dataclass(frozen=True)
class NeedleSample:
    task: str
    length: int  # the target context length, in tokens
    depth: float  # where the (first) needle sits, a fraction of the haystack
    prompt: str  # instruction, haystack with the needles, question, answer prefix
    answers: tuple  # what the completion must contain
    n_tokens: int  # the prompt's own length in tokens (<= length)


def score(completion: str, answers) -> float:
    """RULER's string_match_all: the fraction of `answers` that occur in the completion (case-insensitive)."""
    low = completion.lower()
    return sum(a.lower() in low for a in answers) / len(answers)


def check_request(tasks, lengths, depths, field_prefix: str = "--") -> None:
    """The settings before any sample is built: known task names, lengths >= 1, depths in [0, 1]."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ConfigError(f"unknown task {unknown[0]!r}; allowed: {', '.join(TASKS)}" if unknown else
                          f"no task given; allowed: {', '.join(TASKS)}", field=f"{field_prefix}niah-tasks")
    bad = [d for d in depths if not (0.0 <= d <= 1.0)]
    if bad or not depths:
        raise ConfigError(f"got {bad[0] if bad else 'none'}; allowed: fractions of the haystack in [0, 1] (0: the "
                          f"needle first, 1: last)", field=f"{field_prefix}depths")
    short = [n for n in lengths if n < 1]
    if short or not lengths:
        raise ConfigError(f"got {short[0] if short else 'none'}; allowed: context lengths in tokens >= 1",
                          field=f"{field_prefix}lengths")


# ----------------------------------------------------------------------------- the pieces, RULER's templates


def _key(rng: random.Random, kind: str, taken: set) -> str:
    while True:
        k = (str(uuid.UUID(int=rng.getrandbits(128), version=4)) if kind == "uuids"
             else f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}")
        if k not in taken:
            taken.add(k)
            return k


def _value(rng: random.Random, kind: str) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4)) if kind == "uuids" else str(rng.randint(10 ** 6, 10 ** 7 - 1))


def _what(task: Task) -> str:
    return "numbers" if task.value == "numbers" else "uuids"


def _needle(task: Task, key: str, value: str) -> str:
    if task.passkey:
        return f"The pass key is {value}. Remember it. {value} is the pass key."
    return f"One of the special magic {_what(task)} for {key} is: {value}."


def _frame(task: Task, queries: list) -> tuple[str, str]:
    """(what comes before the haystack, what comes after it: the question and the answer prefix)."""
    if task.passkey:
        return ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will "
                "quiz you about the important information there.\n",
                "\nWhat is the pass key? The pass key is")
    what = _what(task)
    query = ", ".join(queries[:-1]) + f", and {queries[-1]}" if len(queries) > 1 else queries[0]
    return (f"Some special magic {what} are hidden within the following text. Make sure to memorize it. I will quiz "
            f"you about the {what} afterwards.\n",
            f"\nWhat are all the special magic {what} for {query} mentioned in the provided text? The special magic "
            f"{what} for {query} mentioned in the provided text are")


def _filler(task: Task, rng: random.Random, corpus_lines: list, taken: set) -> Callable[[int], str]:
    """line i of the haystack (noise, the corpus from a random line on, or distractor needles)."""
    if task.haystack == "noise":
        return lambda i: NOISE
    if task.haystack == "needles":
        cache: dict = {}

        def needle_line(i: int) -> str:
            if i not in cache:
                cache[i] = _needle(task, _key(rng, task.key, taken), _value(rng, task.value))
            return cache[i]
        return needle_line
    start = rng.randrange(len(corpus_lines))
    return lambda i: corpus_lines[(start + i) % len(corpus_lines)]


def make_sample(task_name: str, length: int, depth: float, encode: Callable[[str], list], corpus_lines: list,
                seed: int) -> NeedleSample:
    """One prompt of `task_name` whose length in `encode`'s tokens is at most `length` (as many haystack lines as
    fit), its needle(s) at `depth`. Refused (ConfigError naming --lengths) when the frame and the needles alone
    do not fit."""
    task = TASKS[task_name]
    rng = random.Random(f"{task_name}/{length}/{depth}/{seed}")
    taken: set = set()
    keys = [_key(rng, task.key, taken) for _ in range(task.n_keys)]
    values = [[_value(rng, task.value) for _ in range(task.n_values)] for _ in keys]
    needles = [_needle(task, k, v) for k, vs in zip(keys, values) for v in vs]
    asked = keys[:task.n_queries]
    answers = tuple(v for k, vs in zip(keys, values) if k in asked for v in vs)
    head, tail = _frame(task, asked)
    fill = _filler(task, rng, corpus_lines, taken)

    def build(n_lines: int) -> str:
        lines = [fill(i) for i in range(n_lines)]
        first = round(depth * n_lines)
        at = [first + round(j * (n_lines - first) / len(needles)) for j in range(len(needles))]
        for j, pos in sorted(enumerate(at), key=lambda x: -x[1]):  # from the end, so earlier positions stay put
            lines.insert(pos, needles[j])
        return head + "\n".join(lines) + tail

    if len(encode(build(0))) > length:
        raise ConfigError(f"{length} tokens cannot hold {task_name}'s question and needle(s) alone "
                          f"({len(encode(build(0)))} tokens); allowed: a longer length", field="--lengths")
    lo, hi = 0, 1  # the most haystack lines that fit: doubling, then bisection
    while len(encode(build(hi))) <= length:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(encode(build(mid))) <= length else (lo, mid)
    prompt = build(lo)
    return NeedleSample(task_name, length, depth, prompt, answers, len(encode(prompt)))


def corpus_lines(text: str) -> list[str]:
    """The text haystack's units: the corpus's non-blank lines, stripped (RULER: an essay's sentences)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise ConfigError("the haystack corpus has no non-blank line", field="--haystack")
    return lines


def make_samples(tasks, lengths, depths, n: int, encode: Callable[[str], list], text: Optional[str],
                 seed: int = 0) -> list[NeedleSample]:
    """`n` samples of every (task, length, depth), in that order; `text` the corpus of the text haystacks (None:
    only noise / needle haystacks are asked for)."""
    check_request(tasks, lengths, depths)
    lines = corpus_lines(text) if any(TASKS[t].haystack == "text" for t in tasks) else []
    return [make_sample(t, L, d, encode, lines, seed + i) for t in tasks for L in lengths for d in depths
            for i in range(n)]
