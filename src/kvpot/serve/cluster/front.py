"""The front of kvpot's Ray Serve application: behind Ray Serve's HTTP proxy, ahead of the replicas.

It reads each request's body (the document a question is about is in it, where Ray Serve's proxy does
not look), then relays the request to a replica through a streaming `DeploymentHandle` call whose
multiplexed model id is that document: Ray Serve's router (kvpot's `DocumentRouter`) picks the replica.
The replica's answer is held back until it carries output (`bridge.Holdback`); if the replica fails
before that, the request goes to another replica (`--retries`), and `/metrics` counts it. A stream that
already sent output and loses its replica ends with an error event and `[DONE]`, as kvpot ends any
failed stream.

Imported only inside Ray processes (it imports ray at the top).
"""

from __future__ import annotations

import asyncio
import logging
import threading

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import ReplicaUnavailableError
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from kvpot.serve.app import error_response, read_body
from kvpot.serve.cluster.bridge import Holdback, document_of, portable_scope, stream_error
from kvpot.serve.protocol import ApiError

log = logging.getLogger("kvpot.serve")
REPLICA_FAILED = (RayActorError, ActorUnavailableError, ReplicaUnavailableError)


class KvpotFront:
    def __init__(self, replicas, config, retries: int = 2):
        self.replicas, self.config, self.retries = replicas, config, retries
        self.lock = threading.Lock()
        self.counts = {"relayed": 0, "retries": 0, "failed": 0, "broken_streams": 0}

    async def __call__(self, request: Request) -> Response:
        try:
            body = await read_body(request, self.config)
        except ApiError as err:
            return error_response(err)
        scope = portable_scope(request.scope)
        document = document_of(scope["method"], scope["path"], body)
        self._count("relayed")
        for attempt in range(self.retries + 1):
            if attempt:
                self._count("retries")
                await asyncio.sleep(0.1 * attempt)  # the router learns of the failure, or a replica comes back
            call = self.replicas.options(stream=True, multiplexed_model_id=document)
            answer = call.exchange.remote(scope, body)
            held = Holdback()
            try:
                async for message in answer:
                    held.add(message)
                    if held.committed or held.retryable:
                        break
            except REPLICA_FAILED as err:
                log.warning("a replica failed before answering %s %s (attempt %d): %s", scope["method"],
                            scope["path"], attempt + 1, type(err).__name__)
                continue
            except asyncio.CancelledError:
                answer.cancel()  # the client went away: the replica's app sees a disconnect
                raise
            if held.retryable:
                answer.cancel()
                continue
            if scope["path"] == "/metrics":
                return await self._metrics(held, answer)
            return _Relay(held, answer, self)
        self._count("failed")
        return error_response(ApiError(503, f"no replica answered ({self.retries + 1} tried); retry in a moment.",
                                       code="replicas_unavailable", headers={"Retry-After": "5"}))

    def _count(self, name: str) -> None:
        with self.lock:
            self.counts[name] += 1

    async def _metrics(self, held: Holdback, answer) -> Response:
        """The answering replica's metrics (its id in the replica header) and the front's own counters."""
        async for message in answer:
            held.add(message)
        text = b"".join(m.get("body", b"") for m in held.messages if m["type"] == "http.response.body").decode()
        headers = {k.decode(): v.decode() for k, v in held.messages[0].get("headers", []) if k == b"x-kvpot-replica"}
        return PlainTextResponse(text + self.render(), status_code=held.status, headers=headers,
                                 media_type="text/plain; version=0.0.4")

    def render(self) -> str:
        with self.lock:
            counts = dict(self.counts)
        rows = [("requests_total", "counter", "Requests the front relayed to a replica.", counts["relayed"]),
                ("retries_total", "counter", "Requests sent to another replica after theirs failed before any "
                 "output.", counts["retries"]),
                ("failed_total", "counter", "Requests no replica answered (503 replicas_unavailable).",
                 counts["failed"]),
                ("broken_streams_total", "counter", "Streams whose replica failed after they sent output (ended "
                 "with an error event).", counts["broken_streams"])]
        return "".join(f"# HELP kvpot_cluster_{name} {text}\n# TYPE kvpot_cluster_{name} {kind}\n"
                       f"kvpot_cluster_{name} {value}\n" for name, kind, text, value in rows)


class _Relay(Response):
    """The replica's answer: what was held back, then the rest as it comes. Starlette's `Response` only as the
    type Ray Serve sends as is; its ASGI call is this one."""

    def __init__(self, held: Holdback, answer, front: KvpotFront):
        self.held, self.answer, self.front = held, answer, front
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        for message in self.held.messages:
            await send(message)
        done = not self.held.messages[-1].get("more_body", False)
        try:
            async for message in self.answer:  # after a whole answer: the replica's call ending, nothing more
                if not done:
                    await send(message)
        except REPLICA_FAILED as err:
            if not done:
                self.front._count("broken_streams")
                log.warning("a replica failed while streaming: %s", type(err).__name__)
                tail = stream_error("the replica answering this request failed; ask again.", "replica_failed") \
                    if self.held.streamed else b""
                await send({"type": "http.response.body", "body": tail, "more_body": False})
        except asyncio.CancelledError:
            self.answer.cancel()  # the client went away: the replica's app sees a disconnect
            raise
