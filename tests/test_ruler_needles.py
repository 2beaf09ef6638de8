"""RULER's niah_multikey_2 / niah_multikey_3: a haystack made of needles (kvpot.tasks.needle_haystack)."""

from __future__ import annotations

import json
import random
import re

import pytest

from conftest import run
from kvpot.errors import KvpotError
from kvpot.models.reference.tokenizer import build_tokenizer
from kvpot.tasks import needle_haystack as nh
from kvpot.tasks import ruler
from kvpot.tasks.generators import make_sample
from kvpot.tasks.haystack import codec_for
from kvpot.tasks.keys import SHAPES
from kvpot.tasks.suites import load_items
from kvpot.tasks.wording import NIAH_TEMPLATES

TOKENIZER = build_tokenizer()  # one byte a token: decode(context_ids) is the exact text
TASKS = ("niah_multikey_2", "niah_multikey_3")
WORD_KEY = re.compile(r"[a-z]+(?:-[a-z]+){1,2}")
SEVEN_DIGITS = re.compile(r"[1-9]\d{6}")
FORMATS = {"niah_multikey_2": (WORD_KEY, SEVEN_DIGITS), "niah_multikey_3": (SHAPES["uuid"], SHAPES["uuid"])}


def sample(task: str, length: int, depth: float = 0.5, seed: int = 0, template: int = 0):
    name, options = ruler.GENERATED[task]
    return make_sample(name, TOKENIZER, length, depth=depth, seed=seed, template=template, **options)


def needle_lines(task: str, template: int, s) -> list[tuple[str, str]]:
    """(key, value) of every line of the context after the header; fails on anything but a whole needle."""
    wording = NIAH_TEMPLATES[template]
    header = s.context[: len(wording.header)]
    assert header == wording.header
    key, value = FORMATS[task]
    pattern = re.escape(wording.needle.strip()).replace(re.escape("{key}"), f"({key.pattern})")
    pattern = re.compile(pattern.replace(re.escape("{value}"), f"({value.pattern})"))
    pairs = []
    for text in s.context[len(wording.header):].split("\n"):
        if text:  # empty: a separator or a padding newline
            match = pattern.fullmatch(text)
            assert match, (task, template, text)
            pairs.append(match.groups())
    return pairs


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("template", [0, 1, 2])
@pytest.mark.parametrize("length,depth,seed", [(700, 0.0, 1), (1337, 0.37, 2), (4000, 0.91, 3), (2500, 1.0, 4)])
def test_context_is_whole_needles_with_one_asked(task, template, length, depth, seed):
    s = sample(task, length, depth, seed, template)
    assert len(s.context_ids) == length  # exactly the length asked, as the other niah tasks
    pairs = needle_lines(task, template, s)
    keys = [k for k, _ in pairs]
    assert len(set(keys)) == len(keys)  # every key distinct
    asked = FORMATS[task][0].search(s.question).group(0)
    (value,) = [v for k, v in pairs if k == asked]  # exactly one needle carries the asked key ...
    assert [value] == s.answers  # ... and its value is the answer
    assert sum(v == value for _, v in pairs) == 1
    # nearly all of the context is needles: the newlines at either end are less than a needle each
    longest = max(len(f"\n{NIAH_TEMPLATES[template].needle.strip()}".format(key=k, value=v)) for k, v in pairs)
    header = len(NIAH_TEMPLATES[template].header)
    needles = sum(len(f"\n{NIAH_TEMPLATES[template].needle.strip()}".format(key=k, value=v)) for k, v in pairs)
    assert length - header - needles < 2 * longest
    assert len(pairs) >= (length - header) // longest - 1
    # the asked needle is the primary span, at its depth (placement's rule: within 1% of the length)
    start, end = s.needle_spans[0]
    assert s.context[start:end] == f"\n{NIAH_TEMPLATES[template].needle.strip()}".format(key=asked, value=value)
    target = header + depth * (length - header - (end - start))
    assert abs(start - target) <= max(1, 0.01 * length)


def test_formats_words_and_numbers_then_uuids():
    for task, (key_shape, value_shape) in FORMATS.items():
        s = sample(task, 3000, seed=7)
        pairs = needle_lines(task, 0, s)
        assert len(pairs) > 20
        assert all(key_shape.fullmatch(k) and value_shape.fullmatch(v) for k, v in pairs)
    words = needle_lines("niah_multikey_2", 0, sample("niah_multikey_2", 3000, seed=7))
    assert not any(SHAPES["uuid"].search(k + v) for k, v in words)
    assert all(k.count("-") == 1 for k, _ in words)  # adjective-noun, as RULER's


