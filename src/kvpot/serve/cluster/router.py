"""Ray Serve's request router for kvpot replicas: document affinity, else the least-loaded replica.

A request about a document carries its id as Ray Serve's multiplexed model id (the front sets it). The
replicas that hold it (they loaded it through their `@serve.multiplexed` loader, and Ray Serve told every
router so) are ranked first; the others after them. Ray Serve's own selection then takes, within the
first rank that has room, the replica with the fewest requests in flight. Requests about no document
rank every replica together: the least-loaded one.

A popular document would otherwise pin all its readers to one replica: when the holders have more than
`slack` requests in flight beyond the least-loaded other replica, the others rank first. The one that gets
the question loads the state from the shared `--state-dir` and holds it too.

Ray Serve imports this class by its path in every process that routes to kvpot replicas (the front).
"""

from __future__ import annotations

import math

from ray.serve.request_router import FIFOMixin, MultiplexMixin, RequestRouter


class DocumentRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, slack: float = 4, **kwargs) -> None:
        self.slack = math.inf if slack is None else slack  # None: a document never leaves its replicas

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        document = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if not document:
            return [candidate_replicas]
        holders = [r for r in candidate_replicas if document in r.multiplexed_model_ids]
        others = [r for r in candidate_replicas if document not in r.multiplexed_model_ids]
        if not holders or not others:
            return [candidate_replicas]
        if self._load(holders) - self._load(others) > self.slack:
            return [others, holders]
        return [holders, others]

    def _load(self, replicas) -> float:
        """The fewest requests in flight among `replicas`, from Ray Serve's queue-length cache (0 if unknown:
        a replica not probed lately has had nothing sent to it through this router)."""
        cache = self.replica_queue_len_cache
        return min((cache.get(r.replica_id) or 0) for r in replicas)
