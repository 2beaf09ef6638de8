"""Deterministic synthetic long-context tasks for any tokenizer and any length.

>>> from kvpot.tasks import make_sample, score
>>> s = make_sample("passkey", tokenizer, length=4096, depth=0.25, seed=7)
>>> len(s.context_ids) == 4096
True
>>> score(s, " 71432.")  # 1.0 if 71432 is s.answers[0]

Tasks: ``passkey``, ``niah``, ``kv``, ``vt``, ``recall`` (see
:mod:`kvpot.tasks.generators`); haystacks ``"repeat"`` and ``"varied"`` (see
:mod:`kvpot.tasks.haystack`); metrics in :mod:`kvpot.tasks.metrics`.
"""

from kvpot.tasks.generators import (
    RECALL_INSTRUCTION,
    TASKS,
    TEMPLATES,
    Sample,
    kv,
    make_sample,
    niah,
    passkey,
    recall,
    task_options,
    template_count,
    vt,
)
from kvpot.tasks.haystack import HAYSTACKS
from kvpot.tasks.metrics import exact_match, score, string_match_all, string_match_any

__all__ = [
    "HAYSTACKS", "RECALL_INSTRUCTION", "TASKS", "TEMPLATES", "Sample", "exact_match", "kv", "make_sample",
    "niah", "passkey", "recall", "score", "string_match_all", "string_match_any",
    "task_options", "template_count", "vt",
]
