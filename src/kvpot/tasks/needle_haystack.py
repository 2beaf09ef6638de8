"""A haystack made of needles: RULER's ``type_haystack: needle`` (niah_multikey_2 and niah_multikey_3).

RULER's hardest retrieval tasks hide the asked needle among needles of the same shape, "One of the
special magic numbers for {key} is: {value}." with other keys and values, one needle a line, so
nothing but the key tells the asked needle apart (Hsieh et al. 2024, sec. 3.1, "multi-keys NIAH":
"a full haystack of needles"). Here ``niah(haystack="needles")`` takes its filler from
:func:`needle_pieces`: an endless stream of such lines, each one piece, so the placement's sentence
boundaries (kvpot.tasks.placement) are needle boundaries and a context holds whole needles only
(the partial needles at its two ends become newlines, as the other haystacks' partial sentences).

Every key of the context is distinct: the stream never repeats a key nor draws one of the sample's
own keys or values, and its values are never the sample's answers, so exactly one line carries the
asked key. Word keys are adjective-noun pairs over a vocabulary larger than
:data:`~kvpot.tasks.keys.ALL_WORD_KEYS` (which a 128K-token haystack of needles would exhaust), the
haystack grammar's words added; past its pairs (about 23,000, some 400K tokens of needles) the
stream goes on with adjective-adjective-noun keys. The sample's own word keys come from the same
pairs (:func:`needle_keys`), so the asked key looks like the others.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence

from kvpot.errors import KvpotError
from kvpot.tasks.haystack import ADJECTIVES, COLORS, NOUNS, OBJECTS, PLACES, Codec
from kvpot.tasks.keys import KEY_ADJECTIVES, KEY_NOUNS, draw, make_uuid

#: niah's ``haystack`` value that selects this haystack (not in HAYSTACKS: only niah has it)
NEEDLES = "needles"

_ADJS = tuple(dict.fromkeys(KEY_ADJECTIVES + ADJECTIVES + COLORS))
_NOUNS = tuple(dict.fromkeys(w for w in KEY_NOUNS + NOUNS + OBJECTS + PLACES if " " not in w))
PAIRS = len(_ADJS) * len(_NOUNS)


def _pair(i: int) -> str:
    return f"{_ADJS[i // len(_NOUNS)]}-{_NOUNS[i % len(_NOUNS)]}"


def line(needle: str) -> str:
    """A niah wording's needle as a line of the haystack of needles (RULER joins them with newlines)."""
    return "\n" + needle.strip()


def needle_keys(rng: random.Random, n: int, fmt: str, digits: int = 7) -> list[str]:
    """``n`` distinct keys of format ``fmt`` drawn as the haystack's own (words: from the same pairs)."""
    if fmt == "words":
        return [_pair(i) for i in rng.sample(range(PAIRS), n)]
    return draw(rng, n, fmt, digits)


def _word_keys(rng: random.Random) -> Iterator[str]:
    """Every adjective-noun pair once, in seeded order, then adjective-adjective-noun keys."""
    for i in rng.sample(range(PAIRS), PAIRS):
        yield _pair(i)
    while True:
        first, second = rng.sample(_ADJS, 2)
        yield f"{first}-{second}-{rng.choice(_NOUNS)}"


def _one(rng: random.Random, fmt: str, digits: int) -> Callable[[], str]:
    """A function drawing one value of format ``fmt`` (repeats allowed)."""
    if fmt == "digits":
        return lambda: str(rng.randrange(10 ** (digits - 1), 10**digits))
    if fmt == "uuid":
        return lambda: make_uuid(rng)
    return lambda: _pair(rng.randrange(PAIRS))


def _distinct_keys(rng: random.Random, fmt: str, digits: int, taken: set[str]) -> Iterator[str]:
    """Endless keys of format ``fmt``, none repeated and none in ``taken``."""
    source = _word_keys(rng) if fmt == "words" else iter(_one(rng, fmt, digits), None)
    space = 9 * 10 ** (digits - 1) if fmt == "digits" else None
    seen = set(taken)
    for key in source:
        if key not in seen:
            seen.add(key)
            yield key
        elif space is not None and len(seen) >= space:
            raise KvpotError(f"the haystack of needles ran out of distinct {digits}-digit keys; use more digits, "
                             "word or uuid keys, or a shorter length.")


def needle_pieces(codec: Codec, seed: int, needle: str, key_format: str, value_format: str, digits: int,
                  own: Sequence[str]) -> Iterator[list[int]]:
    """Endless distractor needles as id lists, one needle (``needle`` formatted) a piece.

    ``own``: the sample's keys and values, which no distractor key takes and no distractor value
    repeats. The stream depends on ``seed`` and the options only, not on the length.
    """
    rng = random.Random(f"kvpot/needle-haystack/{seed}")
    taken = set(own)
    keys = _distinct_keys(rng, key_format, digits, taken)
    value = _one(rng, value_format, digits)
    for key in keys:
        v = value()
        while v in taken or v == key:
            v = value()
        yield codec.cont(needle.format(key=key, value=v))
