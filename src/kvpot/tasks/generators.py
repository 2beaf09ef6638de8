"""Deterministic synthetic long-context tasks: passkey, niah, kv, vt, recall.

Every generator returns a :class:`Sample` whose ``context_ids`` are *exactly*
``length`` tokens of the given tokenizer, built by concatenating id lists (see
:mod:`kvpot.tasks.haystack` for why), with the needles at known token spans.

Layout of a context::

    header | filler ... needle ... filler ... needle ... filler (cut to length)

``question`` starts with ``"\\n"`` and ``question_ids`` are its ids *as they
follow the context*, so ``context_ids + question_ids`` is the whole prompt
(add BOS in front if your model wants one).

Depth (how a needle is placed).  With ``H`` the header's tokens, ``N`` the
needle's tokens and ``L = length``, a needle of depth ``d`` starts at token::

    target = H + d * (L - H - N)

i.e. ``d`` is the fraction of the positions the needle *can* start at, after
the header: 0 puts it right after the header, 1 makes it end at the last token
(RULER likewise measures depth over the haystack, not over the header).  The
start lands within ``1%`` of ``L`` of ``target``: it is moved to the nearest
sentence boundary of the filler when one is that close; otherwise the filler
before it is started part-way into a sentence (shifting every boundary) so
that the needle still starts on a boundary, exactly at ``target``.  For long
contexts ``H`` and ``N`` are negligible and ``start / L ~= d``.

passkey, niah and vt keep whole sentences only: the partial sentences at the
filler's two ends (the start shift above, and the cut at ``L``) become newline
tokens, so no text stops mid-sentence before a needle or the question.  They
also have several wordings (``template``, :data:`TEMPLATES`); passkey and niah
take key formats (``key_format``, niah's ``value_format``: digits, words,
uuid; :mod:`kvpot.tasks.keys`) and a number length (``digits``).

Multi-needle tasks place one *primary* needle at ``depth`` as above (niah and
kv: the first needle of the first queried key; recall: the first fact; vt:
the value assignment of the queried chain, with ``N`` its whole chain so the
chain fits after it) and spread the others evenly (see each task).
``Sample.needle_spans[0]`` is the primary needle's span; the rest follow in
context order.

Randomness comes from ``random.Random`` seeded with strings (stable across
processes and Python runs); the needles depend on ``(task, seed, options)``
only, not on ``length`` or ``depth``, so one seed is one needle at any length.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Iterator
from typing import Any

from kvpot.errors import KvpotError
from kvpot.tasks.haystack import Codec, codec_for, filler_pieces
from kvpot.tasks.keys import ALL_WORD_KEYS as _ALL_KEYS
from kvpot.tasks.keys import KEY_ADJECTIVES, KEY_NOUNS, check_format, draw  # noqa: F401 - re-exported
from kvpot.tasks.keys import draw_distinct
from kvpot.tasks.keys import make_uuid as _uuid
from kvpot.tasks.needle_haystack import NEEDLES, line, needle_keys, needle_pieces
from kvpot.tasks.placement import (  # Sample is part of this module's interface
    _build,
    _check_common,
    _count,
    _join,
    _Needle,
    _needle,
    _rng,
    Sample,
    _spread,
    _values,
)
from kvpot.tasks.wording import (  # noqa: F401 - the wordings are part of this module's interface
    NIAH_HEADER,
    NIAH_NEEDLE,
    NIAH_QUESTION,
    NIAH_TEMPLATES,
    PASSKEY_HEADER,
    PASSKEY_NEEDLE,
    PASSKEY_QUESTION,
    PASSKEY_TEMPLATES,
    TEMPLATES,
    VT_FIRST,
    VT_HEADER,
    VT_HOP,
    VT_QUESTION,
    VT_TEMPLATES,
    Wording,
    _wording,
    template_count,
)

# --------------------------------------------------------------------------- wording (passkey and niah: tasks/wording.py)

KV_HEADER = (
    "Extract the value corresponding to the specified key in the JSON object below."
    "\n\nJSON data:\n{"
)
KV_SPREAD_HEADER = "Extract the value corresponding to the specified key in the text below."
KV_LINE = '\n"{key}": "{value}",'
KV_QUESTION = '\nWhat is the value of the key "{key}"? The value of the key "{key}" is'

RECALL_HEADER = "Read the following text."
RECALL_INSTRUCTION = "List the important facts stated above:"
RECALL_FACTS = (
    " The pass key is {n5}.",
    " The special magic number for {key} is: {n7}.",
    " The secret word for {key} is {word}.",
)



# --------------------------------------------------------------------------- tasks


def passkey(
    tokenizer: Any,
    length: int,
    depth: float = 0.5,
    seed: int = 0,
    haystack: str = "repeat",
    digits: int = 5,
    template: int = 0,
    key_format: str = "digits",
) -> Sample:
    """Passkey retrieval (Mohtashami & Jaggi 2023; used by InfiniPot and CItruS).

    One needle with a seeded key, worded by ``PASSKEY_TEMPLATES[template]``:
    a ``digits``-digit number (``key_format="digits"``), an adjective-noun
    word pair (``"words"``) or a UUID (``"uuid"``; :mod:`kvpot.tasks.keys`).
    answers = ``[key]``; metric: exact match on the first run of the key's
    shape.  The filler holds whole sentences only (see
    ``placement._whole_sentences``).
    """
    _check_common(length, depth, seed, haystack)
    wording = _wording("passkey", template)
    codec = codec_for(tokenizer)
    key = draw(_rng("passkey", seed), 1, check_format("key_format", key_format), _digits(digits, 1))[0]
    needle = _needle(codec, wording.needle.format(key=key), depth)
    return _build(
        "passkey", codec, wording.header, [needle], filler_pieces(haystack, codec, seed),
        wording.question, [key], length=length, depth=depth, seed=seed,
        options={"haystack": haystack, "digits": digits, "template": template, "key_format": key_format},
        whole_sentences=True,
    )


def niah(
    tokenizer: Any,
    length: int,
    depth: float = 0.5,
    seed: int = 0,
    haystack: str = "repeat",
    num_keys: int = 1,
    num_values: int = 1,
    num_queries: int = 1,
    digits: int = 7,
    template: int = 0,
    key_format: str = "words",
    value_format: str = "digits",
) -> Sample:
    """RULER needle-in-a-haystack: single, multi-key, multi-value and multi-query.

    ``num_keys`` keys each get ``num_values`` distinct values, one needle per
    (key, value); keys are ``key_format`` ("words": adjective-noun, RULER's
    default; "digits"; "uuid"), values ``value_format`` ("digits": ``digits``
    digits, RULER's numbers; "words"; "uuid": RULER's niah_single_3), worded by
    ``NIAH_TEMPLATES[template]``; the first ``num_queries`` keys are asked
    for.  The first value of the first queried key is the primary needle at
    ``depth``; the others, in seeded order, on evenly spread slots.  answers =
    every value of the queried keys; metric: contains (one answer) or all-of.
    The filler holds whole sentences only; ``haystack="needles"``: it is other
    needles, one a line (RULER's niah_multikey_2/3; :mod:`kvpot.tasks.needle_haystack`).
    """
    in_needles = haystack == NEEDLES
    _check_common(length, depth, seed, "repeat" if in_needles else haystack)
    wording = _wording("niah", template)
    num_keys = _count("num_keys", num_keys, len(_ALL_KEYS))
    num_values = _count("num_values", num_values, 1000)
    num_queries = _count("num_queries", num_queries, num_keys)
    check_format("key_format", key_format)
    check_format("value_format", value_format)
    codec = codec_for(tokenizer)
    rng = _rng("niah", seed)
    key_digits = _digits(digits, num_keys) if key_format == "digits" else 7
    keys = (needle_keys if in_needles else draw)(rng, num_keys, key_format, key_digits)
    values = draw_distinct(rng, keys, num_keys * num_values, value_format, _digits(digits, num_keys * num_values))
    form = line(wording.needle) if in_needles else wording.needle
    texts = [
        form.format(key=k, value=values[i * num_values + j])
        for i, k in enumerate(keys)
        for j in range(num_values)
    ]
    others = texts[1:]
    rng.shuffle(others)
    depths = _spread(depth, len(texts))
    needles = [_needle(codec, t, d) for t, d in zip([texts[0], *others], depths)]
    queried = keys[:num_queries]
    answers = values[: num_queries * num_values]
    pieces = (needle_pieces(codec, seed, form, key_format, value_format, digits, keys + values) if in_needles
              else filler_pieces(haystack, codec, seed))
    return _build(
        "niah", codec, wording.header, needles, pieces,
        wording.question.format(keys=_join(queried)), answers, length=length, depth=depth,
        seed=seed, whole_sentences=True,
        options={"haystack": haystack, "num_keys": num_keys, "num_values": num_values,
                 "num_queries": num_queries, "digits": digits, "template": template, "key_format": key_format,
                 "value_format": value_format},
    )


def _digits(digits: Any, needed: int) -> int:
    """Validate a key length: 2 to 12 digits, with room for ``needed`` distinct numbers."""
    digits = _count("digits", digits, 12)
    if digits < 2 or needed > 9 * 10 ** (digits - 1):
        raise KvpotError(f"digits={digits} cannot give {needed} distinct numbers; use 2 to 12 digits "
                         "(more for many needles).")
    return digits


def _kv_lines(codec: Codec, seed: int, exclude: str, per_piece: int = 8) -> Iterator[list[int]]:
    """Endless distractor ``"key": "value"`` lines (the haystack of kv's fill mode).

    Lines are tokenized ``per_piece`` at a time: random hex defeats every cache,
    so the tokenizer call is the cost, and one call per line made a 1M-token
    context take seconds.  Pieces still end on line ends, so the queried line
    always starts on one.
    """
    rng = random.Random(f"kvpot/kv-pairs/{seed}")
    while True:
        lines = []
        while len(lines) < per_piece:
            key, value = _uuid(rng), _uuid(rng)
            if key != exclude:
                lines.append(KV_LINE.format(key=key, value=value))
        yield codec.cont("".join(lines))


def kv(
    tokenizer: Any,
    length: int,
    depth: float = 0.5,
    seed: int = 0,
    haystack: str = "repeat",
    num_pairs: int | None = None,
) -> Sample:
    """Key-value retrieval with random UUID keys and values (Lost in the Middle, InfiniteBench).

    ``num_pairs=None`` (default): the context is a JSON-ish object whose lines
    ``"key": "value",`` fill it entirely (the haystack is the other pairs, so
    ``haystack`` must stay "repeat"); the queried line sits at ``depth``.
    ``num_pairs=N``: N pair lines spread through the prose ``haystack`` like
    niah needles, the queried one at ``depth``.  answers = ``[value]``;
    metric: exact match.
    """
    _check_common(length, depth, seed, haystack)
    codec = codec_for(tokenizer)
    rng = _rng("kv", seed)
    if num_pairs is None:
        if haystack != "repeat":
            raise KvpotError(
                "kv without num_pairs fills the context with key/value pairs and takes no "
                "haystack; drop haystack= or pass num_pairs=N to spread N pairs through it."
            )
        key, value = _uuid(rng), _uuid(rng)
        needles = [_needle(codec, KV_LINE.format(key=key, value=value), depth)]
        return _build(
            "kv", codec, KV_HEADER, needles, _kv_lines(codec, seed, key),
            KV_QUESTION.format(key=key), [value], length=length, depth=depth, seed=seed,
            options={"haystack": "pairs", "num_pairs": None},
        )
    num_pairs = _count("num_pairs", num_pairs)
    pairs = [(_uuid(rng), _uuid(rng)) for _ in range(num_pairs)]
    key, value = pairs[0]
    needles = [
        _needle(codec, KV_LINE.format(key=k, value=v), d)
        for (k, v), d in zip(pairs, _spread(depth, num_pairs))
    ]
    return _build(
        "kv", codec, KV_SPREAD_HEADER, needles, filler_pieces(haystack, codec, seed),
        KV_QUESTION.format(key=key), [value], length=length, depth=depth, seed=seed,
        options={"haystack": haystack, "num_pairs": num_pairs},
    )


def _var_names(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct 5-letter upper-case variable names."""
    names: list[str] = []
    while len(names) < n:
        name = "".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5))
        if name not in names:
            names.append(name)
    return names


