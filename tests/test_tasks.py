"""Tests of kvpot.tasks: exact lengths, depths, determinism, recoverable answers, metrics.

Tokenizers are built here with the ``tokenizers`` library (no downloads): a
byte-level one, two BPEs trained in-test (SentencePiece-like Metaspace and
GPT-2-like ByteLevel, so pieces do *not* map to bytes and leading spaces
matter), a raw ``tokenizers.Tokenizer`` (encode returns an Encoding), and a
ten-line pure-Python byte tokenizer (the minimal interface).
"""

from __future__ import annotations

import itertools
import random
import re
import string
import time

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvpot.errors import KvpotError
from kvpot.tasks import (
    HAYSTACKS,
    RECALL_INSTRUCTION,
    TASKS,
    Sample,
    exact_match,
    make_sample,
    score,
    string_match_all,
    string_match_any,
    task_options,
)
from kvpot.tasks import generators as g
from kvpot.tasks import haystack as h

# --------------------------------------------------------------------------- tokenizers


class PyBytes:
    """The minimal tokenizer interface kvpot.tasks needs."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def _byte_level() -> PreTrainedTokenizerFast:
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


def _corpus() -> list[str]:
    """Text to train the BPEs on: filler, needles' words, and (little) digits."""
    rng = random.Random(0)
    sents = h.varied_sentences(rng)
    lines = [" ".join(next(sents) for _ in range(20)) for _ in range(200)]
    lines += [" ".join(h.REPEAT_SENTENCES)] * 50
    lines += [g.PASSKEY_HEADER, g.NIAH_HEADER, g.VT_HEADER, g.KV_HEADER, g.RECALL_HEADER] * 10
    return lines


def _bpe(kind: str) -> PreTrainedTokenizerFast:
    if kind == "metaspace":
        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
        tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
        alphabet = list(string.printable)
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["[UNK]"], initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def toks() -> dict:
    raw = _byte_level().backend_tokenizer
    return {
        "bytes": _byte_level(),
        "metaspace": _bpe("metaspace"),
        "gpt2": _bpe("gpt2"),
        "raw": raw,
        "py": PyBytes(),
    }


BYTE_LIKE = ("bytes", "py")
ALL_TOKS = ("bytes", "metaspace", "gpt2", "raw", "py")
CASES = [  # (task, options) covering every task and option
    ("passkey", {}),
    ("niah", {}),
    ("niah", {"num_keys": 2, "num_values": 2, "num_queries": 2}),
    ("kv", {}),
    ("kv", {"num_pairs": 5}),
    ("vt", {}),
    ("vt", {"num_chains": 3, "num_hops": 2}),
    ("recall", {}),
    ("recall", {"num_needles": 5}),
]


def _encode(tok, text: str) -> list[int]:
    out = tok.encode(text, add_special_tokens=False)
    return list(getattr(out, "ids", out))


def _header(task: str, options: dict) -> str:
    if task == "kv":
        return g.KV_SPREAD_HEADER if options.get("num_pairs") else g.KV_HEADER
    return {"passkey": g.PASSKEY_HEADER, "niah": g.NIAH_HEADER, "vt": g.VT_HEADER,
            "recall": g.RECALL_HEADER}[task]


def _target(tok, s: Sample) -> float:
    """Where the primary needle should start (the module docstring's definition)."""
    H = len(_encode(tok, _header(s.task, s.options)))
    a, b = s.needle_spans[0]
    reach = b - a
    if s.task == "vt":  # the queried chain must fit after its first link
        chain = [sp for sp in s.needle_spans if _text(tok, s, sp).split()[1] in s.answers]
        reach = sum(e - st for st, e in chain)
    return H + s.depth * (s.length - H - reach)


def _text(tok, s: Sample, span: tuple[int, int]) -> str:
    return tok.decode(s.context_ids[span[0]: span[1]]).strip()


# --------------------------------------------------------------------------- length, depth


