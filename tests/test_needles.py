"""The offline needle-in-a-haystack generator (attnzoo/data/needles.py, RULER's NIAH family and passkey): RULER's
templates word for word, every prompt within its length and as full as its haystack's lines allow, the needles
where the depth puts them, the answers in the prompt and in no distractor, deterministic under a seed, scored by
string_match_all; impossible settings refused in one line. Torch-free and fast: a byte-level encoder stands in
for a tokenizer (one token per UTF-8 byte)."""
from __future__ import annotations

import re

import pytest

from attnzoo.config.errors import ConfigError
from attnzoo.data.needles import NOISE, TASKS, make_sample, make_samples, score

TEXT = "\n".join(f"line {i}: the quick brown fox jumps over the lazy dog number {i}." for i in range(400))


def encode(s: str) -> list:
    return list(s.encode())


def needle_lines(prompt: str) -> list[int]:
    body = prompt.split("\n")
    return [i for i, ln in enumerate(body) if ln.startswith(("One of the special magic", "The pass key is"))]


@pytest.mark.parametrize("task", list(TASKS))
def test_every_task_fills_its_length_with_the_answers_inside(task):
    for length in (1200, 3000):
        s = make_sample(task, length, 0.5, encode, TEXT.splitlines(), seed=3)
        assert s.n_tokens == len(encode(s.prompt)) <= length
        # as full as whole haystack lines allow: the longest line (a needle line, ~130 bytes) would not fit
        assert length - s.n_tokens < 140, (task, length, s.n_tokens)
        spec = TASKS[task]
        assert len(s.answers) == spec.n_values * spec.n_queries
        for a in s.answers:
            assert s.prompt.count(a) == (2 if spec.passkey else 1), a  # the passkey's needle says it twice
        assert score(" and ".join(s.answers), s.answers) == 1.0
        n_needles = len(needle_lines(s.prompt))
        if spec.haystack == "needles":  # the haystack is needles with other keys, none of them asked
            assert n_needles > 5 and sum(a in s.prompt for a in s.answers) == len(s.answers)
        else:
            assert n_needles == spec.n_keys * spec.n_values


def test_rulers_templates_word_for_word():
    """RULER's scripts/data/synthetic/constants.py (context, query, answer prefix) and niah.py's needle; the passkey
    task as Landmark Attention words it."""
    s = make_sample("niah_single_2", 800, 0.0, encode, TEXT.splitlines(), seed=0)
    (key,) = re.findall(r"for (\S+) is: ", s.prompt)
    assert s.prompt.startswith("Some special magic numbers are hidden within the following text. Make sure to "
                               "memorize it. I will quiz you about the numbers afterwards.\n")
    assert f"\nOne of the special magic numbers for {key} is: {s.answers[0]}.\n" in s.prompt
    assert s.prompt.endswith(f"\nWhat are all the special magic numbers for {key} mentioned in the provided text? "
                             f"The special magic numbers for {key} mentioned in the provided text are")
    q = make_sample("niah_multiquery", 1500, 0.0, encode, TEXT.splitlines(), seed=0)
    keys = re.findall(r"for (\S+) is: ", q.prompt)
    assert q.prompt.endswith(f"for {keys[0]}, {keys[1]}, {keys[2]}, and {keys[3]} mentioned in the provided text are")
    u = make_sample("niah_single_3", 800, 0.0, encode, TEXT.splitlines(), seed=0)
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", u.answers[0])
    assert "special magic uuids for" in u.prompt
    p = make_sample("passkey", 600, 0.5, encode, [], seed=0)
    assert p.prompt.startswith("There is an important info hidden inside a lot of irrelevant text. Find it and "
                               "memorize them. I will quiz you about the important information there.\n" + NOISE)
    assert f"The pass key is {p.answers[0]}. Remember it. {p.answers[0]} is the pass key." in p.prompt
    assert p.prompt.endswith("\nWhat is the pass key? The pass key is") and re.fullmatch(r"\d{7}", p.answers[0])


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_the_needle_sits_at_its_depth(depth):
    s = make_sample("niah_single_1", 4000, depth, encode, [], seed=1)
    lines = s.prompt.split("\n")[1:-1]  # the haystack: between the instruction and the question
    (at,) = needle_lines("\n".join(lines))
    assert abs(at / (len(lines) - 1) - depth) <= 1 / (len(lines) - 1)
    # several needles: the first after `depth` of the haystack's lines, the rest spread from there to the end
    m = make_sample("niah_multivalue", 4000, depth, encode, TEXT.splitlines(), seed=1)
    body = m.prompt.split("\n")[1:-1]
    ats = needle_lines("\n".join(body))
    n_hay = len(body) - len(ats)
    assert len(ats) == 4 and abs(ats[0] / n_hay - depth) <= 1 / n_hay and ats[-1] >= ats[0] + 3


def test_distractors_are_not_answers_and_samples_are_deterministic():
    s = make_sample("niah_multikey_1", 2000, 0.3, encode, TEXT.splitlines(), seed=5)
    values = re.findall(r"is: (\d{7})\.", s.prompt)
    assert len(values) == 4 and len(s.answers) == 1 and s.answers[0] in values
    assert make_sample("niah_multikey_1", 2000, 0.3, encode, TEXT.splitlines(), seed=5) == s
    assert make_sample("niah_multikey_1", 2000, 0.3, encode, TEXT.splitlines(), seed=6).prompt != s.prompt
    batch = make_samples(["passkey", "niah_single_2"], [600, 900], [0.0, 1.0], 2, encode, TEXT, seed=0)
    assert [(x.task, x.length, x.depth) for x in batch[:4]] == [("passkey", 600, 0.0)] * 2 + [("passkey", 600, 1.0)] * 2
    assert len(batch) == 16 and batch[0].prompt != batch[1].prompt  # the samples of a cell differ


def test_string_match_all():
    assert score("the numbers are 1234567 and 7654321", ("1234567", "7654321")) == 1.0
    assert score("the number is 1234567", ("1234567", "7654321")) == 0.5
    assert score("ABCDEF", ("abcdef",)) == 1.0 and score("", ("1",)) == 0.0


@pytest.mark.parametrize("args,field,phrase", [
    ((["niah_single_9"], [500], [0.5]), "--niah-tasks", "unknown task 'niah_single_9'; allowed: niah_single_1"),
    (([], [500], [0.5]), "--niah-tasks", "no task given"),
    ((["passkey"], [500], [1.5]), "--depths", "got 1.5; allowed: fractions of the haystack in [0, 1]"),
    ((["passkey"], [500], [-0.1]), "--depths", "got -0.1"),
    ((["passkey"], [0], [0.5]), "--lengths", "got 0; allowed: context lengths in tokens >= 1"),
    ((["niah_multikey_1"], [300], [0.5]), "--lengths", "300 tokens cannot hold niah_multikey_1's question and "
                                                       "needle(s) alone"),
])
def test_impossible_settings_are_one_line(args, field, phrase):
    with pytest.raises(ConfigError) as e:
        make_samples(*args, 1, encode, TEXT)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{field}: ") and phrase in msg, msg
