from __future__ import annotations

from dataclasses import dataclass

from kvpot.errors import KvpotError
from kvpot.methods.base import EvictionMethod, Ranking, Step, check_policy, check_positive


@dataclass
class StreamingLLM(EvictionMethod):
    """Attention sinks plus a window of recent entries, with position shift.

    Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (ICLR 2024): keep the
    first `sinks` tokens (Sec. 3.2, 4 by default) and the most recent `window`; positions are
    given within the cache ("shift"). `sinks=0` is sliding-window attention. The input is read in
    chunks of `chunk_size` tokens, evicting after each chunk and after every generated token
    (`chunk_size=1` reproduces the token-by-token streaming of the paper exactly).

    Bound: `sinks + window + chunk_size` entries per layer and KV head (at most `sinks + window`
    between forwards).
    """

    name = "streaming"
    paper = "Xiao et al. 2024, Efficient Streaming Language Models with Attention Sinks"
    bound = "sinks + window + chunk_size"
    chunk_dependent = True  # each forward evicts down to sinks + window: a longer one's queries see more of the past
    evicts_while_decoding = True
    merges = False
    grows = False
    copies_document = "at_admission"  # its question is read in a forward of its own, which reads and evicts the cache
    sinks: int = 4
    window: int = 1020
    chunk_size: int = 2048  # measured: 512-token chunks are launch-bound on a GPU (records/prefill-h100)
    positions: str = "shift"
    shared_selection = True  # sinks + the most recent: the same entries in every layer

    def __post_init__(self):
        if not isinstance(self.sinks, int) or self.sinks < 0:
            raise KvpotError(f"streaming: sinks must be an integer >= 0, got {self.sinks!r}.")
        check_positive(self, "window", "chunk_size")
        check_policy(self, ("shift", "absolute"))

    @classmethod
    def from_budget(cls, budget: int, **overrides) -> StreamingLLM:
        sinks = overrides.pop("sinks", cls.sinks)
        if budget <= sinks:
            raise KvpotError(
                f"streaming: a budget of {budget} cannot hold the {sinks} sink tokens plus a window; "
                f"use a budget above {sinks} or fewer sinks."
            )
        return cls(sinks=sinks, window=budget - sinks, **overrides)

    def max_entries(self) -> int:
        return self.sinks + self.window + self.chunk_size

    def keep_count(self, layer, step: Step) -> int:
        return self.sinks + self.window

    def ranking(self, layer, step: Step) -> Ranking:
        return Ranking(None, sinks=self.sinks)  # the oldest goes, the sinks excepted