@pytest.mark.parametrize("tok_name", ALL_TOKS)
@pytest.mark.parametrize("task,options", CASES)
@pytest.mark.parametrize("length", [512, 2048, 10_000])
def test_exact_length_and_needles_recoverable(toks, tok_name, task, options, length):
    tok = toks[tok_name]
    for haystack in ("repeat", "varied") if task != "kv" or options else ("repeat",):
        s = make_sample(task, tok, length, depth=0.37, seed=3, haystack=haystack, **options)
        assert len(s.context_ids) == length
        assert s.context == tok.decode(s.context_ids)
        assert s.question_ids == _encode(tok, "a" + s.question)[len(_encode(tok, "a")):]
        spans = sorted(s.needle_spans)
        assert all(0 <= a < b <= length for a, b in spans)
        assert all(b1 <= a2 for (_, b1), (a2, _) in zip(spans, spans[1:])), "needles overlap"
        for answer in s.answers:
            assert answer in s.context
            assert any(answer in _text(tok, s, sp) for sp in s.needle_spans), answer


@pytest.mark.parametrize("tok_name", ["bytes", "metaspace", "gpt2"])
@pytest.mark.parametrize("task,options", CASES)
@pytest.mark.parametrize("length", [512, 2048, 10_000])
def test_primary_needle_depth_within_one_percent(toks, tok_name, task, options, length):
    tok = toks[tok_name]
    for depth in (0.0, 0.1, 0.25, 0.5, 0.77, 0.9, 1.0):
        for haystack in ("repeat", "varied") if task != "kv" or options else ("repeat",):
            s = make_sample(task, tok, length, depth=depth, seed=11, haystack=haystack, **options)
            start = s.needle_spans[0][0]
            assert abs(start - _target(tok, s)) <= 0.01 * length, (depth, haystack, start)


def test_depth_is_the_plain_fraction_for_long_contexts(toks):
    for depth in (0.0, 0.2, 0.5, 0.8, 1.0):
        s = make_sample("passkey", toks["py"], 100_000, depth=depth, seed=2)
        assert abs(s.needle_spans[0][0] / s.length - depth) <= 0.01


@pytest.mark.parametrize("tok_name", ["bytes", "metaspace", "gpt2"])
@pytest.mark.parametrize("task,options", CASES)
@pytest.mark.parametrize("length", [700, 2048, 20_000])
def test_needles_sit_at_sentence_boundaries(toks, tok_name, task, options, length):
    tok = toks[tok_name]
    for depth, seed in itertools.product((0.0, 0.3, 0.6, 1.0), (5, 6)):
        s = make_sample(task, tok, length, depth=depth, seed=seed, haystack="varied"
                        if task != "kv" or options else "repeat", **options)
        for a, b in s.needle_spans:
            before = tok.decode(s.context_ids[:a]).rstrip()
            assert before[-1] in ".,{", before[-40:]
            after = tok.decode(s.context_ids[b:]).lstrip()
            assert not after or after[0].isupper() or after[0] == '"', after[:40]


def test_filler_is_exact_tokenizer_pieces_in_order(toks):
    """The varied filler is the text varied_sentences() gives for the seed, at any length.

    passkey keeps whole sentences: the partial last one is newlines (placement._whole_sentences).
    """
    s = make_sample("passkey", toks["bytes"], 5000, depth=0.0, seed=9, haystack="varied")
    needle_end = s.needle_spans[0][1]
    filler = s.context[needle_end:].rstrip("\n")
    sents = h.varied_sentences(h.haystack_rng(9))
    text = "".join(next(sents) for _ in range(200))
    assert text.startswith(filler) and filler.endswith(".")


def test_context_plus_question_is_the_prompt(toks):
    tok = toks["bytes"]
    s = make_sample("niah", tok, 3000, seed=4, num_keys=3)
    assert tok.decode(s.context_ids + s.question_ids) == s.context + s.question
    assert s.question.startswith("\nWhat are all the special magic numbers for ")
    assert s.context.startswith(g.NIAH_HEADER + " ")


# --------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("task,options", CASES)
def test_deterministic_per_seed_and_different_across_seeds(toks, task, options):
    tok = toks["gpt2"]
    a = make_sample(task, tok, 3000, depth=0.4, seed=7, **options)
    b = make_sample(task, tok, 3000, depth=0.4, seed=7, **options)
    assert a == b
    others = {tuple(make_sample(task, tok, 3000, depth=0.4, seed=s, **options).answers)
              for s in range(8, 14)}
    assert tuple(a.answers) not in others and len(others) == 6


def test_needle_depends_on_seed_not_on_length_or_depth(toks):
    a = make_sample("passkey", toks["bytes"], 1000, depth=0.1, seed=3)
    b = make_sample("passkey", toks["py"], 50_000, depth=0.9, seed=3)
    assert a.answers == b.answers and re.fullmatch(r"\d{5}", a.answers[0])