def vt(
    tokenizer: Any,
    length: int,
    depth: float = 0.5,
    seed: int = 0,
    haystack: str = "repeat",
    num_chains: int = 1,
    num_hops: int = 4,
    template: int = 0,
) -> Sample:
    """RULER variable tracking: ``VAR A = 12345. VAR B = VAR A. ...``.

    Worded by ``VT_TEMPLATES[template]`` (0: RULER's); the filler holds whole
    sentences only, as passkey's and niah's.

    ``num_chains`` chains of ``num_hops`` hops each (``num_hops + 1`` variables),
    every chain with its own 5-digit value.  Chain 0 is queried: its value
    assignment is the primary needle at ``depth`` (measured with the whole
    chain's length, so the chain always fits after it) and its hops follow
    evenly spread over the rest of the context.  The other chains' links sit on
    interleaved, evenly spread slots, always in chain order.  answers = the
    queried chain's variable names; metric: all-of.
    """
    _check_common(length, depth, seed, haystack)
    wording = _wording("vt", template)
    num_chains = _count("num_chains", num_chains, 1000)
    num_hops = _count("num_hops", num_hops, 1000)
    codec = codec_for(tokenizer)
    rng = _rng("vt", seed)
    names = _var_names(rng, num_chains * (num_hops + 1))
    values = _values(rng, num_chains, 5)
    chains = [names[c * (num_hops + 1): (c + 1) * (num_hops + 1)] for c in range(num_chains)]

    def links(c: int) -> list[str]:
        chain = chains[c]
        first = wording.needle.format(name=chain[0], value=values[c])
        return [first] + [wording.hop.format(name=n, prev=p) for p, n in zip(chain, chain[1:])]

    query = [codec.cont(t) for t in links(0)]
    reach = sum(len(ids) for ids in query)
    levels = num_hops + 1
    needles = [_Needle(links(0)[0], query[0], depth, reach)]
    needles += [
        _Needle(t, ids, depth + (1 - depth) * j / levels)
        for j, (t, ids) in enumerate(zip(links(0), query))
        if j
    ]
    for c in range(1, num_chains):
        offset = (c - 0.5) / (num_chains - 1)
        needles += [_needle(codec, t, (j + offset) / levels) for j, t in enumerate(links(c))]
    question = wording.question.format(value=values[0], count=levels)
    return _build(
        "vt", codec, wording.header, needles, filler_pieces(haystack, codec, seed), question,
        list(chains[0]), length=length, depth=depth, seed=seed, whole_sentences=True,
        options={"haystack": haystack, "num_chains": num_chains, "num_hops": num_hops, "template": template},
    )


