"""`kvpot serve`'s process: uvicorn running the app, with kvpot's logging, a time limit on request
headers, and a gentle shutdown on SIGTERM or Ctrl-C (docs/serving.md, *Shutdown*).

uvicorn stays the server; kvpot only uses its public extension points: a `Server` subclass
(`handle_exit`, the signal handler, starts the drain instead of stopping at once) and the HTTP
protocol class its `Config` takes (`http=`), here h11's with a deadline for a request's headers.
"""

from __future__ import annotations

import asyncio
import logging
import sys

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("kvpot.serve")


def run_server(engine, config, log_level: str = "info"):
    """Serve `engine` with `config` (`ServeConfig`) until SIGTERM or Ctrl-C (or, under tensor parallelism,
    until the other ranks are gone); returns the `Service` after the shutdown."""
    from kvpot.serve.app import create_app

    setup_logging(log_level)
    if not config.api_key and not _loopback(config.host) and not config.allowed_hosts:
        log.warning("binding %s without --api-key: only requests whose Host names a loopback address are "
                    "answered; name this machine's other names with --allowed-hosts (or give --api-key)", config.host)
    app = create_app(engine, config)
    protocol = type("KvpotH11", (_TimedH11,), {"header_timeout": config.read_timeout})
    settings = uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level, access_log=False,
                              http=protocol, timeout_graceful_shutdown=5)
    _Server(settings, app.state.service, config.shutdown_grace).run()
    return app.state.service


def setup_logging(level: str) -> None:
    """kvpot's own lines (pools, stored states found, shutdown) to stderr beside uvicorn's, at `level`."""
    logger = logging.getLogger("kvpot")
    logger.setLevel(level.upper())
    if not any(getattr(h, "kvpot", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)-9s kvpot: %(message)s"))
        handler.kvpot = True
        logger.addHandler(handler)
        logger.propagate = False


class _Server(uvicorn.Server):
    """uvicorn's server whose first SIGTERM/SIGINT drains (`Service.drain`) before uvicorn stops; a second
    one stops at once, as uvicorn does."""

    def __init__(self, config: uvicorn.Config, service, grace: float):
        super().__init__(config)
        self.service, self.grace = service, grace
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        watch = self.loop.create_task(self._watch_ranks())
        try:
            await super().serve(sockets)
        finally:
            watch.cancel()

    async def _watch_ranks(self) -> None:
        """Under tensor parallelism: stop serving once the other ranks are gone (no request can run)."""
        while not self.service.worker.broken:
            await asyncio.sleep(0.5)
        self.should_exit = True

    def handle_exit(self, sig, frame) -> None:
        if self.loop is None or self.drain_task is not None or self.should_exit:
            return super().handle_exit(sig, frame)
        self.drain_task = True  # taken: the next signal stops at once
        self.loop.call_soon_threadsafe(self._begin_drain, sig, frame)

    def _begin_drain(self, sig, frame) -> None:
        self.drain_task = self.loop.create_task(self._drain(sig, frame))

    async def _drain(self, sig, frame) -> None:
        try:
            await self.service.drain(self.grace)
        finally:
            super().handle_exit(sig, frame)


class _TimedH11(H11Protocol):
    """h11's protocol with a deadline for each request's headers: a client that opens a connection (or
    starts a request on a kept-alive one) and sends its headers slowly is answered 408 and closed, rather
    than holding the connection for as long as it likes. Bodies have their own limit (the app's)."""

    header_timeout = 30.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # the next request on this connection gets its own deadline

    def _arm(self) -> None:
        handle = getattr(self, "_header_deadline", None)
        if handle is not None:
            handle.cancel()
        self._header_deadline = self.loop.call_later(self.header_timeout, self._headers_late, self.cycle)

    def _headers_late(self, cycle_before) -> None:
        if self.cycle is not cycle_before or self.transport.is_closing():
            return  # a request's headers came in time
        body = (b'{"error": {"message": "the request headers did not arrive in time (--read-timeout).", '
                b'"type": "invalid_request_error", "param": null, "code": "request_timeout"}}')
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                             b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        self.transport.close()

    def connection_lost(self, exc) -> None:
        handle = getattr(self, "_header_deadline", None)
        if handle is not None:
            handle.cancel()
        super().connection_lost(exc)


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")
