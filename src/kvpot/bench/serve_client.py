"""The load: `--users` streaming chat requests sent at once to an OpenAI-compatible server with the
official `openai` client (AsyncOpenAI, `stream=True`, usage in the last chunk), each timed chunk by
chunk, plus kvpot's `POST /v1/documents` where the server has it.

Times are seconds from the workload's start; each request is sent at its arrival (`arrival_seconds`:
all at 0 s, or `--arrival-rate`'s Poisson times, `kvpot.bench.load`). A request's time to first token
is its first non-empty content chunk (the row's percentiles count it from the arrival), its
inter-token latencies the gaps between its content chunks (a chunk may carry more than one token),
its output tokens the usage chunk's `completion_tokens`. A 429 is `rejected`; any other failure is
the request's `error`, one line.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import time
from dataclasses import dataclass

from kvpot.errors import KvpotError


@dataclass
class Target:
    """A server to drive: where, with which key, the model id requests name, and how to phrase them."""

    url: str
    api_key: str | None
    model: str
    kvpot: bool  # kvpot's server: context and question go as two user messages (its context/question split)
    extra: dict  # sent with every chat request (`ignore_eos` where it is honoured)
    timeout: float


def require_openai():
    try:
        import openai
    except ImportError:
        raise KvpotError("bench serve drives servers with the openai package: pip install openai.") from None
    return openai


def _client(url: str, api_key: str | None, timeout: float):
    openai = require_openai()
    key = api_key or os.environ.get("OPENAI_API_KEY") or "none"  # the client refuses to start without one
    # the chat modules load lazily, at a process's first request: ~0.7 s (measured here) that its users'
    # time to first token would count; loaded before the process says it is ready
    for module in ("openai.resources.chat.completions", "openai.types.chat"):
        importlib.import_module(module)
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=timeout)


def one_line(err: BaseException) -> str:
    """An error as one line: `HTTP 503: message` for a server's answer, the cause for a connection."""
    openai = require_openai()
    if isinstance(err, openai.APIStatusError):
        text = f"HTTP {err.status_code}: {err.message}"
    elif isinstance(err, openai.APIConnectionError) and err.__cause__ is not None:
        text = f"{err.message} ({type(err.__cause__).__name__}: {err.__cause__})"
    else:
        text = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    return (text.splitlines() or [text])[0][:300]


def connect(url: str, api_key: str | None, served_model: str | None, timeout: float) -> tuple[str, bool]:
    """(the model id to request, whether the server is kvpot's) from GET /v1/models."""
    return asyncio.run(_connect(url, api_key, served_model, timeout))


async def _connect(url, api_key, served_model, timeout) -> tuple[str, bool]:
    openai = require_openai()
    async with _client(url, api_key, min(timeout, 60.0)) as client:
        try:
            page = await client.models.list()
        except openai.APIError as err:
            raise KvpotError(f"GET {url}/v1/models failed: {one_line(err)}") from None
    cards = list(page.data)
    if served_model is None and not cards:
        raise KvpotError(f"{url}/v1/models lists no model; give --served-model.")
    chosen = served_model or cards[0].id
    owner = next((getattr(c, "owned_by", None) for c in cards if c.id == chosen), None)
    return chosen, owner == "kvpot"


class _FirstTokens:
    """Set once every user has its first token (or has ended without one)."""

    def __init__(self, users: int):
        self.left, self.seen, self.event = users, set(), asyncio.Event()

    def arrived(self, user: int) -> None:
        if user not in self.seen:
            self.seen.add(user)
            self.left -= 1
            if self.left == 0:
                self.event.set()


def _messages(target: Target, context: str, question: str) -> list[dict]:
    if not context:
        return [{"role": "user", "content": question}]
    if target.kvpot:  # the first user message is the context, the rest the question (kvpot.serve.prompt)
        return [{"role": "user", "content": context}] + ([{"role": "user", "content": question}] if question else [])
    return [{"role": "user", "content": f"{context}\n\n{question.lstrip()}".rstrip()}]


def _record(user: int, arrival: float = 0.0) -> dict:
    return {"user": user, "arrival_seconds": arrival, "ttft_seconds": None, "chunk_seconds": [],
            "completion_tokens": None, "prompt_tokens": None, "finish_reason": None, "end_seconds": None, "error": None,
            "rejected": False}


def _take(chunk, record: dict, now: float, first: _FirstTokens) -> None:
    if getattr(chunk, "usage", None) is not None:
        record["completion_tokens"] = chunk.usage.completion_tokens
        record["prompt_tokens"] = chunk.usage.prompt_tokens
    for choice in chunk.choices or []:
        if choice.delta is not None and choice.delta.content:
            record["chunk_seconds"].append(now)
            if record["ttft_seconds"] is None:
                record["ttft_seconds"] = now
                first.arrived(record["user"])
        if choice.finish_reason:
            record["finish_reason"] = choice.finish_reason


