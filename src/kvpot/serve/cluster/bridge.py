"""What the Ray Serve deployments (kvpot.serve.cluster) share, without Ray: a request carried to a replica
as plain data, kvpot's own app answering it there, and the front's rules for affinity and retries.

A request crosses from the front to a replica as `(scope, body)`: the ASGI scope's plain fields and the
whole body (the front reads it to find the document a request is about). On the replica, `exchange` runs
it through kvpot's FastAPI app, the same one `kvpot serve` runs, and yields the app's ASGI messages, which
travel back through a streaming `DeploymentHandle` call. No route is written twice.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

REPLICA_HEADER = "x-kvpot-replica"  # on every answer: the Ray Serve replica (actor name) that gave it
_SCOPE_KEYS = ("type", "http_version", "method", "scheme", "path", "raw_path", "query_string", "root_path",
               "headers", "client", "server")
_DOCUMENT_ROUTES = ("/v1/chat/completions", "/v1/completions")


def portable_scope(scope: dict) -> dict:
    """The fields of an HTTP scope that another process needs to answer it (no sockets, no state)."""
    out = {key: scope[key] for key in _SCOPE_KEYS if key in scope}
    out["headers"] = [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])]
    out["client"] = tuple(out["client"]) if out.get("client") else None
    out["server"] = tuple(out["server"]) if out.get("server") else None
    out["root_path"] = ""  # the replica's app is mounted at its root, as in `kvpot serve`
    out["asgi"] = {"version": "3.0"}
    return out


def document_of(method: str, path: str, body: bytes) -> str:
    """The document a request is about (`doc-...`), the key affinity routes on; "" for any other request.

    Questions name it in their body (`document_id`), reads and deletions in their path. A body that is not
    JSON has none: the replica that gets it answers the 400."""
    if path.startswith("/v1/documents/") and method in ("GET", "DELETE"):
        return path.removeprefix("/v1/documents/")
    if method != "POST" or path not in _DOCUMENT_ROUTES:
        return ""
    try:
        value = json.loads(body).get("document_id")
    except (ValueError, RecursionError, AttributeError):  # malformed, nested too deeply, not an object
        return ""
    return value if isinstance(value, str) and value.startswith("doc-") and len(value) <= 64 else ""


async def exchange(app, scope: dict, body: bytes) -> AsyncIterator[dict]:
    """Run one request through the ASGI `app` and yield what it sends. When the caller stops iterating (its
    client went away, or Ray cancelled the call) the app's next `receive` says `http.disconnect`, which kvpot's
    app takes as a cancellation: the request leaves its slot at the next step."""
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(scope, receive, out.put)
        finally:
            out.put_nowait(None)

    task = asyncio.create_task(run())
    try:
        while (message := await out.get()) is not None:
            yield message
        await task  # an error the app did not answer itself
    finally:
        gone.set()
        _RUNNING.add(task)  # it ends on its own at the disconnect; kept referenced until then
        task.add_done_callback(_RUNNING.discard)


_RUNNING: set[asyncio.Task] = set()


class Holdback:
    """The front keeps a replica's answer until it carries output, so that a replica that fails before that
    costs the client nothing: the request goes to another replica and the client sees one answer.

    Output is: any body of a plain (non-streamed) answer, since it comes whole at the end; in a stream
    (server-sent events), the first event that is neither a keep-alive comment nor the chat stream's opening
    role chunk. A stream that opens with kvpot's `shutting_down` error (a replica draining) is retried too.
    """

    def __init__(self):
        self.messages: list[dict] = []
        self.status = 0
        self.streamed = False
        self.committed = False
        self.retryable = False  # the replica said it is shutting down before any output

    def add(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            kinds = [v for k, v in message.get("headers", []) if bytes(k).lower() == b"content-type"]
            self.streamed = bool(kinds) and bytes(kinds[0]).startswith(b"text/event-stream")
            self.messages.append(message)
            return
        self.messages.append(message)
        if not self.streamed:
            done = not message.get("more_body", False)
            self.retryable = done and self.status == 503 and b"shutting_down" in self._body()
            self.committed = done and not self.retryable
            return
        for event in _events(message.get("body", b"")):
            if self.retryable:
                break  # the stream's end after its error: the front retries as soon as it sees the error
            if _shutting_down(event) and not self.committed:
                self.retryable = True
            elif not _role_only(event):
                self.committed = True

    def _body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")


def _events(chunk: bytes) -> list[dict | str]:
    """The `data:` payloads of a piece of an event stream (parsed JSON, or the text: `[DONE]`)."""
    out = []
    for line in bytes(chunk).decode("utf-8", "replace").splitlines():
        if not line.startswith("data:"):
            continue  # keep-alive comments, blank separators
        text = line[5:].strip()
        try:
            out.append(json.loads(text))
        except ValueError:
            out.append(text)
    return out


def _role_only(event) -> bool:
    """The chat stream's first chunk: the assistant's role, no text yet."""
    if not isinstance(event, dict) or "error" in event:
        return False
    choices = event.get("choices") or []
    return len(choices) == 1 and not choices[0].get("finish_reason") and choices[0].get("delta") == {
        "role": "assistant", "content": ""}


def _shutting_down(event) -> bool:
    return isinstance(event, dict) and isinstance(event.get("error"), dict) and \
        event["error"].get("code") == "shutting_down"


def stream_error(message: str, code: str) -> bytes:
    """An error event and the end of an OpenAI event stream (as kvpot's app ends a failed stream)."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
