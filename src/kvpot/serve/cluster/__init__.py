"""`kvpot serve --replicas N`: N kvpot engines behind Ray Serve's HTTP proxy, with the same OpenAI API
(docs/scaling.md). Needs the `cluster` extra (`pip install "kvpot[cluster]"`: Ray Serve).

The application has two deployments:
- `KvpotReplica` (kvpot.serve.cluster.replica), N replicas of one GPU each (or `--replica-cpus` CPUs): each
  a whole `kvpot serve`, its FastAPI app answering the requests relayed to it;
- `KvpotFront` (kvpot.serve.cluster.front), behind the proxy: it finds the document a request is about and
  relays it through a `DeploymentHandle` whose router (kvpot.serve.cluster.router) prefers the replica
  holding that document, and retries on another replica a request that got no output from a failed one.

>>> from kvpot.serve.cluster import app_builder      # for `serve run kvpot.serve.cluster:app_builder ...`
>>> app = app_builder({"model": "smollm2-135m", "replicas": "2", "state_dir": "/shared/states"})

Ray is imported here only inside functions: `import kvpot.serve.cluster` works without it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import threading
import typing
from dataclasses import dataclass

from kvpot.errors import KvpotError
from kvpot.serve.config import EngineRecipe, ServeConfig, parse_bytes

log = logging.getLogger("kvpot.serve")
APP_NAME = "kvpot"
ROUTER = "kvpot.serve.cluster.router.DocumentRouter"
_MAX_SLOTS = 256  # the most slots a replica's pool takes (kvpot.serve.service)


@dataclass(frozen=True)
class ClusterConfig:
    """How many replicas, and how requests reach them (the CLI's replica flags)."""

    replicas: int = 2
    replica_cpus: float = 1.0  # logical CPUs a CPU replica reserves (a GPU replica reserves one GPU)
    retries: int = 2  # further replicas tried for a request that got no output from a failed one
    affinity_slack: int = 4  # requests in flight beyond the least-loaded replica before a document's questions move
    # front replicas relaying answers: every streamed token passes through one, ~2,500 tokens/s each on an H200
    # host (records/ray-serve-h200x2/); their counters in /metrics are per front
    fronts: int = 1

    def __post_init__(self):
        for name in ("replicas", "retries", "affinity_slack", "fronts"):
            value = getattr(self, name)
            least = 1 if name in ("replicas", "fronts") else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise KvpotError(f"--{name.replace('_', '-')} must be an integer >= {least}, got {value!r}.")
        if not self.replica_cpus > 0:
            raise KvpotError(f"--replica-cpus must be positive, got {self.replica_cpus!r}.")


def require_ray():
    """(ray, ray.serve), or an error naming the extra."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise KvpotError("replicas need Ray Serve: pip install 'kvpot[cluster]'.") from None
    return ray, serve


def build_app(recipe: EngineRecipe, config: ServeConfig, cluster: ClusterConfig, log_level: str = "info",
              gpus: bool | None = None):
    """The Ray Serve application (for `serve.run`). `gpus`: one GPU per replica (None: when `recipe.device`
    names CUDA, or names nothing and the Ray cluster has GPUs)."""
    ray, serve = require_ray()
    from ray.serve.config import RequestRouterConfig

    from kvpot.serve.cluster.front import KvpotFront
    from kvpot.serve.cluster.replica import KvpotReplica

    if gpus is None:
        gpus = (recipe.device or "").startswith("cuda") or (
            recipe.device is None and ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0)
    recipe = dataclasses.replace(recipe, device="cuda" if gpus else "cpu")  # a replica sees its own GPU as cuda:0
    config = dataclasses.replace(config, state_dir_shared=True)
    # without a shared directory a document lives only where it was read: its questions never leave that replica
    slack = cluster.affinity_slack if config.state_dir is not None else None
    in_flight = _MAX_SLOTS + config.max_queue  # kvpot's own admission answers 429 beyond its slots and queue
    replica = serve.deployment(KvpotReplica, name="KvpotReplica").options(
        num_replicas=cluster.replicas, max_ongoing_requests=in_flight,
        ray_actor_options={"num_gpus": 1} if gpus else {"num_cpus": cluster.replica_cpus},
        graceful_shutdown_timeout_s=config.shutdown_grace,
        request_router_config=RequestRouterConfig(request_router_class=ROUTER,
                                                  request_router_kwargs={"slack": slack}))
    front = serve.deployment(KvpotFront, name="KvpotFront").options(
        num_replicas=cluster.fronts, max_ongoing_requests=in_flight * cluster.replicas,
        ray_actor_options={"num_cpus": 0})
    return front.bind(replica.bind(recipe, config, log_level), config, cluster.retries)


def app_builder(args: dict):
    """`serve run kvpot.serve.cluster:app_builder model=smollm2-135m replicas=2 state_dir=/shared/states ...`:
    the keys are `kvpot serve`'s flags (dashes or underscores); Ray Serve's own options (host, port, the
    cluster's address) are `serve run`'s."""
    values = {str(k).replace("-", "_"): v for k, v in dict(args or {}).items()}
    engine_keys = {f.name for f in dataclasses.fields(EngineRecipe)}
    cluster_keys = {f.name for f in dataclasses.fields(ClusterConfig)}
    serve_keys = {f.name for f in dataclasses.fields(ServeConfig)} - {"state_dir_shared"}
    unknown = set(values) - engine_keys - cluster_keys - serve_keys - {"log_level"}
    if unknown:
        raise KvpotError(f"app_builder: unknown option(s) {sorted(unknown)}; give kvpot serve's flags, e.g. "
                         "model=smollm2-135m replicas=2 state_dir=/shared/states.")
    recipe = EngineRecipe(**{k: _coerce(EngineRecipe, k, v) for k, v in values.items() if k in engine_keys})
    config = ServeConfig(**{k: _coerce(ServeConfig, k, v) for k, v in values.items() if k in serve_keys})
    cluster = ClusterConfig(**{k: _coerce(ClusterConfig, k, v) for k, v in values.items() if k in cluster_keys})
    recipe.check(config)
    return build_app(recipe, config, cluster, str(values.get("log_level", "info")))


_SIZES = ("max_body_bytes", "state_memory", "state_disk")


def _coerce(kind: type, name: str, value):
    """A `serve run` option's text as the field's type (sizes as `--state-memory` takes them)."""
    if not isinstance(value, str):
        return value
    if name in _SIZES:
        return parse_bytes(value, f"--{name.replace('_', '-')}")
    hint = str(typing.get_type_hints(kind)[name])
    try:
        if "bool" in hint:
            return value.strip().lower() in ("1", "true", "yes", "on")
        if "tuple" in hint:
            return tuple(value.split(","))
        if "int" in hint:
            return int(value)
        if "float" in hint:
            return float(value)
    except ValueError:
        raise KvpotError(f"app_builder: {name}={value!r} is not a {hint}.") from None
    return value


def run_cluster(recipe: EngineRecipe, config: ServeConfig, cluster: ClusterConfig, log_level: str = "info") -> None:
    """Serve through Ray Serve until SIGTERM or Ctrl-C: joins the Ray cluster at $RAY_ADDRESS, else starts one
    on this machine (stopped again at the end); the application is deleted when this returns."""
    ray, serve = require_ray()
    started = not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")
    gpus = (recipe.device or "").startswith("cuda")
    if started:  # logical CPUs: enough for the CPU replicas asked for, whatever the cores
        cpus = max(os.cpu_count() or 1, math.ceil(cluster.replicas * cluster.replica_cpus))
        ray.init(num_cpus=cpus, include_dashboard=False, logging_level=log_level.upper())
    elif not ray.is_initialized():
        ray.init(logging_level=log_level.upper())
    try:
        gpus = gpus or (recipe.device is None and ray.cluster_resources().get("GPU", 0) > 0)
        have = ray.cluster_resources().get("GPU", 0)
        if gpus and have < cluster.replicas:
            raise KvpotError(f"--replicas {cluster.replicas} needs {cluster.replicas} GPUs (one each); the Ray "
                             f"cluster has {have:g}.")
        serve.start(http_options={"host": config.host, "port": config.port})
        try:
            serve.run(build_app(recipe, config, cluster, log_level, gpus=gpus), name=APP_NAME, route_prefix="/")
        except RuntimeError as err:
            raise KvpotError(f"the replicas did not start: {err}") from None
        log.info("serving %s on http://%s:%d with %d %s replicas (Ray Serve)", config.method, config.host,
                 config.port, cluster.replicas, "GPU" if gpus else "CPU")
        _wait_for_signal()
        log.info("shutting down: the replicas finish their requests (up to %g s)", config.shutdown_grace)
        # in a thread with a deadline: a Ctrl-C in a terminal reaches the whole process group, Ray's own
        # processes started here included, and a deletion they can no longer answer would wait for ever
        deleting = threading.Thread(target=serve.delete, args=(APP_NAME,), daemon=True)
        deleting.start()
        deleting.join(config.shutdown_grace + 30)
    finally:
        if started:
            serve.shutdown()
            ray.shutdown()


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass


__all__ = ["ClusterConfig", "app_builder", "build_app", "require_ray", "run_cluster"]
