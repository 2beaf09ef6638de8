from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpot.methods.base import Method, check_positive


@dataclass
class Truncate(Method):
    """LongBench's truncation: keep the first and last `budget/2` context tokens, drop the middle.

    Bai et al., "LongBench" (ACL 2024), Sec. 3: "we truncate the input from the middle". The model
    then reads the shortened context normally, at contiguous positions; the question is never cut.
    Bound: `budget + len(question) + new tokens` entries (nothing is evicted after truncation).
    """

    name = "truncate"
    paper = "Bai et al. 2024, LongBench (middle truncation)"
    bound = "budget + question tokens + generated tokens"
    budget: int = 2048
    chunk_size: int = 2048
    chunk_dependent = False  # the context is cut before it is read; nothing is evicted while reading
    evicts_while_decoding = False
    merges = False
    grows = True  # the cut context is bounded, but the question and every generated token are appended
    copies_document = "never"  # appends only while decoding
    feeds_question = True

    def __post_init__(self):
        check_positive(self, "budget", "chunk_size")

    def entries_needed(self, context: int, question: int, new_tokens: int) -> int:
        return min(context, self.budget) + question + new_tokens

    def decode_plan(self, cache) -> str:
        return "append"  # nothing is evicted after the truncation

    @classmethod
    def from_budget(cls, budget: int, **overrides) -> Truncate:
        return cls(budget=budget, **overrides)

    def prepare(self, context_ids: torch.Tensor, question_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if context_ids.shape[-1] <= self.budget:
            return context_ids, question_ids
        head = self.budget // 2
        tail = self.budget - head
        kept = torch.cat([context_ids[..., :head], context_ids[..., context_ids.shape[-1] - tail :]], dim=-1)
        return kept, question_ids