def test_options_are_resolved_and_json_serialisable(toks):
    import json

    s = make_sample("niah", toks["py"], 2000, num_values=2)
    assert s.options == {"haystack": "repeat", "num_keys": 1, "num_values": 2, "num_queries": 1, "digits": 7,
                         "template": 0, "key_format": "words", "value_format": "digits"}
    assert json.loads(json.dumps(s.options)) == s.options
    assert make_sample("kv", toks["py"], 2000).options == {"haystack": "pairs", "num_pairs": None}
    assert task_options("vt") == {"num_chains": 1, "num_hops": 4}
    assert set(TASKS) == {"passkey", "niah", "kv", "vt", "recall"}


# --------------------------------------------------------------------------- task content


def test_passkey_wording(toks):
    s = make_sample("passkey", toks["py"], 2000, seed=1)
    key = s.answers[0]
    assert s.context.startswith(g.PASSKEY_HEADER)
    assert _text(toks["py"], s, s.needle_spans[0]) == (
        f"The pass key is {key}. Remember it. {key} is the pass key.")
    assert s.question == "\nWhat is the pass key? The pass key is"
    assert s.context.count(key) == 2 and s.context.count("pass key") == 2


def test_niah_multi_key_value_query(toks):
    tok = toks["metaspace"]
    s = make_sample("niah", tok, 4000, depth=0.8, seed=2, num_keys=4, num_values=3, num_queries=2)
    needles = [_text(tok, s, sp) for sp in s.needle_spans]
    pat = re.compile(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.")
    pairs = [pat.fullmatch(n).groups() for n in needles]
    assert len(pairs) == 12 and len({v for _, v in pairs}) == 12
    by_key: dict[str, list[str]] = {}
    for k, v in pairs:
        by_key.setdefault(k, []).append(v)
    assert len(by_key) == 4 and all(len(v) == 3 for v in by_key.values())
    queried = [k for k in by_key if k in s.question]
    assert len(queried) == 2 and " and " in s.question
    assert sorted(s.answers) == sorted(v for k in queried for v in by_key[k])
    assert pairs[0][1] == s.answers[0]  # the primary needle is a queried one
    depths = sorted(a / s.length for a, _ in s.needle_spans)
    assert depths[0] < 0.1 and depths[-1] > 0.85  # spread over the context


def test_kv_fill_mode_is_a_lookup_table(toks):
    tok = toks["gpt2"]
    s = make_sample("kv", tok, 6000, depth=0.3, seed=4)
    lines = re.findall(r'"([0-9a-f-]{36})": "([0-9a-f-]{36})",', s.context)
    assert len(lines) > 20
    table = dict(lines)
    assert len(table) == len(lines)  # keys are unique
    (key,) = set(re.findall(r'"([0-9a-f-]{36})"', s.question))
    assert table[key] == s.answers[0]
    assert s.context.startswith(g.KV_HEADER)


def test_kv_spread_mode(toks):
    tok = toks["bytes"]
    s = make_sample("kv", tok, 3000, depth=0.6, seed=4, num_pairs=6, haystack="varied")
    lines = re.findall(r'"([0-9a-f-]{36})": "([0-9a-f-]{36})",', s.context)
    assert len(lines) == 6 and len(s.needle_spans) == 6
    (key,) = set(re.findall(r'"([0-9a-f-]{36})"', s.question))
    assert dict(lines)[key] == s.answers[0]


@pytest.mark.parametrize("num_chains,num_hops", [(1, 4), (3, 2), (2, 6)])
def test_vt_chains_resolve_to_the_answers(toks, num_chains, num_hops):
    """Follow the assignments in context order: the variables holding the value are the answers."""
    s = make_sample("vt", toks["gpt2"], 5000, depth=0.2, seed=8,
                    num_chains=num_chains, num_hops=num_hops)
    env: dict[str, str] = {}
    for name, rhs in re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d{5})\.", s.context):
        env[name] = env[rhs[4:]] if rhs.startswith("VAR ") else rhs  # KeyError if out of order
    assert len(env) == num_chains * (num_hops + 1)
    value = re.search(r"assigned the value (\d{5}) in", s.question).group(1)
    assert sorted(n for n, v in env.items() if v == value) == sorted(s.answers)
    assert len(s.answers) == num_hops + 1
    assert f"{num_hops + 1} variables are assigned the value {value}" in s.question


