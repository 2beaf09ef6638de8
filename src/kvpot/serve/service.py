"""What the server does with an engine: read documents, answer requests (docs/serving.md).

One model is loaded; an `Engine` per method configuration shares it (documents may be read with
another method than the server's default), and each method that answers requests has a pool of
slots (`kvpot.engine.Scheduler`) on the generation thread (`kvpot.serve.worker`). The HTTP side
tokenizes, looks things up, admits and awaits; every torch call runs on the generation thread.

A request's way: admitted to its method's pool (or 429); its context's state found in the store
(a document, or a conversation's context kept earlier), or read (a context of `--cache-min-tokens`
or more is read into a state and kept; a shorter one is read in the request's slot); then it joins
the pool's batch, and its tokens come back one per step, detokenized here (stop strings included).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import threading
import time
from dataclasses import dataclass, field

from kvpot.errors import Cancelled, KvpotError
from kvpot.serve.config import ServeConfig
from kvpot.serve.metrics import Metrics
from kvpot.serve.prompt import Collector, Prompt
from kvpot.serve.protocol import ApiError
from kvpot.serve.store import DamagedState, StateStore, state_key
from kvpot.serve.tokens import TokenizerPool, longest_token_chars
from kvpot.serve.turns import TurnExchange, rank_directory
from kvpot.serve.worker import Pool, Ticket, Worker
from kvpot.engine.state_io import model_fingerprint

log = logging.getLogger("kvpot.serve")


def build_method(spec: str):
    """A method from its spec (`name:key=value,...`) with the parser every kvpot command uses."""
    from kvpot.methods.spec import build_method as build

    return build(spec)


@dataclass
class Job:
    """One generation: what to read, what to ask, how to sample, where the text goes."""

    spec: str
    prompt: Prompt
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stops: list[str]
    key: str | None  # the state to answer from or to store; None: read the context for this request only
    document: bool  # the key names an uploaded document (it must exist)
    ignore_eos: bool = False
    emit: object = None  # callable(str) for streamed text, on the event loop
    started: float = field(default_factory=time.perf_counter)


@dataclass
class Outcome:
    text: str
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str
    ttft: float | None
    prefill_seconds: float


_END = object()


class Service:
    def __init__(self, engine, config: ServeConfig):
        if _config_key(build_method(config.method).config()) != _config_key(engine.method.config()):
            raise KvpotError(f"the engine runs {engine.method.config()}, but the configuration names the method "
                             f"{config.method!r}; give the engine's method as ServeConfig.method.")
        self.config = config
        self.default = engine
        self.default_spec = config.method
        self.model_name = config.served_model_name or _model_name(config.model)
        self.engines = {_config_key(engine.method.config()): engine}
        self.engines_lock = threading.Lock()
        self.parallel = engine.parallel  # tensor parallelism: every rank runs a Service (kvpot.serve.parallel)
        self.store = StateStore(config.state_memory, rank_directory(config.state_dir, self.parallel),
                                config.state_disk, config.state_dir_shared)
        self.metrics = Metrics()
        # fast tokenizers refuse concurrent use from two threads ("Already borrowed"): worker threads encode
        # with copies of their own, the event loop decodes with one nobody else uses (kvpot.serve.tokens)
        tokenizer = engine.tokenizer
        self.tokenizers = TokenizerPool(tokenizer) if tokenizer is not None else None
        self.decoding_tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self.max_chars = config.max_context_tokens * (longest_token_chars(tokenizer) if tokenizer is not None else 1)
        # under tensor parallelism the gloo group for the turns is made here, on every rank alike
        exchange = TurnExchange.of(engine, config.tp_timeout) if self.parallel is not None else None
        self.worker = Worker(config, self.metrics, self._make_scheduler, self.engine_for, exchange)
        self.worker.handlers.update(submit=self._submit_stored, keep_and_submit=self._keep_and_submit,
                                    put_document=self._put_document, prefill=self._prefill,
                                    promote=lambda key, local=None: self.store.promote(key),
                                    delete=lambda key, local=None: self.store.delete(key),
                                    persist=lambda local=None: self.store.persist())
        self.outboxes: dict = {}  # event loop -> its Outbox (one in a server; tests may run several)
        self.default_pool: Pool | None = None  # made by `start`
        self.inflight = 0  # HTTP requests being answered (the app's middleware counts them)
        self.draining = False  # shutting down: new requests get 503
        found = self.store.scan(model_fingerprint(engine.model))
        if found:
            log.info("found %d stored states in %s", found, self.store.directory)

    async def start(self) -> None:
        """Make the default method's pool (its memory is taken before the first request)."""
        self.default_pool = await self.worker.pool(self.default, self.default_spec, default=True)

    def _make_scheduler(self, engine, spec: str, slots: int | None):
        from kvpot.engine.scheduler import Scheduler

        if len(engine.devices) > 1:  # a model split over GPUs runs its layers in turn: one request at a time
            from kvpot.serve.solo import SoloScheduler

            return SoloScheduler(engine, max_waiting=self.config.max_queue)
        capacity = self.slot_capacity(engine)
        decode = engine.decode if engine.decode in ("graph", "static") else "auto"
        # a pool of a given size that does not fit is refused by the Scheduler (kvpot.engine.slot_sizes.slot_count)
        # max_waiting: the scheduler's admission is the server's (`Worker.admit` takes its places: 429 past them)
        scheduler = Scheduler(engine, slots=slots, capacity=capacity, max_waiting=self.config.max_queue,
                              prefill_tokens=self.config.prefill_tokens, mix=self.config.mix,
                              decode=decode, max_slots=self.config.max_slots or 256,
                              memory_fraction=self.config.kv_memory_fraction,
                              feed_questions=self.config.feed_questions, feed_tokens=self.config.feed_tokens,
                              share_documents=self.config.share_documents, prompt_order=self.config.prompt_order,
                              prompt_patience=self.config.prompt_patience, reader_room=self.config.reader_room,
                              launch_ahead=self.config.launch_ahead)
        if self.parallel is not None:  # every rank submits each request itself (the same turn's command)
            scheduler.agreement.payloads = False
        # every batch size's graph before the first user: measured on an H100 (records/serve-batch-h100),
        # the first step at 64 users otherwise took 2.6 s of compiling and capturing while they waited
        captured = scheduler.capture()
        if captured:
            packed = scheduler.decoder.packed
            log.info("captured %d graphs: decoding steps at %d batch sizes, %d mixed steps", captured,
                     len(scheduler.decoder.buckets), packed.graphs.captures if packed is not None else 0)
        return scheduler

    async def drain(self, grace: float) -> None:
        """Shut down gently: admit nothing new (503), give the requests in flight `grace` seconds to finish,
        then stop the rest (their clients get a 503 in OpenAI's format; streams an error event, then [DONE])."""
        self.draining = self.worker.draining = True
        loop = asyncio.get_running_loop()
        log.info("shutting down: %d requests in flight get up to %g s to finish", self.inflight, grace)
        deadline = loop.time() + grace
        while self.inflight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.inflight:
            log.warning("shutdown grace over: stopping %d requests", self.worker.stop_all())
            deadline = loop.time() + 10  # the stopped requests end at the next step and answer
            while self.inflight and loop.time() < deadline:
                await asyncio.sleep(0.05)

    async def stop(self) -> None:
        """After the last request: states held only in memory are written to --state-dir, then the
        generation thread ends."""
        if self.config.state_dir is not None and not self.worker.broken:
            try:
                written = await self.worker.command("persist")
                if written:
                    log.info("wrote %d states held in memory to %s", written, self.store.directory)
            except Exception:
                log.exception("could not write the states held in memory")
        await asyncio.to_thread(self.worker.shutdown)

    # ---------------------------------------------------------------- engines and keys
    def engine_for(self, spec: str | None):
        """The engine running `spec` (the default one for None); a bad spec is a 400."""
        if spec is None or spec == self.default_spec:
            return self.default
        try:
            method = build_method(spec)
        except KvpotError as err:
            raise ApiError(400, f"method {spec!r}: {err}", param="method") from None
        key = _config_key(method.config())
        with self.engines_lock:
            engine = self.engines.get(key)
            if engine is None:
                from kvpot.engine import Engine

                engine = Engine(self.default.model, self.default.tokenizer, method=method,
                                chat_template=self.default.chat_template, decode=self.default.decode,
                                compile_step=self.default.compile_step, batch_invariant=self.default.batch_invariant,
                                linear="auto" if self.default.batch_invariant else self.default.linear)
                self.engines[key] = engine
        return engine

    def slot_capacity(self, engine) -> int | None:
        """Entries a slot of `engine`'s pool holds when its method's cache grows with the input (slots hold a
        window: `--slot-capacity`, default the model's); None for a bounded method (its bound)."""
        if engine.method.max_entries() is not None:
            return None
        return self.config.slot_capacity or engine.model.config.max_position_embeddings

    def key_for(self, engine, context_ids: list[int]) -> str:
        return state_key(model_fingerprint(engine.model), engine.method.config(), context_ids)

    async def tokenize(self, fn, *args):
        """`fn(*args, tokenizer)` on a worker thread with a tokenizer copy of its own (off the event loop)."""
        def run():
            with self.tokenizers.borrow() as tok:
                return fn(*args, tok)

        return await asyncio.to_thread(run)

    def check_chars(self, chars: int) -> None:
        """Refuse, before tokenizing, a text that cannot fit `--max-context-tokens` (`kvpot.serve.tokens`)."""
        if chars > self.max_chars:
            raise ApiError(413, f"the prompt has {chars:,} characters, more than {self.config.max_context_tokens:,} "
                                "tokens (--max-context-tokens) of this tokenizer can hold.", code="context_too_long")

    def check_length(self, tokens: int) -> None:
        if tokens > self.config.max_context_tokens:
            raise ApiError(413, f"the prompt has {tokens:,} tokens; this server reads at most "
                                f"{self.config.max_context_tokens:,} (--max-context-tokens).", code="context_too_long")

    async def pool_for(self, job: Job) -> Pool:
        engine = self.engine_for(job.spec)
        return await self.worker.pool(engine, job.spec, default=engine is self.default)

    # ---------------------------------------------------------------- documents
    async def read_document(self, text_ids: list[int], spec: str | None, ticket: Ticket) -> dict:
        engine = self.engine_for(spec)
        key = self.key_for(engine, text_ids)
        spec_text = spec or self.default_spec
        entry = await self.worker.command("promote", key)
        if entry is not None:  # the same text with the same method was read already
            return {**entry.describe(), "reused": True}
        _, entry = await self._read(spec_text, text_ids, ticket, ("put_document", (key, spec_text)))
        return {**entry.describe(), "reused": False}

    def _put_document(self, state, key: str, spec: str, local=None):
        """(generation thread, when the document's read ends) Store it, if a slot could answer about it."""
        self._check_slot(self.engine_for(spec), state, spec)
        try:
            return self.store.put(key, state, "document", spec)
        except KvpotError as err:
            raise ApiError(413, str(err), code="state_too_large") from None

    def _check_slot(self, engine, state, spec: str) -> None:
        """Refuse a document that no slot could answer a question about (a cache that grows past a slot)."""
        capacity = self.slot_capacity(engine)
        if capacity is None:
            return
        kept = max(state.cache.lengths())
        needed = engine.method.entries_needed(kept, 1, 1)
        if needed > capacity:
            raise ApiError(413, f"the document keeps {kept:,} KV entries per layer and head when read with {spec!r}; "
                                f"a question about it needs {needed:,} and a slot holds {capacity:,} "
                                "(--slot-capacity). Raise --slot-capacity or read it with a bounded method.",
                           code="document_too_large")

    async def _read(self, spec: str, ids: list[int], ticket: Ticket, then: tuple, then_local=None):
        """`ids` read into a state between the batch's steps, one forward per turn; then `then` (a handler and
        its arguments) runs with the state on the generation thread. Returns (state, then's result)."""
        state, result = await self._engine_call(self.worker.read(("prefill", (spec, ids)), ticket, then, then_local))
        self.metrics.add(prefill_tokens=len(ids), prefill_seconds=state.stats.prefill_seconds)
        return state, result

    def _prefill(self, spec: str, ids: list[int], should_stop):
        """(generation thread) The generator that reads `ids` with `spec`'s engine, one forward per step."""
        engine = self.engine_for(spec)  # batch-invariant: read in the method's own forwards, as alone
        return engine.prefill_steps(ids, should_stop=should_stop,
                                    max_chunk=None if engine.batch_invariant else self.config.prefill_tokens)

    # ---------------------------------------------------------------- answers
    async def answer(self, job: Job, ticket: Ticket) -> Outcome:
        """Run `job` in its pool (`ticket` admitted it there) and collect its text; `job.emit` streams it."""
        engine = self.engine_for(job.spec)
        queue: asyncio.Queue = asyncio.Queue()
        local = (ticket, self._poster(queue))  # stays on rank 0: `sent` goes to every rank
        sent = dataclasses.replace(job, emit=None)
        # the stored state looked up and the request submitted in one turn of the generation thread
        state = await self._engine_call(self.worker.command("submit", sent, local=local))
        cached, read = (state.stats.context_tokens if state is not None else 0), 0.0
        if state is None and job.key is not None:  # a long context not stored yet: read, keep, then submit
            state, _ = await self._read(job.spec, job.prompt.context_ids, ticket, ("keep_and_submit", (sent,)), local)
            read = state.stats.prefill_seconds
        request = ticket.request
        context_tokens = state.stats.context_tokens if state is not None else len(job.prompt.context_ids)
        try:
            tokens, stream = await self._collect(job, ticket, engine, queue)
        except Exception as err:  # turning its tokens into text failed: this request ends, the batch goes on
            ticket.stop()
            log.exception("a request's text failed")
            raise ApiError(500, f"the generation failed ({type(err).__name__}).", code="generation_failed") from None
        if request.status == "failed":
            raise ApiError(500, f"the generation failed: {request.error}", code="generation_failed")
        if request.status == "cancelled" and not stream.stopped:
            raise ticket.cancelled_error()
        if state is None:
            read = request.stats.prefill_seconds
            self.metrics.add(prefill_tokens=context_tokens + len(job.prompt.question_ids), prefill_seconds=read)
        reason = "stop" if stream.stopped or request.finish_reason == "stop" else "length"
        prompt_tokens = context_tokens + len(job.prompt.question_ids)
        ttft = None if request.first_token_time is None else request.first_token_time - job.started
        self.metrics.answered(prompt_tokens, cached, len(tokens), ttft)
        self.worker.finished(time.perf_counter() - job.started)
        return Outcome(stream.text, len(tokens), prompt_tokens, cached, reason, ttft, read)

    def _poster(self, queue: asyncio.Queue):
        """A callable for the generation thread: an item for `queue`, through the event loop's outbox."""
        outbox = self._outbox()
        return lambda item: outbox.post(queue, item)

    def _submit(self, job: Job, engine, state, local) -> None:
        """(generation thread) The engine request of `job` (from `state`, or reading its context in its
        slot) submitted to its method's pool. On rank 0, `local` is (ticket, post): its tokens and its end go
        to `post`; other ranks (None) run it without callbacks."""
        from kvpot.engine.requests import Request

        ticket, post = local if local is not None else (None, None)
        callbacks = {}
        if post is not None:
            metrics = self.metrics
            callbacks = {"on_token": lambda _request, token: (metrics.tick(), post(token)),
                         "on_finish": lambda finished: (metrics.finished(finished), post(_END))}
        request = Request(context_ids=job.prompt.context_ids if state is None else None,
                          question_ids=job.prompt.question_ids, state=state, max_new_tokens=job.max_tokens,
                          temperature=job.temperature, top_p=job.top_p, seed=job.seed, ignore_eos=job.ignore_eos,
                          **callbacks)
        if ticket is not None:
            ticket.request = request  # first: a `ticket.stop()` from now on reaches the request
            if ticket.cancel.is_set():
                request.cancel_requested = True
        # rank 0 admitted it (`Worker.admit`): its ticket's place goes with it, and no rank takes another
        place = ticket.place if ticket is not None else None
        self.worker.pool_of(engine).scheduler.submit(request, place=place, admitted=self.worker.follower)

    def _submit_stored(self, job: Job, local=None):
        """(generation thread) Submit `job` from its stored state, or with its context to read in its slot
        (no key); returns the state. A context to keep that is not stored yet: nothing is submitted."""
        engine = self.engine_for(job.spec)
        state = None
        if job.key is not None:
            state = self.store.get(job.key, engine)
            if state is None and job.document:
                raise ApiError(404, f"document doc-{job.key} is no longer stored (evicted or deleted); upload it "
                                    "again.", param="document_id", code="document_not_found")
            if state is None:
                return None
        self._submit(job, engine, state, local)
        return state

    def _keep_and_submit(self, state, job: Job, local=None) -> None:
        """(generation thread, when the context's read ends) Store it for the next question, and submit `job`
        from it."""
        try:
            self.store.put(job.key, state, "context", job.spec)
        except KvpotError:
            pass  # a context too large to keep is simply read again next time
        self._submit(job, self.engine_for(job.spec), state, local)

    async def _collect(self, job: Job, ticket: Ticket, engine, queue: asyncio.Queue):
        """The request's tokens as they come, turned into text (stop strings end it early)."""
        stream = Collector(self.decoding_tokenizer, job.stops, None, job.emit)
        tokens = []
        while True:
            token = await queue.get()
            if token is _END:
                break
            if stream.stopped:
                continue  # tokens delivered after a stop string, before the request ended
            tokens.append(token)
            stream.push(token)
            if stream.stopped:
                ticket.stopped_by_text = True
                ticket.stop()  # the slot is freed at the next step; the answer is complete now
        stream.finish()
        return tokens, stream

    def _outbox(self) -> Outbox:
        """The running event loop's outbox, flushed by the worker after each turn."""
        loop = asyncio.get_running_loop()
        outbox = self.outboxes.get(loop)
        if outbox is None:
            outbox = self.outboxes[loop] = Outbox(loop)
            self.worker.outboxes.append(outbox)
        return outbox

    async def _engine_call(self, awaitable):
        """Engine errors a request caused become 400s (too long for a slot: 413)."""
        try:
            return await awaitable
        except ApiError:
            raise
        except Cancelled:
            raise ApiError(499, "the request was cancelled (the client went away).") from None
        except DamagedState as err:
            raise ApiError(500, str(err), code="state_damaged") from None
        except KvpotError as err:
            if "more than a slot holds" in str(err):
                raise ApiError(413, str(err), code="context_too_long") from None
            raise ApiError(400, str(err)) from None


class Outbox:
    """Items from the generation thread for queues of the event loop, handed over once per turn of the
    worker's loop (one wake-up of the event loop per step, not one per token and user)."""

    def __init__(self, loop):
        self.loop, self.items = loop, []
        self.lock = threading.Lock()

    def post(self, queue: asyncio.Queue, item) -> None:
        with self.lock:
            self.items.append((queue, item))

    def flush(self) -> None:
        with self.lock:
            items, self.items = self.items, []
        if items:
            try:
                self.loop.call_soon_threadsafe(_hand_over, items)
            except RuntimeError:  # the loop is closed: the server is stopping and nobody listens
                pass


def _hand_over(items: list) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _config_key(config: dict) -> str:
    return json.dumps(config, sort_keys=True, default=str)


def _model_name(model: str | None) -> str:
    if model is None:
        return "kvpot-reference"
    return model.rstrip("/").split("/")[-1] if "/" in model and model.startswith(("/", ".")) else model
