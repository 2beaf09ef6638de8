"""Filler text ("haystacks") built at the token-id level, fast and deterministic.

Why ids and not text: a context must be *exactly* ``length`` tokens for any
tokenizer, and a needle must start at a known token.  Tokenizing one long
string and cutting it cannot promise either (BPE merges across the cut, and a
megabyte string takes seconds to tokenize).  So every piece of text -- a filler
sentence, a word of the grammar, a needle -- is tokenized once, *as it would
read in the middle of a text* (see :meth:`Codec.cont`), and contexts are built
by concatenating id lists.  Re-encoding ``decode(context_ids)`` may therefore
give other ids with a BPE tokenizer; ``context_ids`` are the truth.

Two haystacks:

``"repeat"``
    The classic passkey filler, :data:`REPEAT_SENTENCES` in a loop.
``"varied"``
    Sentences drawn (seeded) from a small grammar and a vocabulary of a few
    hundred words shipped here, so the filler is not trivially predictable and
    perplexity over it means something.  The vocabulary has no digits, no
    ``=``, and none of the needle words (``pass``, ``key``, ``magic``,
    ``number``, ``VAR``...), so filler never looks like a needle or an answer.
"""

from __future__ import annotations

import random
import re
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import cycle
from typing import Any

from kvpot.errors import KvpotError

HAYSTACKS = ("repeat", "varied")

REPEAT_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)

#: Substrings that mark a needle; filler must never contain them (checked in tests).
NEEDLE_PATTERNS = ("pass key", "magic number", "VAR ", "=")

# --------------------------------------------------------------------------- vocabulary
# No word starts with a vowel where the grammar puts "a" in front of it, so the
# text reads as English; no word contains a digit or a needle word.

ADJECTIVES = (
    "quiet", "bright", "small", "gentle", "heavy", "narrow", "wide", "curious", "tired",
    "brave", "calm", "distant", "dusty", "famous", "fragile", "friendly", "golden", "hidden",
    "hollow", "humble", "lazy", "lonely", "lucky", "modest", "muddy", "noisy", "patient",
    "polite", "proud", "rapid", "rare", "rough", "rusty", "shy", "silent", "sleepy",
    "smooth", "soft", "sturdy", "sudden", "tall", "tidy", "warm", "wild", "wooden", "young",
    "clever", "cheerful", "careful", "fierce", "gloomy", "jolly", "mighty", "nervous",
    "plain", "restless", "sharp", "stubborn", "tender", "weary",
)
NOUNS = (
    "farmer", "baker", "sailor", "teacher", "painter", "doctor", "child", "traveler",
    "merchant", "shepherd", "fox", "rabbit", "horse", "goat", "heron", "badger", "sparrow",
    "beetle", "dog", "cat", "donkey", "crow", "tortoise", "miller", "weaver", "potter",
    "fisherman", "gardener", "musician", "poet", "carpenter", "hunter", "neighbor",
    "stranger", "soldier", "student", "cousin", "pilgrim", "monk", "tailor", "blacksmith",
    "widow", "priest", "mouse", "squirrel", "swan", "wolf", "bear", "deer", "lamb",
)
OBJECTS = (
    "basket", "lantern", "letter", "kettle", "blanket", "ladder", "bucket", "map", "coat",
    "candle", "bell", "rope", "shovel", "barrel", "wagon", "boat", "drum", "flute", "book",
    "cup", "jar", "saddle", "hammer", "mirror", "scarf", "pillow", "bench", "net", "compass",
    "clock", "feather", "pebble", "loaf", "pumpkin", "carrot", "bottle", "box", "ribbon",
    "spoon", "teapot", "violin", "wheel", "sack", "shawl", "satchel", "quilt", "helmet",
    "paintbrush", "walking stick", "fishing rod",
)
PLACES = (
    "river", "market", "harbor", "forest", "village", "meadow", "bridge", "chapel",
    "orchard", "valley", "mill", "hill", "lake", "garden", "station", "library", "bakery",
    "square", "cottage", "barn", "field", "shore", "cave", "tower", "castle", "farm",
    "school", "inn", "road", "pond", "well", "cliff", "island", "workshop", "stable",
    "vineyard", "quarry", "canal", "monastery", "lighthouse",
)
VERBS = (
    "carried", "painted", "found", "lost", "repaired", "borrowed", "cleaned", "sold",
    "bought", "dropped", "washed", "hid", "moved", "lifted", "opened", "closed", "watched",
    "followed", "admired", "ignored", "polished", "packed", "mended", "measured", "shared",
    "returned", "noticed", "pushed", "pulled", "wrapped", "filled", "emptied", "guarded",
    "chased", "forgot", "described", "stole", "offered", "traded", "inspected",
)
NAMES = (
    "Anna", "Boris", "Clara", "David", "Elena", "Felix", "Greta", "Hugo", "Irene", "Jonas",
    "Karla", "Leo", "Mira", "Nils", "Olga", "Pavel", "Rosa", "Samuel", "Tessa", "Victor",
    "Wanda", "Yusuf", "Zora", "Arthur", "Bianca", "Conrad", "Delia", "Emil", "Flora",
    "Gideon", "Helga", "Ivan", "Julia", "Kurt", "Lena", "Marco", "Nora", "Oscar", "Petra",
    "Ruth",
)
COLORS = (
    "red", "blue", "green", "yellow", "brown", "grey", "white", "black", "purple", "pink",
    "silver", "crimson", "pale",
)
COUNTS = (
    "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
    "twelve", "twenty", "thirty", "forty", "many", "several",
)
SEASONS = ("spring", "summer", "autumn", "winter")
WEATHER = ("rain", "snow", "fog", "wind", "sunshine", "frost", "drizzle", "heat", "thunder")
DAYPARTS = ("morning", "evening", "afternoon", "night", "day")
TIMES = ("dawn", "noon", "dusk", "midnight", "breakfast", "supper", "sunrise", "sunset")
FURNITURE = ("table", "shelf", "chair", "windowsill", "bed", "counter", "stool", "cupboard")