def _facts(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct fact sentences: one pass key, then magic numbers and secret words."""
    keys = rng.sample(_ALL_KEYS, n)
    numbers = _values(rng, n, 7)
    facts = [RECALL_FACTS[0].format(n5=_values(rng, 1, 5)[0])]
    for i in range(1, n):
        template = RECALL_FACTS[1 + i % 2]
        facts.append(template.format(key=keys[i], n7=numbers[i], word=rng.choice(KEY_NOUNS)))
    rng.shuffle(facts)
    return facts


def recall(
    tokenizer: Any,
    length: int,
    depth: float = 0.5,
    seed: int = 0,
    haystack: str = "repeat",
    num_needles: int = 3,
) -> Sample:
    """Question-free recall: facts hidden in the haystack, an instruction after it.

    Nothing before the instruction says which sentences matter, so a KV cache
    that must decide what to keep while reading gets no hint.  ``num_needles``
    distinct facts (:data:`RECALL_FACTS`); the first at ``depth``, the others
    on evenly spread slots.  question = ``"\\n" + RECALL_INSTRUCTION``;
    answers = the fact sentences; metric: all-of (fraction recalled).
    """
    _check_common(length, depth, seed, haystack)
    num_needles = _count("num_needles", num_needles, 1000)
    codec = codec_for(tokenizer)
    facts = _facts(_rng("recall", seed), num_needles)
    needles = [_needle(codec, f, d) for f, d in zip(facts, _spread(depth, num_needles))]
    return _build(
        "recall", codec, RECALL_HEADER, needles, filler_pieces(haystack, codec, seed),
        "\n" + RECALL_INSTRUCTION, [f.strip() for f in facts], length=length, depth=depth,
        seed=seed, options={"haystack": haystack, "num_needles": num_needles},
    )


TASKS: dict[str, Callable[..., Sample]] = {
    "passkey": passkey,
    "niah": niah,
    "kv": kv,
    "vt": vt,
    "recall": recall,
}

_COMMON = ("tokenizer", "length", "depth", "seed", "haystack", "template")


def task_options(task: str) -> dict[str, Any]:
    """The task-specific options of ``task`` and their defaults."""
    if task not in TASKS:
        raise KvpotError(f"unknown task {task!r}; choose one of: {', '.join(TASKS)}.")
    params = inspect.signature(TASKS[task]).parameters
    return {n: p.default for n, p in params.items() if n not in _COMMON}


def make_sample(
    task: str,
    tokenizer: Any,
    length: int,
    depth: float = 0.5,
    seed: int = 0,
    haystack: str = "repeat",
    template: int = 0,
    **options: Any,
) -> Sample:
    """Generate one sample of ``task``; same arguments, same sample.

    ``template`` picks the wording (:data:`TEMPLATES`; 0 for tasks with one).
    Unknown tasks or options, bad values, and lengths too short for the header
    and needles raise :class:`~kvpot.errors.KvpotError`.
    """
    allowed = task_options(task)
    for name in options:
        if name not in allowed:
            valid = ", ".join(allowed) or "none"
            raise KvpotError(f"task {task!r} has no option {name!r}; its options are: {valid}.")
    if task in TEMPLATES:
        options["template"] = template
    elif template != 0:
        raise KvpotError(f"task {task!r} has one wording; templates are for: {', '.join(TEMPLATES)}.")
    return TASKS[task](tokenizer, length, depth=depth, seed=seed, haystack=haystack, **options)
