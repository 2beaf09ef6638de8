"""One Ray Serve replica: a whole `kvpot serve` (engine, slot pool, state store, FastAPI app) in one actor.

The front calls `exchange` through a streaming `DeploymentHandle` with the request's document as Ray
Serve's multiplexed model id. Model multiplexing is how the replica tells Ray Serve which documents it
holds: `hold` is the `@serve.multiplexed` loader, called for each document this replica reads or
answers from, and Ray Serve reports the ids it returned to every router (kvpot's `DocumentRouter`).
The states themselves live in the replica's store (memory up to `--state-memory`, then the shared
`--state-dir`); `hold` only records the id.

Imported only inside Ray processes (it imports ray at the top).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

from ray import serve

from kvpot.serve.cluster.bridge import REPLICA_HEADER, exchange

log = logging.getLogger("kvpot.serve")
# documents a replica reports holding (least recently used out of the report, not out of memory): routing hints
HELD_DOCUMENTS = 256


class KvpotReplica:
    """Loads the engine from `recipe` and serves kvpot's app with `config` (both from the driver)."""

    async def __init__(self, recipe, config, log_level: str = "info"):
        from kvpot.serve.app import create_app
        from kvpot.serve.server import setup_logging

        setup_logging(log_level)
        if config.api_key is None and os.environ.get("KVPOT_API_KEY"):  # as `kvpot serve`: a secret, not an argument
            config = dataclasses.replace(config, api_key=os.environ["KVPOT_API_KEY"])
        self.app = create_app(recipe.build(), config)
        self.service = self.app.state.service
        self.name = serve.get_replica_context().replica_id.to_full_id_str()  # its actor's name in Ray
        # the app's own startup (the slot pool is allocated here, before the first request), as uvicorn runs it
        self.lifespan = self.app.router.lifespan_context(self.app)
        await self.lifespan.__aenter__()
        log.info("replica %s ready: %s", self.name, [p.describe() for p in self.service.worker.pools.values()])

    @serve.multiplexed(max_num_models_per_replica=HELD_DOCUMENTS)
    async def hold(self, document_id: str) -> str:
        return document_id

    async def exchange(self, scope: dict, body: bytes):
        """Answer one HTTP request with kvpot's app; yields its ASGI messages (kvpot.serve.cluster.bridge)."""
        document = serve.get_multiplexed_model_id()
        if document and self.service.store.lookup(document.removeprefix("doc-")) is not None:
            await self.hold(document)  # found here or in the shared --state-dir: now this replica holds it
        upload = scope["method"] == "POST" and scope["path"] == "/v1/documents"
        status = 0
        async for message in exchange(self.app, scope, body):
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REPLICA_HEADER.encode(), self.name.encode())]}
            elif upload and status == 200:
                await self._hold_uploaded(message.get("body", b""))
            yield message

    async def _hold_uploaded(self, body: bytes) -> None:
        """A document read here is held here: its questions are routed to this replica from now on."""
        try:
            document = json.loads(body).get("id")
        except (ValueError, AttributeError):
            return
        if isinstance(document, str):
            await self.hold(document)

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose generation thread died is replaced."""
        if not self.service.worker.thread.is_alive():
            raise RuntimeError("the generation thread is not running")

    async def __del__(self):
        """Ray Serve stops the replica (scale down, shutdown): kvpot's own shutdown, states written to disk."""
        await self.lifespan.__aexit__(None, None, None)
