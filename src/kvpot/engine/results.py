"""What the engine hands back: statistics of a run, generated text, token losses, and resumable state."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvpot.cache import PotCache
from kvpot.errors import Cancelled
from kvpot.models.devices import peak_memory


@dataclass
class Stats:
    """What a run cost. Entries are per layer and KV head; `max_kv_entries` is over every instant."""

    context_tokens: int = 0
    question_tokens: int = 0
    new_tokens: int = 0
    max_kv_entries: int = 0
    final_kv_entries: int = 0
    compressions: int = 0
    compress_seconds: float = 0.0  # time spent in the method's scoring and eviction
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    peak_memory_bytes: int | None = None  # summed over the devices below; None on CPU
    # peak allocated bytes per accelerator the model runs on ("cuda:0": ...); empty on CPU
    peak_memory_by_device: dict[str, int] = field(default_factory=dict)
    method: dict | None = None  # what the method reports about the generation (`Method.report`)
    decode: dict | None = None  # how decoding ran: mode and steps by kind (`kvpot.engine.decoding`)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Result:
    """A generation: `token_ids` are the new tokens only; `text` is None without a tokenizer."""

    text: str | None
    token_ids: list[int]
    stats: Stats


@dataclass
class ScoreResult:
    """Per-token losses of a text read with a method (`Engine.score_ids`)."""

    nll: torch.Tensor  # [n - 1] float32
    stats: Stats

    @property
    def perplexity(self) -> float:
        return float(self.nll.mean().exp())


@dataclass
class State:
    """A prefilled (and compressed) context. `Engine.generate(state=...)` copies it, so it can be
    asked again, unless `keep_state=False` hands it over (no copy: the way to decode from a cache
    that takes most of the memory; the state is then spent)."""

    cache: PotCache | None
    next_position: int  # original position of the next token in the stream
    last_logits: torch.Tensor  # [vocab] logits after the last prefilled token
    method_config: dict
    stats: Stats = field(default_factory=Stats)
    model: dict | None = None  # fingerprint of the model that made it (`state_io.model_fingerprint`)

    def save(self, path, extra: dict | None = None) -> int:
        """Write the state to `path` (safetensors, JSON metadata, no pickle); returns the file's
        size. `extra` is JSON stored alongside (`state_io.read_metadata(path)["extra"]`)."""
        from kvpot.engine import state_io

        return state_io.save(path, self.cache, self.next_position, self.last_logits, self.method_config,
                             self.stats.to_dict(), self.model, extra)

    @classmethod
    def load(cls, path, engine) -> State:
        """Read a state saved by `save` for `engine`; refused (KvpotError) when the file is damaged
        or was made by another model or method."""
        from kvpot.engine import state_io

        fields = state_io.load(path, engine)
        stats = Stats(**{k: v for k, v in fields["stats"].items() if k in Stats.__dataclass_fields__})
        return cls(fields["cache"], fields["next_position"], fields["last_logits"], engine.method.config(),
                   stats, state_io.model_fingerprint(engine.model))

    @property
    def nbytes(self) -> int:
        """Bytes of memory the state holds (KV buffers, scores, method state, logits)."""
        from kvpot.engine.state_io import state_nbytes

        return state_nbytes(self.cache, self.last_logits)


@dataclass
class _Run:
    """Mutable bookkeeping of one prefill or generation."""

    cache: PotCache
    next_position: int
    stats: Stats
    logits: torch.Tensor | None = None
    should_stop: Callable[[], bool] | None = None  # asked between prefill forwards
    compress_marks: list = field(default_factory=list)  # (begin, end) of compressions not yet summed
    max_chunk: int | None = None  # cap on a prefill forward's tokens, for methods not `chunk_dependent` (scheduler)

    def check(self) -> None:
        if self.should_stop is not None and self.should_stop():
            raise Cancelled("stopped while reading: should_stop() said so.")


def close_stats(engine, run: _Run, new_tokens: int, decode_started: float | None, decode: dict) -> Stats:
    """The stats of a batched request that ended: its run's, with the slot's counts and the decoding's."""
    stats = run.stats
    engine._settle(run)
    stats.new_tokens = new_tokens
    stats.max_kv_entries = run.cache.max_entries
    stats.final_kv_entries = max(run.cache.lengths())
    if decode_started is not None:
        stats.decode_seconds = time.perf_counter() - decode_started
    stats.peak_memory_by_device, stats.peak_memory_bytes = peak_memory(engine.devices)
    stats.method = engine.method.report(run.cache)
    stats.decode = decode
    return stats
