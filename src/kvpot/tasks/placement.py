"""How a task sample is put together: the `Sample` type, needles placed at a depth in filler
(`_assemble`, `_build`), and the argument checks every task shares. The placement rule is
described in :mod:`kvpot.tasks.generators`.
"""

from __future__ import annotations

import random
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from kvpot.errors import KvpotError
from kvpot.tasks.haystack import HAYSTACKS, Codec


# --------------------------------------------------------------------------- sample


@dataclass(frozen=True)
class Sample:
    """One generated example; see the module docstring for layout and depth."""

    task: str
    context: str
    context_ids: list[int]
    question: str
    question_ids: list[int]
    answers: list[str]
    needle_spans: list[tuple[int, int]]
    depth: float
    seed: int
    length: int
    options: dict


@dataclass(frozen=True)
class _Needle:
    """A needle to place: its text, ids, depth, and tokens that must fit after its start."""

    text: str
    ids: Sequence[int]
    depth: float
    reach: int = 0  # tokens from its start that must fit in the context (0: its own length)


# --------------------------------------------------------------------------- placement


def _rng(task: str, seed: int) -> random.Random:
    """The needles' random stream: string-seeded so it is the same in every process."""
    return random.Random(f"kvpot/{task}/{seed}")


def _take(pieces: Iterator[Sequence[int]], buf: list[int], bounds: list[int], n: int) -> None:
    """Extend ``buf`` with whole pieces until it holds ``n`` ids, recording boundaries."""
    while len(buf) < n:
        buf.extend(next(pieces))
        bounds.append(len(buf))


def _nearest(bounds: Sequence[int], x: int, lo: int, hi: int) -> int | None:
    """The boundary in ``[lo, hi]`` nearest to ``x``, or None."""
    i = bisect_left(bounds, x)
    best = None
    for b in bounds[max(0, i - 1): i + 1]:
        if lo <= b <= hi and (best is None or abs(b - x) < abs(best - x)):
            best = b
    return best


def _filler(
    pieces: Iterator[Sequence[int]], budget: int, k: int, tol: int
) -> tuple[list[int], list[int], int]:
    """``budget`` filler ids and their sentence boundaries, with one at (or near) ``k``.

    Returns ``(ids, bounds, k')``.  A boundary within ``tol`` of ``k`` is used
    as is; otherwise the filler starts ``s`` tokens into the stream so that the
    next boundary after ``k`` moves exactly onto ``k`` (``k' == k``).
    """
    buf: list[int] = []
    bounds = [0]
    _take(pieces, buf, bounds, budget)
    b = _nearest(bounds, k, max(0, k - tol), min(budget, k + tol))
    if b is not None:
        return buf[:budget], [x for x in bounds if x <= budget], b
    s = bounds[bisect_left(bounds, k)] - k
    _take(pieces, buf, bounds, budget + s)
    return buf[s: s + budget], [x - s for x in bounds if s <= x <= s + budget], k


def _assemble(
    task: str,
    header: Sequence[int],
    needles: Sequence[_Needle],
    length: int,
    pieces: Iterator[Sequence[int]],
    pad: int | None = None,
) -> tuple[list[int], list[tuple[int, int]]]:
    """Lay out header, filler and needles in exactly ``length`` ids.

    ``needles[0]`` is the primary needle (placed at its depth, see module
    docstring); the others go to their own depths as closely as order and
    sentence boundaries allow.  With ``pad`` (a newline id), the partial
    sentences at the filler's two ends become ``pad`` ids (see
    :func:`_whole_sentences`).  Returns the ids and the needles' spans, in the
    order of ``needles``.
    """
    H = len(header)
    order = sorted(range(len(needles)), key=lambda i: needles[i].depth)  # stable
    sizes = [len(needles[i].ids) for i in order]
    budget = length - H - sum(sizes)
    if budget < 0:
        raise KvpotError(
            f"length {length} is too short for task {task!r}: its header and needles take "
            f"{H + sum(sizes)} tokens with this tokenizer; use length >= {H + sum(sizes)} "
            "(or fewer needles)."
        )
    before = list(accumulate(sizes, initial=0))

    def desired(j: int) -> int:
        nd = needles[order[j]]
        reach = max(nd.reach, len(nd.ids))
        return round(nd.depth * max(0, length - H - reach) - before[j])

    p = order.index(0)
    tol = max(0, int(0.01 * length) - 1)
    filler, bounds, kp = _filler(pieces, budget, min(max(desired(p), 0), budget), tol)
    if pad is not None:
        filler = _whole_sentences(filler, bounds, pad)
    ks = [0] * len(order)
    ks[p] = kp
    for js, lo, hi in ((range(p), 0, kp), (range(p + 1, len(order)), kp, budget)):
        for j in js:
            x = min(max(desired(j), lo), hi)
            snapped = _nearest(bounds, x, lo, hi)
            ks[j] = lo = x if snapped is None else snapped
    ids = list(header)
    spans: list[tuple[int, int]] = [(0, 0)] * len(order)
    prev = 0
    for j, i in enumerate(order):
        ids += filler[prev: ks[j]]
        start = len(ids)
        ids += needles[i].ids
        spans[i] = (start, len(ids))
        prev = ks[j]
    ids += filler[prev:]
    assert len(ids) == length, (len(ids), length)
    return ids, spans