SLOTS: dict[str, tuple[str, ...]] = {
    "adj": ADJECTIVES, "noun": NOUNS, "obj": OBJECTS, "place": PLACES, "verb": VERBS,
    "name": NAMES, "color": COLORS, "count": COUNTS, "season": SEASONS, "weather": WEATHER,
    "daypart": DAYPARTS, "time": TIMES, "furniture": FURNITURE,
}

#: Every slot is written `` {slot}`` (a space before it) so it is tokenized as a word.
TEMPLATES = (
    " The {adj} {noun} {verb} the {obj} near the {place}.",
    " {name} walked to the {place} and saw a {adj} {noun}.",
    " For {count} days, the {noun} stayed by the {place}.",
    " In {season}, the {place} was {adj} and {adj}.",
    " {name} {verb} a {color} {obj} before {time}.",
    " A {adj} {noun} lived beside the {place} for {count} years.",
    " Nobody knew why the {noun} seemed so {adj}.",
    " After {count} days of {weather}, {name} left the {place}.",
    " The {obj} on the {furniture} looked {adj} in the {daypart}.",
    " {name} and {name} talked about the {obj} all {daypart}.",
    " Every {daypart}, a {color} {noun} crossed the {place}.",
    " The {noun} said that the {place} smelled of {weather}.",
    " On the way to the {place}, {name} {verb} the {obj}.",
    " The {place} was quiet except for a {adj} {noun}.",
    " {name} kept a {color} {obj} in the {place} for {count} weeks.",
    " When the {weather} came, the {noun} hid behind the {obj}.",
    " Later that {daypart}, {name} {verb} the {obj} again.",
    " It took {count} days to walk from the {place} to the {place}.",
    " The {adj} {obj} belonged to a {noun} from the {place}.",
    " {name} smiled at the {adj} {noun} by the {place}.",
    " Before {time}, the {noun} {verb} the {obj} twice.",
    " People in the {place} still talk about the {color} {obj}.",
    " The {noun} and the {noun} shared a {obj} under the {furniture}.",
    " By {time} the {weather} had reached the {place}.",
)

_SLOT_RE = re.compile(r" \{(\w+)\}")


def parse_template(template: str) -> list[str | tuple[str]]:
    """Split a template into literal strings and ``(slot,)`` markers.

    Each slot swallows the space before it, so a slot value is tokenized as
    ``" word"`` -- the way BPE tokenizers see a word inside a sentence.
    """
    parts: list[str | tuple[str]] = []
    for i, chunk in enumerate(_SLOT_RE.split(template)):
        if i % 2:
            if chunk not in SLOTS:
                raise ValueError(f"unknown slot {chunk!r} in template {template!r}")
            parts.append((chunk,))
        elif chunk:
            parts.append(chunk)
    return parts


_PARSED = tuple(parse_template(t) for t in TEMPLATES)


def varied_sentences(rng: random.Random) -> Iterator[str]:
    """Endless varied filler sentences as text (each with a leading space).

    Mirrors :func:`_varied_id_pieces` draw for draw, so tests can inspect the
    exact text the id-level generator produces for a seed.
    """
    while True:
        out = []
        for part in _PARSED[rng.randrange(len(_PARSED))]:
            out.append(part if isinstance(part, str) else " " + rng.choice(SLOTS[part[0]]))
        yield "".join(out)


# --------------------------------------------------------------------------- tokenizer codec


