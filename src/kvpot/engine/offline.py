"""Offline jobs on the batched engine: a list of requests run to the end (generation of many prompts,
evaluation, lm-eval). `Engine.generate_batch` is the text face of `generate_many`."""

from __future__ import annotations

from collections import deque

import torch

from kvpot.defaults import MIX, OFFLINE_PROMPT_ORDER
from kvpot.engine.requests import Request
from kvpot.engine.sampling import _as_ids
from kvpot.engine.scheduler import Scheduler
from kvpot.errors import KvpotError


def generate_texts(engine, contexts, questions, max_new_tokens: int, states, progress: bool, batch_size: int | None,
                   share_documents: bool = False, mix: bool | str = MIX, reader_room: int | None = None, **sampling):
    """`Engine.generate_batch`: encode each prompt, run them `batch_size` at a time, results in order."""
    if (contexts is None) == (states is None):
        raise KvpotError("give either contexts or states (one list), not both.")
    prompts = contexts if contexts is not None else states
    questions = list(questions) if questions is not None else [None] * len(prompts)
    if len(questions) != len(prompts):
        raise KvpotError(f"{len(prompts)} prompts but {len(questions)} questions; give one question per prompt.")
    requests = []
    for prompt, question in zip(prompts, questions):
        if contexts is not None:
            if not prompt:
                raise KvpotError("a context is empty; give some text to read (or prefilled states).")
            context_ids, question_ids = engine.encode(prompt, question)
            requests.append(Request(context_ids, question_ids, max_new_tokens=max_new_tokens, **sampling))
        else:
            _, question_ids = engine.encode(None, question)
            requests.append(Request(None, question_ids, state=prompt, max_new_tokens=max_new_tokens, **sampling))
    generate_many(engine, requests, batch_size or min(len(requests), 64) or 1, progress=progress,
                  share_documents=share_documents, mix=mix, reader_room=reader_room)
    failed = [r for r in requests if r.status == "failed"]
    if failed:
        raise KvpotError(f"{len(failed)} of {len(requests)} prompts failed; the first: {failed[0].error}")
    return [request.result(engine.tokenizer) for request in requests]


def run_all(scheduler: Scheduler, requests: list[Request], progress: bool = False) -> list[Request]:
    """Submit `requests` (as the queue allows) and step until every one is done; a request that
    fails raises its error afterwards (the others still ran)."""
    from tqdm.auto import tqdm

    pending = deque(requests)
    with tqdm(total=len(requests), unit="req", desc="batch", disable=not progress, leave=False) as bar:
        while pending or not scheduler.idle:
            while pending and scheduler.admission.has_room():  # the scheduler's own test: no QueueFull
                scheduler.submit(pending.popleft())
            bar.update(len(scheduler.step()))
    failed = [r for r in requests if r.status == "failed"]
    if failed:
        raise KvpotError(f"{len(failed)} of {len(requests)} requests failed; the first: {failed[0].error}")
    return requests


def generate_many(engine, requests: list[Request], batch_size: int, progress: bool = False,
                  decode: str = "auto", share_documents: bool = False, mix: bool | str = MIX,
                  reader_room: int | None = None) -> list[Request]:
    """Run `requests` through schedulers of `batch_size` slots, `batch_size` requests at a time (offline
    jobs: evaluation, lm-eval). A method whose cache grows with the input gets slots as large as the
    longest request of each group needs. Requests that fail are left failed (their `error` says why).
    `reader_room`: `Scheduler(reader_room=...)`, tail slots for a shared document's readers.
    `mix`: `Scheduler(mix=...)`, where prompt chunks are read (default "auto": with the decoding rows on a GPU).
    Prompts are read in arrival order (`kvpot.defaults.OFFLINE_PROMPT_ORDER`): a plan that reads no clock."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise KvpotError(f"batch_size must be a positive integer, got {batch_size!r}.")
    from tqdm.auto import tqdm

    with tqdm(total=len(requests), unit="req", desc="batch", disable=not progress, leave=False) as bar:
        for start in range(0, len(requests), batch_size):
            group = requests[start : start + batch_size]
            scheduler = Scheduler(engine, slots=len(group), capacity=group_capacity(engine, group), decode=decode,
                                  share_documents=share_documents, mix=mix, prompt_order=OFFLINE_PROMPT_ORDER,
                                  reader_room=reader_room)
            for request in group:
                try:
                    scheduler.submit(request)
                except KvpotError as err:
                    request.status, request.finish_reason, request.error = "failed", "error", str(err)
            scheduler.run()
            bar.update(len(group))
    return requests


def group_capacity(engine, requests: list[Request]) -> int | None:
    """The slot capacity a scheduler for `requests` needs: None (the method's bound) for a bounded method, else as
    large as the longest request needs (a method whose cache grows with the input)."""
    if engine.method.max_entries() is not None:
        return None
    return max(_needed(engine, request) for request in requests)


def _needed(engine, request: Request) -> int:
    """KV entries per layer and KV head `request` needs (for a method without a bound)."""
    if request.state is not None:
        context = max(request.state.cache.lengths())
    else:
        context = len(_as_ids(request.context_ids, torch.device("cpu"), "context_ids"))
    question = len(_as_ids(request.question_ids, torch.device("cpu"), "question_ids"))
    return max(1, engine.method.entries_needed(context, question, request.max_new_tokens))
