from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvpot.errors import KvpotError
from kvpot.methods.base import Method, Setup, check_positive
from kvpot.methods.selfextend.attention import self_extend_attention
from kvpot.positions import SelfExtendPositions
from kvpot.rope import Rope

log = logging.getLogger("kvpot")

SEED_WINDOW = 2048  # InfiniPot (Appendix A) ran Self-Extend with (G, W) = (4, 2048) for LLaMA-3-8B's 8K window
SEED_GROUP = 4
SEED_TRAINED = 8192


@dataclass
class SelfExtend(Method):
    """Self-Extend (Jin et al., ICML 2024): no eviction; distant tokens at grouped positions, near ones at
    their own.

    A query at stream position i attends to every cached key j. Within the neighbour window (i - j <
    `window`, W) the pair keeps its relative position i - j; beyond it the pair gets the grouped one,
    floor(i / G) - floor(j / G) + W - floor(W / G) with G = `group_size` (Sec. 3.2). The two score maps
    are merged before one softmax, so no distance the model reads exceeds W + (i - W) / G: a model
    trained on L positions reads about (L - W) * G + W tokens (Sec. 3.3). `group_size=1` is Full.

    Prefill is chunked (`chunk_size` tokens per forward) and exact for any chunking: the neighbour and
    grouped attentions of a chunk are two attentions over disjoint keys, merged by their log-sum-exps
    (InfiniteHiP's split attention; `kvpot.methods.selfextend.attention`). Keys are stored un-rotated
    and rotated per use (dynamic RoPE, as InfiniteHiP's), so memory per token is Full's: its key and
    value, plus kvpot's two positions per entry; a forward's rotated copies are bounded by the chunk
    and the window (neighbour) and by 128K keys at a time (grouped, on the fused kernels).

    Decoding appends (`decode_plan` "append"): each step renumbers the last W entries relative to the
    query (`kvpot.positions.SelfExtendPositions`), so one call of kvpot's RoPE-on-load decode kernel reads
    both attentions, alone or batched, in CUDA graphs.

    Defaults follow InfiniPot's comparison (Appendix A: (G, W) in {(2, 1024), (2, 1536), (4, 2048)} on
    LLaMA-3-8B's 8K window; (4, 2048) is the one that reaches its 27K target): `group_size=4`,
    `window=None` = 2,048, or a quarter of the model's trained window (`max_position_embeddings`) when
    that is below 8K, as (4, 2048) is for 8K. Positions past the trained window are logged once.

    Bound: none: every entry is kept (as Full); the cache grows with the input.
    """

    name = "selfextend"
    paper = "Jin et al. 2024, LLM Maybe LongLM: Self-Extend LLM Context Window Without Tuning (ICML 2024)"
    bound = "none: every entry is kept (as Full); positions are grouped, nothing is evicted"
    positions = "self-extend"
    group_size: int = SEED_GROUP
    window: int | None = None
    chunk_size: int = 8192
    chunk_dependent = False  # nothing is evicted and each query's attention is exact: chunks change nothing
    evicts_while_decoding = False  # nothing is evicted
    merges = False
    grows = True  # every entry is kept, as Full
    copies_document = "at_admission"  # its question is read in a forward of its own, which reads and evicts the cache

    def __post_init__(self):
        check_positive(self, "group_size", "chunk_size")
        if self.window is not None:
            check_positive(self, "window")

    def resolved_window(self, max_positions: int | None) -> int:
        """W: as given, else the seed's 2,048 or a quarter of a trained window shorter than 8K."""
        if self.window is not None:
            return self.window
        if max_positions is None or max_positions >= SEED_TRAINED:
            return SEED_WINDOW
        return max(1, max_positions * SEED_WINDOW // SEED_TRAINED)

    def begin(self, cache, setup: Setup) -> None:
        if not isinstance(cache.policy, SelfExtendPositions):
            raise KvpotError(f"selfextend needs the self-extend positions, not {cache.policy.name!r}.")
        trained = getattr(setup.config, "max_position_embeddings", None)
        window = self.resolved_window(trained)
        cache.policy.configure(self.group_size, window)
        cache.attention = SelfExtendAttention(self.group_size, window, cache.rope, trained)

    def decode_plan(self, cache) -> str:
        return "append"

    def report(self, cache) -> dict | None:
        attention = cache.attention
        last = max(cache.lengths()) - 1  # the last stream position read (entries are never evicted)
        return {"group_size": attention.group, "window": attention.window, "reach": attention.reach(),
                "largest_relative_position": attention.largest(last)}


class SelfExtendAttention:
    """The attention a `PotCache` calls instead of dense attention in forwards (prefill, eager steps)."""

    def __init__(self, group: int, window: int, rope: Rope, trained: int | None):
        self.group, self.window, self.rope, self.trained = group, window, rope, trained
        self.max_read = 0  # the largest relative position a forward gave a query-key pair

    def reach(self) -> int | None:
        """(L - W) * G + W: the longest input whose relative positions stay inside the trained window L."""
        if self.trained is None:
            return None
        return max(self.trained - self.window, 0) * self.group + self.window

    def __call__(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
        """query [1, heads, q, d] un-rotated, key/value [1, kv_heads, n, d] (keys un-rotated) -> [1, heads, q, d]."""
        if query.shape[0] != 1:
            raise KvpotError("selfextend reads one sequence per forward (batch 1).")
        q, n = query.shape[2], key.shape[2]
        self._restore(layer, n - q)
        last = layer.cache.pending_max_position  # the forward's last stream position (host)
        self._note(last)
        out = self_extend_attention(query[0], key[0], value[0], scaling, layer.positions[0, 0, :n], self.group,
                                    self.window, self.rope, last)
        return out.unsqueeze(0)

    def static_attention(self, layer, query: torch.Tensor, key, value, scaling: float) -> torch.Tensor:
        """A fixed-shape decoding step (`kvpot.engine.decoding`): query [1, heads, 1, d] un-rotated over the
        layer's whole buffers, `layer.length` live. The step's `decode_positions` renumbered the window around
        the query, so the RoPE-on-load decode kernel reads both attentions at once. -> [1, heads, 1, d]."""
        from kvpot.attention import decode_kernel

        cos, sin = self.rope.table(layer.capacity + 1, query) or (None, None)
        if cos is None:  # the decoding loops step eagerly where RoPE has no fixed table
            raise KvpotError("selfextend: fixed-shape decoding needs a RoPE with a fixed cos/sin table.")
        kernel = decode_kernel(query.device, query.shape[-1])
        out = kernel(query[0, :, 0], layer.keys[0], layer.values[0], layer.length[0], scaling, cos=cos, sin=sin,
                     key_positions=layer.rope_positions[0], query_position=layer.query_position[0],
                     split_entries=layer.cache.split_entries)
        return out.view(1, out.shape[0], 1, out.shape[1])

    def _restore(self, layer, before: int) -> None:
        """Fixed-shape decoding steps renumber the last W entries relative to their query; give those
        entries their grouped positions back, so the next such step finds every older entry grouped."""
        start = max(0, before - self.window - 1)
        if start < before:
            layer.rope_positions[:, :, start:before] = layer.positions[:, :, start:before] // self.group

    def largest(self, last: int) -> int:
        """The largest relative position a query at stream position `last` gives any key (key 0's)."""
        return last if last < self.window else last // self.group + self.window - self.window // self.group

    def _note(self, last: int) -> None:
        top = self.largest(last)
        if top > self.max_read and self.trained is not None and top >= self.trained > self.max_read:
            log.warning("selfextend: relative positions reach %d, past the model's trained window of %d "
                        "(G=%d, W=%d reach %d tokens); use a larger group_size.", top, self.trained, self.group,
                        self.window, self.reach())
        self.max_read = max(self.max_read, top)
