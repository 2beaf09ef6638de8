from __future__ import annotations

from dataclasses import dataclass

from kvpot.methods.base import Method, check_positive


@dataclass
class Full(Method):
    """No eviction: every KV entry is kept, at its absolute position.

    The exactness reference: greedy output equals `model.generate` token for token
    (docs/design.md, guarantee 2). Prefill is chunked (`chunk_size` tokens per forward) so activations
    stay bounded, but the cache grows with the input. Bound: none.
    """

    name = "full"
    paper = "no compression (exactness reference)"
    # measured (records/prefill-h100): 8,192-token chunks read 128K tokens as fast as transformers'
    # one-shot forward (12.06 s vs 12.01 s on an H100, llama3-8b); 2,048 took 12.48 s
    chunk_size: int = 8192
    chunk_dependent = False  # nothing is evicted while reading
    evicts_while_decoding = False
    merges = False
    grows = True
    copies_document = "never"  # appends only: a reader whose question is fed reads the document to its end
    feeds_question = True

    def __post_init__(self):
        check_positive(self, "chunk_size")

    def decode_plan(self, cache) -> str:
        return "append"
