"""Scoring predictions of the synthetic tasks (RULER's metrics, made precise).

Which metric each task uses (:func:`score`):

=========  =========================  ==============================================
task       metric                     why
=========  =========================  ==============================================
passkey    :func:`key_match`          one key; a near miss (a digit off) is wrong
kv         :func:`exact_match`        one UUID; same
niah       :func:`string_match_any`   one answer: RULER's "contains"
           (one answer) /
           :func:`string_match_all`   multi-value / multi-query: fraction of values found
           (several answers)
vt         :func:`string_match_all`   fraction of the chain's variables named
recall     :func:`string_match_all`   fraction of the facts restated
=========  =========================  ==============================================

All functions return a float in ``[0, 1]``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from kvpot.errors import KvpotError

_DIGITS = re.compile(r"\d+")
_WORD = re.compile(r"[0-9A-Za-z]+(?:-[0-9A-Za-z]+)*")
_SPACE = re.compile(r"\s+")


def _norm(text: str) -> str:
    """Lower-case and collapse whitespace, so line breaks and double spaces do not matter."""
    return _SPACE.sub(" ", text).strip().lower()


def _norm_answer(answer: str) -> str:
    """Like :func:`_norm`, and drop a trailing full stop: "X is 5." is restated as "X is 5"."""
    return _norm(answer).rstrip(".").rstrip()


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 if the prediction's first number (or word) *is* ``answers[0]``, else 0.0.

    Precisely: if the answer is all digits (passkey), the first maximal run of
    digits in the prediction must equal it -- so ``" 71432."`` and ``"The pass
    key is 71432"`` match, but ``"714320"``, ``"7143"`` and ``"12 then 71432"``
    do not.  Otherwise (a kv UUID) the first maximal run of letters, digits and
    inner hyphens, after stripping, must equal it case-insensitively -- quotes
    and punctuation around it are ignored, words before it are not.
    """
    if not answers:
        raise KvpotError("exact_match needs at least one answer; pass the sample's answers.")
    answer = answers[0].strip()
    found = (_DIGITS if answer.isdigit() else _WORD).search(prediction.strip())
    return float(found is not None and found.group(0).lower() == answer.lower())


def key_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 if the prediction's first run shaped like ``answers[0]`` *is* it (case ignored), else 0.0.

    The shape is the key's format (:data:`kvpot.tasks.keys.SHAPES`): digits (then this is
    :func:`exact_match`), an adjective-noun pair, or a UUID. So ``"The pass key is
    fluffy-penguin."`` matches ``fluffy-penguin`` (the restated words have no hyphen), and
    ``"12345678-..."`` is read as one UUID, not as the number 12345678.
    """
    from kvpot.tasks.keys import SHAPES, format_of

    if not answers:
        raise KvpotError("key_match needs at least one answer; pass the sample's answers.")
    answer = answers[0].strip()
    fmt = format_of(answer)
    if fmt in ("digits", "other"):
        return exact_match(prediction, answers)
    found = SHAPES[fmt].search(prediction)
    return float(found is not None and found.group(0).lower() == answer.lower())


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """RULER's "all" metric: the fraction of answers contained in the prediction.

    Containment is case-insensitive after collapsing whitespace (a trailing
    full stop of an answer is not required).  1.0 means every answer was found.
    """
    if not answers:
        raise KvpotError("string_match_all needs at least one answer; pass the sample's answers.")
    pred = _norm(prediction)
    return sum(_norm_answer(a) in pred for a in answers) / len(answers)


def string_match_any(prediction: str, answers: Sequence[str]) -> float:
    """RULER's "part" metric: 1.0 if any answer is contained in the prediction (as above)."""
    if not answers:
        raise KvpotError("string_match_any needs at least one answer; pass the sample's answers.")
    pred = _norm(prediction)
    return float(any(_norm_answer(a) in pred for a in answers))


def score(sample_or_task: Any, prediction: str, answers: Sequence[str] | None = None) -> float:
    """Score ``prediction`` with the metric of its task (see the module table).

    ``sample_or_task`` is a :class:`~kvpot.tasks.Sample` (its answers are used)
    or a task name, in which case ``answers`` must be given.
    """
    if isinstance(sample_or_task, str):
        task = sample_or_task
        if answers is None:
            raise KvpotError(f"score({task!r}, ...) needs answers=; or pass the Sample itself.")
    else:
        task = sample_or_task.task
        answers = sample_or_task.answers if answers is None else answers
    if task == "passkey":
        return key_match(prediction, answers)
    if task == "kv":
        return exact_match(prediction, answers)
    if task == "niah" and len(answers) == 1:
        return string_match_any(prediction, answers)
    if task in ("niah", "vt", "recall"):
        return string_match_all(prediction, answers)
    raise KvpotError(f"no metric for task {task!r}; choose one of: passkey, niah, kv, vt, recall.")
