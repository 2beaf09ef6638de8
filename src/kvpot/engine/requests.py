"""A request's life in the batched engine (`kvpot.engine.scheduler`): what it asks and how it runs.

`status` moves "waiting" (queued, no slot) -> "prefilling" (its prompt read into its slot) ->
"decoding" (one token per step) -> "finished" | "cancelled" | "failed"; `finish_reason` says why it
ended ("stop": an end-of-sequence or stop token, "length", "cancelled", "error").
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvpot.engine.admission import QueueFull  # noqa: F401 - its old home: callers import it from here
from kvpot.engine.results import Result, State, Stats, _Run
from kvpot.engine.sampling import _as_ids
from kvpot.errors import KvpotError

STATUSES = ("waiting", "prefilling", "decoding", "finished", "cancelled", "failed")
_ids = itertools.count()  # request ids, unique in the process


@dataclass
class Request:
    """One sequence: what to read (token ids, or a prefilled `state` to answer from), what to ask,
    how to decode, and, as it runs, its life (`status`, `tokens`, `finish_reason`, timings)."""

    context_ids: list[int] | torch.Tensor | None = None
    question_ids: list[int] | torch.Tensor | None = None
    state: State | None = None  # a stored document: copied into the slot, the state stays usable
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    on_token: Callable[[Request, int], None] | None = None  # called on the scheduler's thread, per token
    on_finish: Callable[[Request], None] | None = None
    id: int = field(default_factory=lambda: next(_ids))
    # ---- its life (the scheduler's) ----
    status: str = "waiting"
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (end of sequence or a stop token), "length", "cancelled", "error"
    error: str | None = None
    exception: BaseException | None = field(default=None, repr=False, compare=False)  # what `error` says, to re-raise
    stats: Stats = field(default_factory=Stats)
    slot: int | None = None
    submitted: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each token was delivered (perf_counter)
    cancel_requested: bool = False

    def __post_init__(self):
        check_sampling(self.max_new_tokens, self.temperature, self.top_p, self.seed)
        if (self.state is None) == (self.context_ids is None):
            raise KvpotError("a request reads either context_ids or a prefilled state (exactly one).")

    @property
    def done(self) -> bool:
        return self.status in ("finished", "cancelled", "failed")

    @property
    def ttft(self) -> float | None:
        """Seconds from submission to the first token."""
        return None if self.first_token_time is None else self.first_token_time - self.submitted

    def result(self, tokenizer=None) -> Result:
        text = tokenizer.decode(self.tokens, skip_special_tokens=True) if tokenizer is not None else None
        return Result(text, list(self.tokens), self.stats)


def check_sampling(max_new_tokens, temperature: float, top_p: float, seed: int | None) -> None:
    """A generation's length and sampling parameters (a `Request`'s, `Engine.generate_ids`'), refused clearly."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise KvpotError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}.")
    if temperature < 0 or not 0 < top_p <= 1:
        raise KvpotError("temperature must be >= 0 and top_p in (0, 1].")
    check_seed(seed)


def check_generation(input_ids, state, max_new_tokens, temperature: float, top_p: float, seed: int | None) -> None:
    """`Engine.generate_ids`' arguments, refused with a clear error before anything runs."""
    check_sampling(max_new_tokens, temperature, top_p, seed)
    if state is not None and input_ids is not None:
        raise KvpotError("give either input_ids or a prefilled state, not both.")
    if state is None and input_ids is None:
        raise KvpotError("give input_ids (the context) or a prefilled state.")


SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes: signed or unsigned 64 bits


def check_seed(seed: int | None) -> None:
    """Refuse a seed that 64 bits cannot hold (it would fail inside a batched step, with its neighbours)."""
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise KvpotError(f"seed must be an integer in [-2**63, 2**64), got {seed!r}.")


def check_fits(engine, capacity: int, request: Request) -> None:
    """Refuse at once a request that can never run in a slot of `capacity` entries of `engine`'s pool (too long,
    an empty context, a state read with another method)."""
    if request.state is not None:
        engine.check_state(request.state)
        context = max(request.state.cache.lengths())  # what the state holds counts as its context
    else:
        context = len(_as_ids(request.context_ids, torch.device("cpu"), "context_ids"))
        if context == 0:
            raise KvpotError("the context is empty; give at least one token.")
    question = len(_as_ids(request.question_ids, torch.device("cpu"), "question_ids"))
    needed = engine.method.entries_needed(context, question, request.max_new_tokens)
    if needed > capacity:
        raise KvpotError(f"this request needs {needed:,} KV entries per layer and KV head, more than a slot "
                         f"holds ({capacity:,}); shorten it or give the batch a larger capacity.")


@dataclass
class Active:
    """What the scheduler holds for a request with a slot (`kvpot.engine.scheduler`)."""

    request: Request
    run: _Run | None = None
    reader: object | None = None  # kvpot.engine.reading.PromptReader: the prompt being read
    plan: str = ""  # this step's decoding plan ("append", "steady"; "eager" rows step alone)
    started: float = 0.0
    read_started: float = 0.0
    decode_started: float | None = None
    eos: frozenset = frozenset()
    feeding: list[int] | None = None  # a question fed one token per decoding step (`kvpot.engine.reading.feeds_question`)
    fed: int = 0