def _whole_sentences(filler: list[int], bounds: Sequence[int], pad: int) -> list[int]:
    """``filler`` with the ids before its first and after its last sentence boundary set to ``pad``.

    The exact length leaves a partial sentence at the end (the text before the
    question stopped mid-sentence, a cue no real document gives) and, when the
    stream was shifted onto a depth, at the start.  Replacing those ids with
    newlines keeps the length and every needle position, and every cut on a
    sentence end.  No boundary at all (a filler shorter than one sentence):
    all padding.
    """
    if not bounds:
        return [pad] * len(filler)
    first, last = bounds[0], bounds[-1]
    return [pad] * first + filler[first:last] + [pad] * (len(filler) - last)


def _spread(depth: float, n: int) -> list[float]:
    """Depths for ``n`` needles: the primary at ``depth``, the others on evenly spaced slots.

    Slots are ``(j + 0.5) / n``; the slot nearest ``depth`` goes to the primary,
    so the others keep away from it.
    """
    slots = [(j + 0.5) / n for j in range(n)]
    slots.pop(min(range(n), key=lambda j: abs(slots[j] - depth)))
    return [depth, *slots]


def _build(
    task: str,
    codec: Codec,
    header: str,
    needles: Sequence[_Needle],
    pieces: Iterator[Sequence[int]],
    question: str,
    answers: list[str],
    *,
    length: int,
    depth: float,
    seed: int,
    options: dict,
    whole_sentences: bool = False,
) -> Sample:
    """Assemble the ids and wrap everything in a :class:`Sample` (``whole_sentences``: see `_assemble`'s pad)."""
    pad = codec.fixed("\n")[-1] if whole_sentences else None
    ids, spans = _assemble(task, codec.fixed(header, cont=False), needles, length, pieces, pad)
    primary, rest = spans[0], sorted(spans[1:])
    return Sample(
        task=task,
        context=codec.decode(ids),
        context_ids=ids,
        question=question,
        question_ids=list(codec.fixed(question)),
        answers=answers,
        needle_spans=[primary, *rest],
        depth=float(depth),
        seed=seed,
        length=length,
        options=options,
    )


def _needle(codec: Codec, text: str, depth: float, reach: int = 0) -> _Needle:
    return _Needle(text, codec.cont(text), depth, reach)


# --------------------------------------------------------------------------- validation


def _check_common(length: Any, depth: Any, seed: Any, haystack: Any) -> None:
    """Reject bad shared arguments with a sentence that says what to change."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise KvpotError(f"length must be a positive integer number of tokens, got {length!r}.")
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0.0 <= depth <= 1.0:
        raise KvpotError(f"depth must be a number between 0.0 and 1.0, got {depth!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise KvpotError(f"seed must be an integer, got {seed!r}.")
    if haystack not in HAYSTACKS:
        raise KvpotError(f"unknown haystack {haystack!r}; choose one of: {', '.join(HAYSTACKS)}.")


def _count(name: str, value: Any, limit: int = 100_000) -> int:
    """Validate a count option (an integer from 1 to ``limit``)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise KvpotError(f"{name} must be an integer from 1 to {limit}, got {value!r}.")
    return value


def _values(rng: random.Random, n: int, digits: int) -> list[str]:
    """``n`` distinct random numbers of exactly ``digits`` digits, as strings."""
    return [str(v) for v in rng.sample(range(10 ** (digits - 1), 10**digits), n)]


def _join(words: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b, and c``."""
    if len(words) <= 2:
        return " and ".join(words)
    return ", ".join(words[:-1]) + ", and " + words[-1]