async def _stream(client, target: Target, messages: list[dict], extra: dict, max_tokens: int, begun: float,
                  record: dict, first: _FirstTokens) -> None:
    openai = require_openai()

    async def read():
        await asyncio.sleep(max(0.0, begun + record["arrival_seconds"] - time.perf_counter()))  # its arrival
        stream = await client.chat.completions.create(
            model=target.model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={**target.extra, **extra} or None)
        async for chunk in stream:
            _take(chunk, record, time.perf_counter() - begun, first)

    try:  # the client's own timeout bounds each read; this bounds the whole request
        await asyncio.wait_for(read(), target.timeout)
    except asyncio.TimeoutError:
        record["error"] = f"no answer within --timeout {target.timeout:g} s"
    except openai.RateLimitError as err:
        record["rejected"], record["error"] = True, one_line(err)
    except Exception as err:  # noqa: BLE001 - any failure of one request is that request's error
        record["error"] = one_line(err)
    finally:
        record["end_seconds"] = time.perf_counter() - begun
        first.arrived(record["user"])


async def post_document(client, text: str, timeout: float) -> dict:
    """kvpot's `POST /v1/documents`: the JSON answer (id, context_tokens, ...)."""
    import httpx

    response = await client.post("/documents", cast_to=httpx.Response, body={"text": text},
                                 options={"timeout": timeout})
    return response.json()


async def _document(client, target: Target, text: str) -> tuple[dict | None, dict]:
    """Upload the shared document once: (extra body naming it, or None where the server has no such
    route, and the row's document fields)."""
    openai = require_openai()
    begun = time.perf_counter()
    try:
        answer = await post_document(client, text, target.timeout)
    except openai.APIStatusError as err:
        if err.status_code in (404, 405):  # not kvpot's server: the document goes in every prompt
            return None, {"document_route": False}
        raise KvpotError(f"the document upload failed: {one_line(err)}") from None
    except openai.APIError as err:
        raise KvpotError(f"the document upload failed: {one_line(err)}") from None
    return {"document_id": answer["id"]}, {
        "document_route": True, "document_id": answer["id"], "document_context_tokens": answer.get("context_tokens"),
        "document_upload_seconds": time.perf_counter() - begun, "document_reused": answer.get("reused")}


async def _everyone_started(first: _FirstTokens, started, groups: int) -> None:
    """Tell the other processes this one's users all decode; with `groups`, wait until all do."""
    await first.event.wait()
    started.put(1)
    for _ in range(groups):
        await asyncio.to_thread(started.get)


async def _upload_during(client, text: str, everyone: asyncio.Task, begun: float, timeout: float) -> dict:
    """Upload another document once every user (of every client process) decodes: its time window and seconds."""
    openai = require_openai()
    await asyncio.shield(everyone)
    start = time.perf_counter() - begun
    error, answer = None, {}
    try:
        answer = await post_document(client, text, timeout)
    except openai.APIError as err:
        error = one_line(err)
    end = time.perf_counter() - begun
    return {"upload_during_seconds": end - start, "upload_window_seconds": [start, end],
            "upload_during_error": error, "upload_during_reused": answer.get("reused"),
            "upload_during_context_tokens": answer.get("context_tokens")}


CLIENT_USERS = 16  # users per client process: one asyncio loop parses ~0.5 ms of CPU per chunk