# --------------------------------------------------------------------------- templates


@pytest.mark.parametrize("task", ["passkey", "niah", "vt"])
def test_templates_differ_in_every_part(toks, task):
    wordings = g.TEMPLATES[task]
    assert len(wordings) >= 3 and g.template_count(task) == len(wordings) and g.template_count("kv") == 1
    for part in ("header", "needle", "question") + (("hop",) if task == "vt" else ()):
        assert len({getattr(w, part) for w in wordings}) == len(wordings), part
    samples = [make_sample(task, toks["gpt2"], 2000, depth=0.4, seed=3, template=t) for t in range(len(wordings))]
    assert len({s.question for s in samples}) == len(wordings)
    assert len({s.context[:80] for s in samples}) == len(wordings)
    assert all(s.answers == samples[0].answers for s in samples)  # the wording changes, not the key
    for t, s in enumerate(samples):
        assert s.options["template"] == t and score(s, " " + " ".join(s.answers) + ".") == 1.0


@pytest.mark.parametrize("tok_name", ["bytes", "metaspace", "gpt2"])
@pytest.mark.parametrize("task,options", [("passkey", {}), ("passkey", {"digits": 7}), ("niah", {}),
                                          ("niah", {"num_keys": 3, "num_values": 2}),
                                          ("passkey", {"key_format": "uuid"}), ("niah", {"value_format": "words"}),
                                          ("vt", {}), ("vt", {"num_chains": 2, "num_hops": 2})])
def test_filler_cuts_fall_on_sentence_ends(toks, tok_name, task, options):
    """The text before every needle and before the question ends a sentence, at any depth and template."""
    tok = toks[tok_name]
    for template, depth, length, haystack in itertools.product(
            range(g.template_count(task)), (0.0, 0.13, 0.5, 0.91, 1.0), (700, 1337, 5000), HAYSTACKS):
        s = make_sample(task, tok, length, depth=depth, seed=length + template, haystack=haystack,
                        template=template, **options)
        assert len(s.context_ids) == length
        for a, _ in s.needle_spans:
            assert tok.decode(s.context_ids[:a]).rstrip()[-1] in ".?:", (template, depth, length)
        assert s.context.rstrip()[-1] == ".", s.context[-60:]
        header = g.TEMPLATES[task][template].header
        first = min(a for a, _ in s.needle_spans)
        start = s.context[len(header): len(tok.decode(s.context_ids[:first]))].lstrip("\n ")
        assert not start or start[0].isupper(), start[:40]  # the filler starts a sentence too


@pytest.mark.parametrize("task", ["passkey", "niah"])
def test_templated_samples_are_deterministic_per_seed(toks, task):
    for template in range(g.template_count(task)):
        a = make_sample(task, toks["metaspace"], 3000, depth=0.3, seed=21, haystack="varied", template=template)
        assert a == make_sample(task, toks["metaspace"], 3000, depth=0.3, seed=21, haystack="varied",
                                template=template)
        assert a.answers != make_sample(task, toks["metaspace"], 3000, depth=0.3, seed=22, template=template).answers


def test_key_formats_and_template_errors(toks):
    assert re.fullmatch(r"\d{7}", make_sample("passkey", toks["py"], 1000, digits=7).answers[0])
    assert re.fullmatch(r"\d{5}", make_sample("niah", toks["py"], 1000, digits=5).answers[0])
    assert task_options("passkey") == {"digits": 5, "key_format": "digits"}
    with pytest.raises(KvpotError, match="templates 0 to 2"):
        make_sample("passkey", toks["py"], 1000, template=3)
    with pytest.raises(KvpotError, match="one wording"):
        make_sample("kv", toks["py"], 1000, template=1)
    with pytest.raises(KvpotError, match="digits"):
        make_sample("passkey", toks["py"], 1000, digits=1)
    with pytest.raises(KvpotError, match="key_format must be one of digits, words, uuid"):
        make_sample("passkey", toks["py"], 1000, key_format="emoji")


@pytest.mark.parametrize("task,option", [("passkey", "key_format"), ("niah", "value_format"),
                                         ("niah", "key_format")])