@dataclass(eq=False)
class Codec:
    """One tokenizer plus the caches that make sample generation cheap.

    Accepts anything with ``encode(text, add_special_tokens=False)`` (returning
    ids, or an object with ``.ids`` such as ``tokenizers.Encoding``) and
    ``decode(ids)``.
    """

    tokenizer: Any
    _cache: dict[tuple[str, bool], tuple[int, ...]] = field(default_factory=dict)
    _slots: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    _templates: list[list[tuple[int, ...] | str]] | None = None

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` on its own, without special tokens."""
        out = self.tokenizer.encode(text, add_special_tokens=False)
        return list(getattr(out, "ids", out))

    def decode(self, ids: Sequence[int]) -> str:
        """The tokenizer's own decode (``Sample.context`` is defined by it)."""
        return self.tokenizer.decode(ids)

    def cont(self, text: str) -> list[int]:
        """Ids of ``text`` as it reads after other text, e.g. ``" The grass is green."``.

        Encoding ``" The"`` alone gives odd ids for many tokenizers (SentencePiece
        adds a second word-start marker; some drop the space).  Encoding an
        anchor plus the text and removing the anchor's ids gives the ids the
        text has in the middle of a document.  If the anchor merges with the
        text (its ids are not a prefix), the next anchor is tried, and plain
        encoding is the last resort -- still the right text, if not canonical ids.
        """
        for anchor in ("a", ".", "\n"):
            head = self.fixed(anchor, cont=False)
            both = self.encode(anchor + text)
            if len(both) > len(head) and tuple(both[: len(head)]) == head:
                return both[len(head):]
        return self.encode(text)

    def fixed(self, text: str, cont: bool = True) -> tuple[int, ...]:
        """Cached ids of a text that recurs across samples (headers, questions, words)."""
        key = (text, cont)
        ids = self._cache.get(key)
        if ids is None:
            if len(self._cache) > 65536:  # bounded: questions embed random keys
                self._cache.clear()
            ids = tuple(self.cont(text) if cont else self.encode(text))
            self._cache[key] = ids
        return ids

    def slot_ids(self, slot: str) -> tuple[tuple[int, ...], ...]:
        """Ids of every word of a grammar slot, each as ``" word"``."""
        ids = self._slots.get(slot)
        if ids is None:
            ids = tuple(self.fixed(" " + word) for word in SLOTS[slot])
            self._slots[slot] = ids
        return ids

    def templates(self) -> list[list[tuple[int, ...] | str]]:
        """The grammar with literals pre-tokenized and slots left as names."""
        if self._templates is None:
            self._templates = [
                [self.fixed(p) if isinstance(p, str) else p[0] for p in parts] for parts in _PARSED
            ]
        return self._templates


_CODECS: OrderedDict[int, Codec] = OrderedDict()
_MAX_CODECS = 8


def codec_for(tokenizer: Any) -> Codec:
    """The cached :class:`Codec` of a tokenizer (small LRU keyed by identity).

    The codec holds a reference to its tokenizer, so an ``id`` cannot be reused
    by another object while its entry is alive.
    """
    if isinstance(tokenizer, Codec):
        return tokenizer
    key = id(tokenizer)
    codec = _CODECS.get(key)
    if codec is not None and codec.tokenizer is tokenizer:
        _CODECS.move_to_end(key)
        return codec
    usable = all(callable(getattr(tokenizer, m, None)) for m in ("encode", "decode"))
    if not usable:
        raise KvpotError(
            f"tokenizer {type(tokenizer).__name__} has no encode/decode; pass a Hugging Face "
            "tokenizer or an object with encode(text, add_special_tokens=False) and decode(ids)."
        )
    codec = Codec(tokenizer)
    _CODECS[key] = codec
    while len(_CODECS) > _MAX_CODECS:
        _CODECS.popitem(last=False)
    return codec


# --------------------------------------------------------------------------- id streams


def _repeat_id_pieces(codec: Codec) -> Iterator[tuple[int, ...]]:
    return cycle([codec.fixed(" " + s) for s in REPEAT_SENTENCES])


def _varied_id_pieces(codec: Codec, rng: random.Random) -> Iterator[list[int]]:
    """Id-level twin of :func:`varied_sentences`: same draws, no tokenizer calls."""
    templates = codec.templates()
    slots = {name: codec.slot_ids(name) for name in SLOTS}
    n = len(templates)
    while True:
        out: list[int] = []
        for part in templates[rng.randrange(n)]:
            out.extend(rng.choice(slots[part]) if isinstance(part, str) else part)
        yield out


def filler_pieces(kind: str, codec: Codec, seed: int) -> Iterator[Sequence[int]]:
    """Endless filler sentences as id lists; each piece ends at a sentence boundary.

    ``"varied"`` depends on ``seed`` (different samples read different text);
    ``"repeat"`` is the same loop for every seed.
    """
    if kind == "repeat":
        return _repeat_id_pieces(codec)
    if kind == "varied":
        return _varied_id_pieces(codec, haystack_rng(seed))
    raise KvpotError(f"unknown haystack {kind!r}; choose one of: {', '.join(HAYSTACKS)}.")


def haystack_rng(seed: int) -> random.Random:
    """The random stream of the varied haystack (independent of the needles' stream)."""
    return random.Random(f"kvpot/haystack/{seed}")