def drive(target: Target, contexts: list[str], questions: list[str], document: str | None, max_tokens,
          upload: str | None = None, arrivals: list[float] | None = None) -> dict:
    """Run one workload: {"records": [...], "wall_seconds", document and upload fields}.

    The users are spread over client processes of `CLIENT_USERS` each (one loop parsing every stream
    would lag, and its timestamps with it), all starting at one instant (`perf_counter` is the system's
    monotonic clock, shared by the processes); the document is uploaded first, from this process."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    fields, extra = {}, {}
    users = len(questions)
    max_tokens = [max_tokens] * users if isinstance(max_tokens, int) else list(max_tokens)  # per user
    arrivals = [0.0] * users if arrivals is None else list(arrivals)
    if document is not None:
        extra, fields = asyncio.run(_upload_shared(target, document))
        if extra is None:
            extra, contexts = {}, [document] * len(questions)
    groups = [list(range(start, len(questions), -(-len(questions) // CLIENT_USERS)))
              for start in range(-(-len(questions) // CLIENT_USERS))]
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, ProcessPoolExecutor(max_workers=len(groups), mp_context=context) as pool:
        # every process says when it is ready (imports done, client made); then all start at one instant
        ready, go, started = manager.Queue(), manager.Queue(), manager.Queue()
        futures = [pool.submit(_drive_group, target,
                               [(u, contexts[u], questions[u], max_tokens[u], arrivals[u]) for u in users], extra,
                               (ready, go), upload if index == 0 else None, started, len(groups))
                   for index, users in enumerate(groups)]
        for _ in groups:
            ready.get()
        start_at = time.perf_counter() + 0.05
        for _ in groups:
            go.put(start_at)
        outcomes = [future.result() for future in futures]
    records = sorted((r for outcome in outcomes for r in outcome["records"]), key=lambda r: r["user"])
    for outcome in outcomes:
        fields.update({k: v for k, v in outcome.items() if k not in ("records", "client_cpu_seconds")})
    return {**fields, "records": records, "wall_seconds": max(r["end_seconds"] for r in records),
            "client_cpu_seconds": sum(o["client_cpu_seconds"] for o in outcomes), "client_processes": len(groups)}


async def _upload_shared(target: Target, document: str) -> tuple[dict | None, dict]:
    async with _client(target.url, target.api_key, target.timeout) as client:
        return await _document(client, target, document)


def _drive_group(target, users, extra, start, upload, started, groups) -> dict:
    return asyncio.run(_drive(target, users, extra, start, upload, started, groups))


async def _drive(target, users, extra, start, upload, started, groups) -> dict:
    cpu = time.process_time()
    async with _client(target.url, target.api_key, target.timeout) as client:
        records = [_record(user, arrival) for user, _, _, _, arrival in users]
        first = _FirstTokens(len(records))
        ready, go = start
        ready.put(1)
        begun = await asyncio.to_thread(go.get)
        await asyncio.sleep(max(0.0, begun - time.perf_counter()))
        tasks = [_stream(client, target, _messages(target, c, q), extra, new, begun, r, first)
                 for (_, c, q, new, _), r in zip(users, records)]
        everyone = asyncio.create_task(_everyone_started(first, started, groups if upload else 0))
        during = asyncio.create_task(_upload_during(client, upload, everyone, begun, target.timeout)) if upload else None
        await asyncio.gather(*tasks)
        await everyone
        fields = await during if during is not None else {}
    return {**fields, "records": records, "client_cpu_seconds": time.process_time() - cpu}


def load_record(record: dict) -> dict:
    """A stream's record as `kvpot.bench.load` reads it: times from its arrival, gaps between chunks."""
    arrival, answered = record.get("arrival_seconds", 0.0), record["error"] is None
    made = len(record["chunk_seconds"]) if record["completion_tokens"] is None else record["completion_tokens"]
    finished = answered and record["finish_reason"] is not None
    return {"arrival": arrival, "ttft": None if record["ttft_seconds"] is None else record["ttft_seconds"] - arrival,
            "gaps": [b - a for a, b in zip(record["chunk_seconds"], record["chunk_seconds"][1:])],
            "times": list(record["chunk_seconds"]), "e2e": record["end_seconds"] - arrival if finished else None,
            "output_tokens": made if answered else 0,
            "prompt_tokens": record["prompt_tokens"] or 0, "finished": finished}


def summarize(outcome: dict, slo_ttft: float | None = None, slo_itl: float | None = None) -> dict:
    """A row's figures from `drive`'s outcome, as `bench throughput` reports them, plus what failed."""
    from types import SimpleNamespace

    from kvpot.bench.load import quantile
    from kvpot.bench.throughput import _rates

    records = outcome["records"]
    answered = [r for r in records if r["error"] is None]
    gaps = [(a, b) for r in records for a, b in zip(r["chunk_seconds"], r["chunk_seconds"][1:])]
    row = _rates(SimpleNamespace(slo_ttft=slo_ttft, slo_itl=slo_itl), [load_record(r) for r in records],
                 outcome["wall_seconds"])
    made = row["output_tokens"]
    chunks = sum(len(r["chunk_seconds"]) for r in answered)
    prompts = [r["prompt_tokens"] for r in answered if r["prompt_tokens"] is not None]
    row.update({k: v for k, v in outcome.items() if k != "records"})
    row.update(rejected=sum(r["rejected"] for r in records), failed=sum(r["error"] is not None and not r["rejected"]
                                                                      for r in records),
               usage_missing=sum(r["completion_tokens"] is None for r in answered),
               tokens_per_chunk=made / chunks if chunks else None,
               prompt_tokens_mean=sum(prompts) / len(prompts) if prompts else None)
    if row["failed"]:
        reason = next(r["error"] for r in records if r["error"] is not None and not r["rejected"])
        row["error"] = f"{row['failed']} of {len(records)} requests failed; the first: {reason}"
    if "upload_window_seconds" in outcome:
        start, end = outcome["upload_window_seconds"]
        during = [1000 * (b - a) for a, b in gaps if a < end and b > start]  # gaps overlapping the upload
        row.update(itl_p99_ms_during_upload=quantile(during, 0.99), itl_gaps_during_upload=len(during))
    row["records"] = records
    return row
