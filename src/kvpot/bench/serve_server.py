"""kvpot's server launched inside this process for `kvpot bench serve`: uvicorn on a free loopback
port, in a background thread, stopped when the block ends."""

from __future__ import annotations

import dataclasses
import threading
import time

from kvpot.errors import KvpotError

START_SECONDS = 120.0


def serve_options(**wanted) -> tuple[dict, list[str]]:
    """The `ServeConfig` fields among `wanted` that this kvpot's server has (the server changes
    faster than this benchmark), and the names it lacks."""
    from kvpot.serve import ServeConfig

    names = {f.name for f in dataclasses.fields(ServeConfig)}
    return {k: v for k, v in wanted.items() if k in names}, [k for k in wanted if k not in names]


def kvpot_app(engine, serve_config):
    """kvpot's server app for `engine` (FastAPI and uvicorn are the `serve` extra)."""
    import importlib.util

    if not all(importlib.util.find_spec(name) for name in ("fastapi", "uvicorn")):
        raise KvpotError("bench serve launches kvpot's server, which needs FastAPI and uvicorn: "
                         "pip install 'kvpot[serve]'.")
    from kvpot.serve import create_app

    return create_app(engine, serve_config)


def accepts(field: str) -> bool:
    """Whether kvpot's chat requests have a field (unknown fields are accepted and ignored)."""
    from kvpot.serve.protocol import ChatRequest

    return field in ChatRequest.model_fields


class LaunchedServer:
    """`with LaunchedServer(app) as server:` an ASGI app (kvpot's: `kvpot.serve.create_app`) served at
    `server.url`."""

    def __init__(self, app):
        self.app = app
        self.server = self.thread = None
        self.url = None

    def __enter__(self) -> LaunchedServer:
        import uvicorn

        # port 0: the system picks a free one, read back once the socket is bound (no race with others)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="kvpot-bench-serve", daemon=True)
        self.thread.start()
        self._wait_started()
        return self

    def _wait_started(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.__exit__()
                raise KvpotError("kvpot's server did not start (see the log above).")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        _wait_healthy(self.url, deadline)

    def __exit__(self, *exc) -> bool:
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(timeout=60)
        self.server = self.thread = self.app = None  # the app holds the server's slots: gone with it
        _forget_endpoints()
        return False


def _forget_endpoints() -> None:
    """Empty FastAPI's module-level caches, which key on endpoint functions: they would keep a stopped
    app, its server and all the GPU memory of its slots alive for the rest of the process (the engine
    row, the next method's server)."""
    import functools
    import sys

    modules = ("fastapi.dependencies.models", "fastapi.dependencies.utils", "fastapi._compat.v2", "fastapi.routing")
    for module in filter(None, map(sys.modules.get, modules)):
        for value in vars(module).values():
            if isinstance(value, functools._lru_cache_wrapper):
                value.cache_clear()


def _wait_healthy(url: str, deadline: float) -> None:
    import httpx

    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise KvpotError(f"kvpot's server at {url} did not answer GET /health within {START_SECONDS:.0f} s.")