def test_key_formats_draw_keys_of_their_shape_from_the_seed(toks, task, option):
    """digits / words / uuid (RULER's numbers / words / uuids); the default format keeps the old draws."""
    from kvpot.tasks.keys import SHAPES

    shapes = {}
    for fmt in ("digits", "words", "uuid"):
        s = make_sample(task, toks["metaspace"], 3000, depth=0.6, seed=4, **{option: fmt})
        key = s.answers[0] if option != "key_format" or task == "passkey" else s.question.split("for ")[1].split(" ")[0]
        assert SHAPES[fmt].fullmatch(key.rstrip("?")), (fmt, key)
        assert key.rstrip("?") in s.context and score(s, f" {s.answers[0]}.") == 1.0
        shapes[fmt] = s
    default = make_sample(task, toks["metaspace"], 3000, depth=0.6, seed=4)
    assert default.answers == shapes["digits" if option != "key_format" or task == "passkey" else "words"].answers


def test_key_match_reads_the_first_run_of_the_keys_shape():
    from kvpot.tasks.metrics import key_match

    assert key_match("The pass key is fluffy-penguin.", ["fluffy-penguin"]) == 1.0
    assert key_match("fluffy-panda, or fluffy-penguin", ["fluffy-penguin"]) == 0.0  # the first pair counts
    uid = "0d9f5c6e-5a41-4b5e-8f0d-3b1c9e2a7f44"
    assert key_match(f"It is {uid.upper()}.", [uid]) == 1.0
    assert key_match(f"It is {uid[:-1]}", [uid]) == 0.0  # a character short is no UUID
    assert key_match("The pass key is 71432.", ["71432"]) == 1.0 and key_match("714320", ["71432"]) == 0.0


def test_recall_facts(toks):
    s = make_sample("recall", toks["metaspace"], 4000, seed=6, num_needles=6)
    assert s.question == "\n" + RECALL_INSTRUCTION
    assert len(set(s.answers)) == 6 and len(s.needle_spans) == 6
    assert sum("pass key" in a for a in s.answers) == 1
    assert all(a in s.context for a in s.answers)
    assert _text(toks["metaspace"], s, s.needle_spans[0]) == s.answers[0]


# --------------------------------------------------------------------------- haystack


def test_varied_haystack_has_no_needle_patterns():
    for seed in range(5):
        sents = h.varied_sentences(h.haystack_rng(seed))
        text = "".join(next(sents) for _ in range(5000))
        low = text.lower()
        for pattern in h.NEEDLE_PATTERNS:
            assert pattern.lower() not in low, pattern
        assert not re.search(r"\d", text)
        assert not re.search(r"\bspecial\b|\bmagic\b|\bkey\b|\bnumbers?\b|\bvar\b", low)
        assert not re.search(r"\ba [aeiou]", text)  # "a owl" would read badly
        assert len(set(text.split())) > 300  # a real vocabulary, not a loop


def test_varied_context_digits_come_only_from_the_needle(toks):
    s = make_sample("passkey", toks["gpt2"], 20_000, depth=0.5, seed=1, haystack="varied")
    assert re.findall(r"\d+", s.context) == [s.answers[0]] * 2
    assert s.context.lower().count("pass key") == 2


def test_vocabulary_is_sizeable_and_keys_are_disjoint_from_it():
    words = {w for vocab in h.SLOTS.values() for entry in vocab for w in entry.split()}
    assert len(words) > 300
    key_words = set(g.KEY_ADJECTIVES) | set(g.KEY_NOUNS)
    assert not words & key_words


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda t: make_sample("needle", t, 1000), "choose one of: passkey"),
        (lambda t: make_sample("passkey", t, 1000, num_keys=2), "no option 'num_keys'"),
        (lambda t: make_sample("niah", t, 1000, num_keys=0), "num_keys must be an integer"),
        (lambda t: make_sample("niah", t, 1000, num_keys=2, num_queries=3), "num_queries"),
        (lambda t: make_sample("vt", t, 1000, num_hops="4"), "num_hops"),
        (lambda t: make_sample("passkey", t, 1000, depth=1.5), "between 0.0 and 1.0"),
        (lambda t: make_sample("passkey", t, 0), "positive integer"),
        (lambda t: make_sample("passkey", t, 1000.0), "positive integer"),
        (lambda t: make_sample("passkey", t, 1000, seed="a"), "seed must be an integer"),
        (lambda t: make_sample("passkey", t, 1000, haystack="essays"), "repeat, varied"),
        (lambda t: make_sample("passkey", t, 100), r"use length >= \d+"),
        (lambda t: make_sample("niah", t, 600, num_keys=20), r"use length >= \d+"),
        (lambda t: make_sample("kv", t, 1000, haystack="varied"), "pass num_pairs=N"),
        (lambda t: make_sample("passkey", object(), 1000), "encode"),
    ],
)
def test_bad_input_raises_kvpot_error_saying_what_to_change(toks, call, match):
    with pytest.raises(KvpotError, match=match):
        call(toks["py"])


