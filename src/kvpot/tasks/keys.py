"""What the needles hold: pass keys, niah's names and values, in several formats.

A score on one key format measures the format too (issue 32: a model may copy seven digits and
garble a UUID), so the tasks that hide a key take its format as an option, with RULER's three
kinds (``synthetic.yaml``'s ``type_needle_k`` / ``type_needle_v``):

==========  ==========================================  ======================================
format      what it looks like                          RULER's name
==========  ==========================================  ======================================
``digits``  ``8293051`` (``digits`` digits, no leading  ``numbers``
            zero)
``words``   ``fluffy-penguin`` (adjective-noun, words   ``words``
            disjoint from the haystack vocabulary)
``uuid``    ``0d9f5c6e-5a41-4b5e-8f0d-3b1c9e2a7f44``    ``uuids``
==========  ==========================================  ======================================

Every key is drawn from a ``random.Random`` the task seeds, so one seed is one key at any length.
"""

from __future__ import annotations

import random
import re
import uuid
from typing import Any

from kvpot.errors import KvpotError

FORMATS = ("digits", "words", "uuid")

#: The option holding the format of what a task's needle hides and the question asks for: passkey's key,
#: niah's value (its key only names the needle). `kvpot eval --key-formats` spreads samples over it.
FORMAT_OPTION = {"passkey": "key_format", "niah": "value_format"}

#: Words of niah/recall keys ("adjective-noun"); disjoint from the haystack vocabulary.
KEY_ADJECTIVES = (
    "abundant", "adorable", "ambitious", "ancient", "awesome", "bashful", "bitter", "blissful",
    "breezy", "bumpy", "chilly", "chubby", "clumsy", "cosmic", "crispy", "dazzling", "delicate",
    "dizzy", "eager", "elegant", "fancy", "fluffy", "fuzzy", "giant", "glossy", "grumpy",
    "handsome", "hungry", "icy", "itchy", "jagged", "juicy", "kind", "lively", "massive",
    "mellow", "misty", "nimble", "obedient", "odd", "playful", "puzzled", "quaint", "quirky",
    "scary", "shiny", "spicy", "tasty", "thirsty", "vivid", "wobbly", "zealous",
)
KEY_NOUNS = (
    "acorn", "anchor", "antelope", "apricot", "avocado", "balloon", "banana", "biscuit",
    "blueberry", "butterfly", "cactus", "camel", "canyon", "cherry", "cobra", "comet", "crayon",
    "cricket", "dolphin", "dragon", "eagle", "elephant", "falcon", "flamingo", "galaxy",
    "giraffe", "glacier", "hamster", "hedgehog", "iguana", "jaguar", "jellyfish", "kangaroo",
    "koala", "lemon", "lobster", "mango", "meteor", "nectar", "octopus", "panda", "parrot",
    "peacock", "penguin", "pepper", "pineapple", "raccoon", "rocket", "saturn", "tulip",
    "volcano", "walrus", "zebra",
)
ALL_WORD_KEYS = tuple(f"{a}-{n}" for a in KEY_ADJECTIVES for n in KEY_NOUNS)

#: The shape of a key in each format, as a prediction is searched for it (kvpot.tasks.metrics).
SHAPES = {
    "digits": re.compile(r"\d+"),
    "words": re.compile(r"[A-Za-z]+(?:-[A-Za-z]+)+"),
    "uuid": re.compile(r"[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}"),
}


def check_format(name: str, value: Any) -> str:
    """``value`` if it is a key format, else a KvpotError naming the formats."""
    if value not in FORMATS:
        raise KvpotError(f"{name} must be one of {', '.join(FORMATS)}, got {value!r}.")
    return value


def make_uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def draw(rng: random.Random, n: int, fmt: str, digits: int = 7) -> list[str]:
    """``n`` distinct keys of format ``fmt`` (``digits`` digits for numbers)."""
    if fmt == "digits":
        return [str(v) for v in rng.sample(range(10 ** (digits - 1), 10**digits), n)]
    if fmt == "words":
        if n > len(ALL_WORD_KEYS):
            raise KvpotError(f"{n} word keys asked for; there are {len(ALL_WORD_KEYS)}.")
        return rng.sample(ALL_WORD_KEYS, n)
    keys: list[str] = []
    while len(keys) < n:  # 122 random bits: a repeat is practically impossible, but checked
        key = make_uuid(rng)
        if key not in keys:
            keys.append(key)
    return keys


def draw_distinct(rng: random.Random, taken: list[str], n: int, fmt: str, digits: int = 7) -> list[str]:
    """``draw(rng, n, fmt, digits)`` with none of ``taken`` (niah's values apart from its keys, else the question
    is ambiguous): the first draw when it clashes with none (so every sample made before clashes were redrawn
    is unchanged), else its clashing values replaced by further seeded draws (word keys with word values)."""
    values, taken = draw(rng, n, fmt, digits), set(taken)
    for _ in range(100):
        kept = [v for v in values if v not in taken]
        if len(kept) == n:
            return values
        for value in draw(rng, n, fmt, digits):
            if len(kept) < n and value not in taken and value not in kept:
                kept.append(value)
        values = kept
    raise KvpotError(f"could not draw {n} {fmt} values distinct from {len(taken)} keys; give key_format and "
                     "value_format different formats, or fewer needles.")


def format_of(key: str) -> str:
    """The format a key was drawn in (the answer's shape decides how a prediction is matched)."""
    for fmt in ("uuid", "digits", "words"):
        if SHAPES[fmt].fullmatch(key):
            return fmt
    return "other"
