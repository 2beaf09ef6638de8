"""Intervals for accuracies: a cell of 30 samples is a coin-flip count, so report how far it may be off.

`kvpot eval` reports every accuracy as correct/total with a 95% Wilson score interval, and the
spread of accuracy across prompt templates (issue 32: one wording's ranking of methods was the
opposite of another's) and, where several ran, across key formats (a model may copy seven digits and
garble a UUID). Rankings should be claimed only where intervals separate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile: a two-sided 95% interval


def wilson_interval(correct: int, total: int, z: float = Z95) -> tuple[float, float] | None:
    """The Wilson score interval of a binomial proportion (95% by default); None when ``total`` is 0.

    With ``p = correct / total`` and ``n = total``::

        centre    = (p + z^2 / (2n)) / (1 + z^2 / n)
        half      = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / (4 n^2))
        interval  = (centre - half, centre + half)

    Unlike the normal approximation ``p +- z sqrt(p(1-p)/n)`` it stays inside [0, 1] and is not
    zero-width at 0/n or n/n (0/10 gives (0, 0.2775): ten misses do not prove a method never works).
    """
    if total <= 0:
        return None
    if not 0 <= correct <= total:
        raise ValueError(f"correct must lie in [0, {total}], got {correct}.")
    n, p, z2 = total, correct / total, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # at 0/n and n/n the bound is exactly 0 or 1; rounding would leave 1e-16 off
    low = 0.0 if correct == 0 else max(0.0, centre - half)
    high = 1.0 if correct == total else min(1.0, centre + half)
    return low, high


def accuracy_stats(rows: Sequence[dict]) -> dict:
    """correct/total, the mean score, its 95% Wilson interval and the spread over templates, chat and key formats.

    `correct` counts rows scored 1.0 (all-of metrics give partial scores; the interval is over
    whole answers). `template_spread` is [min, max] of the per-template mean score (chat and plain
    pooled), None with fewer than two templates; `by_chat` holds the mean score of the plain and
    the chat-templated samples (kvpot.eval.prompting; rows without the field count as plain), and
    `chat_spread` their [min, max] when both ran; `by_key_format` the mean score per key format
    (:func:`key_format_of`; rows that do not say theirs are left out of it) and `key_format_spread` its
    [min, max] with two formats or more.
    """
    correct, total = sum(1 for r in rows if r["correct"]), len(rows)
    low_high = wilson_interval(correct, total)
    per_template = _per(rows, lambda r: str(r.get("template", 0)))
    per_chat = _per(rows, lambda r: "chat" if r.get("chat") else "plain")
    per_format = _per([r for r in rows if key_format_of(r)], key_format_of)
    return {
        "correct": correct, "total": total, "accuracy": _mean(r["score"] for r in rows),
        "wilson95": None if low_high is None else list(low_high),
        "by_template": per_template, "template_spread": _spread(per_template),
        "by_chat": per_chat, "chat_spread": _spread(per_chat),
        "by_key_format": per_format, "key_format_spread": _spread(per_format),
    }


def key_format_of(row: dict) -> str | None:
    """The format of a row's hidden key (passkey's key, niah's value): its `key_format` field (`kvpot eval
    --key-formats`), else its task options' (the task's own format); None for tasks without one."""
    if row.get("key_format"):
        return row["key_format"]
    from kvpot.tasks.keys import FORMAT_OPTION

    option = FORMAT_OPTION.get(row.get("task"))
    return (row.get("task_options") or {}).get(option) if option else None


def answer_format(task: str, options: dict) -> str | None:
    """The format of ``task``'s hidden key under ``options`` (its task options; the generator's default where
    they leave it out); None for tasks without one (kvpot.tasks.keys.FORMAT_OPTION)."""
    from kvpot.tasks import task_options
    from kvpot.tasks.keys import FORMAT_OPTION

    option = FORMAT_OPTION.get(task)
    if option is None:
        return None
    return options.get(option, task_options(task)[option])


def _per(rows: Sequence[dict], key) -> dict[str, float]:
    keys = sorted({key(r) for r in rows}, key=lambda k: (k != "plain", k))  # plain first, templates in order
    return {k: _mean(r["score"] for r in rows if key(r) == k) for k in keys}


def _spread(means: dict[str, float]) -> list[float] | None:
    return [min(means.values()), max(means.values())] if len(means) > 1 else None


def separated(a: dict, b: dict) -> bool:
    """Whether two `accuracy_stats` results' 95% Wilson intervals do not overlap (a ranking may be claimed)."""
    if not a.get("wilson95") or not b.get("wilson95"):
        return False
    return a["wilson95"][0] > b["wilson95"][1] or b["wilson95"][0] > a["wilson95"][1]


def stats_of(correct: int, total: int) -> dict:
    """`accuracy_stats` of `total` whole answers, `correct` of them right (a recorded count, no rows)."""
    low_high = wilson_interval(correct, total)
    return {"correct": correct, "total": total, "accuracy": correct / total if total else None,
            "wilson95": None if low_high is None else list(low_high), "by_template": {}, "template_spread": None,
            "by_chat": {}, "chat_spread": None, "by_key_format": {}, "key_format_spread": None}


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None
