"""`kvpot serve --tp N`: one server over the N processes of a torchrun (tensor parallelism).

Every rank loads its shard of the model (transformers' TP plan, `kvpot.models.tensor_parallel`) and builds
the same `Service`; rank 0 alone runs the HTTP server. Every forward holds collectives, so every rank must
do the same engine work in the same order. The server's generation thread already does all of it in turns
(`kvpot.serve.turns`), so rank 0 plans each turn (the commands that arrived: requests submitted, texts to
read, stored states promoted or deleted, pools made; the pools it steps; whether the oldest read advances
or stops), sends it with one `broadcast_object_list` over a gloo group of its own (`kvpot.serve.turns`:
objects never go through NCCL), and every rank runs it. Inside a step the scheduler's own agreement
(`kvpot.engine.agreement`) checks that every rank holds the same new requests and applies rank 0's
cancellations at the same boundary, and rank 0's sampled tokens are broadcast (`kvpot.models.parallel`).

- An idle rank 0 still sends a turn a second, so the other ranks, waiting in the broadcast, never time out.
- Stopping: rank 0 drains as alone (`--shutdown-grace`), then sends a stop turn; the other ranks leave their
  loop and exit 0. They ignore SIGINT and SIGTERM (torchrun forwards its signals to every rank, Ctrl-C
  reaches the whole process group): they stop when rank 0 says, after its drain.
- A rank that dies or hangs: rank 0's broadcast raises (gloo sees a closed connection at once, a hung rank
  after `--tp-timeout` seconds); every request then fails with a 503 saying so, /health answers 503
  "broken", and the server exits with an error. A rank whose step raises where rank 0's did not is out of
  step: it stops itself, with the same result on rank 0. A rank 0 that dies: the others' broadcast raises
  and they exit with an error (torchrun stops the rest).
- Stored states: each rank holds its own KV heads of each state, under rank 0's keys (the same text, the same
  key); with --state-dir each rank keeps its files in a subfolder of its own (`tp2-rank0`, `tp2-rank1`).
"""

from __future__ import annotations

import logging
import signal

from kvpot.errors import KvpotError

log = logging.getLogger("kvpot.serve")


def serve_tensor_parallel(recipe, config, log_level: str) -> None:
    """Load this rank's shard, then serve (rank 0) or follow rank 0's turns (the others) until it stops."""
    import torch.distributed as dist

    engine = recipe.build()
    if engine.parallel is None:
        raise KvpotError(f"--tp {recipe.tp}: the model was not sharded (transformers gave one process).")
    if engine.parallel.rank == 0:
        from kvpot.serve.server import run_server

        # uvicorn raises a signal that stopped it again once it is done; torchrun would count that as this
        # rank failing, though the server drained and every rank stops cleanly: rank 0 exits 0 instead
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        service = run_server(engine, config, log_level)
        if service.worker.broken:
            raise KvpotError(service.worker.broken)
    else:
        follow(engine, config)
    dist.destroy_process_group()


def follow(engine, config) -> None:
    """A rank other than 0: the same `Service` as rank 0's without HTTP; runs rank 0's turns until it stops."""
    from kvpot.serve.service import Service

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # rank 0 drains first, then tells this rank to stop
    logging.getLogger("kvpot").setLevel(max(logging.WARNING, logging.getLogger("kvpot").level))  # rank 0 logs
    service = Service(engine, config)
    service.worker.follow()
    log.debug("rank %d: the server stopped", engine.parallel.rank)