def test_templates_differ_and_seeds_are_deterministic():
    for task in TASKS:
        texts = {sample(task, 1500, 0.4, seed=5, template=t).context for t in range(3)}
        assert len(texts) == 3 and ruler.template_count(task) == 3
        a, b = sample(task, 1500, 0.4, seed=5), sample(task, 1500, 0.4, seed=5)
        assert a.context_ids == b.context_ids and a.question_ids == b.question_ids and a.answers == b.answers
        other = sample(task, 1500, 0.4, seed=6)
        assert other.answers != a.answers and other.context_ids != a.context_ids
        # the needles depend on the seed, not the length: a longer context begins with the same haystack
        assert sample(task, 3000, 0.4, seed=5).answers == a.answers
        short, long = (needle_lines(task, 0, sample(task, n, 1.0, seed=5)) for n in (1500, 3000))
        assert long[: len(short) - 1] == short[:-1]  # the last needle of each is the asked one (depth 1)


def test_word_keys_stay_distinct_past_the_pairs_and_skip_the_samples_own():
    stream = nh._distinct_keys(random.Random("k"), "words", 7, set())
    keys = [next(stream) for _ in range(nh.PAIRS + 2000)]
    assert len(set(keys)) == len(keys)
    assert all(k.count("-") == 1 for k in keys[: nh.PAIRS]) and all(k.count("-") == 2 for k in keys[nh.PAIRS:])
    again = nh._distinct_keys(random.Random("k"), "words", 7, set(keys[:5]))
    assert [next(again) for _ in range(10)] == keys[5:15]  # the sample's own keys are never drawn
    small = nh._distinct_keys(random.Random("k"), "digits", 2, set())
    assert len({next(small) for _ in range(90)}) == 90
    with pytest.raises(KvpotError, match="ran out of distinct 2-digit keys"):
        next(small)


def test_distractors_never_take_the_samples_keys_or_values():
    own = ["1000000", "1000001", "9999999"]
    pieces = nh.needle_pieces(codec_for(TOKENIZER), 3, "\n{key}={value}", "digits", "digits", 7, own)
    pairs = [tuple(TOKENIZER.decode(next(pieces)).strip().split("=")) for _ in range(3000)]
    assert all(SEVEN_DIGITS.fullmatch(k) and SEVEN_DIGITS.fullmatch(v) for k, v in pairs)
    assert not any(k in own or v in own for k, v in pairs)
    assert len({k for k, _ in pairs}) == len(pairs)


def test_only_niah_takes_the_needle_haystack():
    with pytest.raises(KvpotError, match="unknown haystack 'needles'"):
        make_sample("passkey", TOKENIZER, 1000, haystack="needles")
    with pytest.raises(KvpotError, match="too short"):
        sample("niah_multikey_3", 150)


def test_ruler_loads_and_scores_the_needle_tasks():
    items = load_items("ruler", tokenizer=TOKENIZER, lengths=[1200], samples=2, seed=11, tasks=list(TASKS))
    assert [i.task for i in items] == [TASKS[0]] * 2 + [TASKS[1]] * 2
    assert len({i.extra["seed"] for i in items}) == 4
    for item in items:
        context, question = item.make_ids()
        assert len(context) == 1200 and item.max_new_tokens == 128
        (answer,) = item.answers
        assert TOKENIZER.decode(context).count(answer) == 1  # the probe's answer is the built sample's
        assert ruler.score(item, f" {answer}.") == 1.0 and ruler.score(item, " 1234567.") == 0.0
    assert "niah_multikey_2" in ruler.TASKS and "niah_multikey_3" in ruler.TASKS
    assert ruler.task_config("niah_multikey_3") == "niah"


def test_eval_ruler_runs_the_needle_tasks_on_the_reference_model(capsys, tmp_path):
    out = tmp_path / "ruler"
    code, _, err = run(capsys, "eval", "ruler", "--tasks", "niah_multikey_2,niah_multikey_3", "--lengths", "1000",
                       "--samples", "1", "--templates", "0", "--chat", "plain", "--method", "full",
                       "--max-new-tokens", "12", "--device", "cpu", "--out", str(out))
    assert code == 0, err
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["subtask"] for r in rows) == list(TASKS)
    assert all(r["stats"]["context_tokens"] == 1001 and 0.0 <= r["score"] <= 1.0 for r in rows)  # + BOS
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["tasks"]) == set(TASKS)