def test_shortest_length_that_fits_works(toks):
    with pytest.raises(KvpotError) as err:
        make_sample("passkey", toks["gpt2"], 10)
    need = int(re.search(r"length >= (\d+)", str(err.value)).group(1))
    for depth in (0.0, 0.5, 1.0):
        s = make_sample("passkey", toks["gpt2"], need, depth=depth)
        assert len(s.context_ids) == need and s.answers[0] in s.context


# --------------------------------------------------------------------------- metrics


def test_exact_match():
    assert exact_match(" 71432.", ["71432"]) == 1.0
    assert exact_match("The pass key is 71432, remember", ["71432"]) == 1.0
    assert exact_match("714320", ["71432"]) == 0.0
    assert exact_match("7143", ["71432"]) == 0.0
    assert exact_match("12 and then 71432", ["71432"]) == 0.0
    assert exact_match("no idea", ["71432"]) == 0.0
    uid = "2078f55f-6eb1-4980-ad2f-59cedc69828c"
    assert exact_match(f' "{uid.upper()}".', [uid]) == 1.0
    assert exact_match(f' "{uid[:-1]}"', [uid]) == 0.0
    assert exact_match(f" the value {uid}", [uid]) == 0.0


def test_string_match_all_and_any():
    answers = ["1234567", "7654321", "1111111"]
    assert string_match_all("1234567, 7654321 and 1111111", answers) == 1.0
    assert string_match_all("1234567 and 7654321", answers) == pytest.approx(2 / 3)
    assert string_match_all("none", answers) == 0.0
    assert string_match_any("maybe 7654321?", answers) == 1.0
    assert string_match_any("12345", answers) == 0.0
    facts = ["The pass key is 71432.", "The secret word for odd-koala is panda."]
    pred = "the PASS key is 71432\nThe secret  word for odd-koala is panda"
    assert string_match_all(pred, facts) == 1.0
    assert string_match_all("The pass key is 71433.", facts) == 0.0


def test_score_picks_the_metric_per_task(toks):
    tok = toks["py"]
    p = make_sample("passkey", tok, 1000, seed=1)
    assert score(p, " " + p.answers[0]) == 1.0
    assert score(p, " 1" + p.answers[0]) == 0.0
    k = make_sample("kv", tok, 1000, seed=1)
    assert score(k, f' "{k.answers[0]}"') == 1.0
    n1 = make_sample("niah", tok, 1000, seed=1)
    assert score(n1, f"it is {n1.answers[0]}.") == 1.0  # contains, not first-number
    n2 = make_sample("niah", tok, 2000, seed=1, num_values=2)
    assert score(n2, n2.answers[1]) == 0.5
    v = make_sample("vt", tok, 2000, seed=1)
    assert score(v, " ".join(v.answers[:2])) == pytest.approx(2 / 5)
    r = make_sample("recall", tok, 2000, seed=1)
    assert score(r, "\n".join(r.answers)) == 1.0
    assert score("passkey", "123", answers=["123"]) == 1.0
    with pytest.raises(KvpotError, match="answers="):
        score("passkey", "123")
    with pytest.raises(KvpotError, match="no metric"):
        score("summary", "x", answers=["x"])


# --------------------------------------------------------------------------- speed


def test_generation_is_fast(toks):
    """Loose bounds (CI machines vary): a 2048-token sample well under a millisecond here."""
    tok = toks["py"]
    make_sample("passkey", tok, 2048)
    t0 = time.perf_counter()
    for seed in range(200):
        make_sample("passkey", tok, 2048, depth=seed / 200, seed=seed)
    assert (time.perf_counter() - t0) / 200 < 0.005
    t0 = time.perf_counter()
    s = make_sample("passkey", tok, 1_000_000, depth=0.5, seed=1, haystack="varied")
    assert time.perf_counter() - t0 < 5.0 and len(s.context_ids) == 1_000_000


def test_haystacks_listed():
    assert HAYSTACKS == ("repeat", "varied")
