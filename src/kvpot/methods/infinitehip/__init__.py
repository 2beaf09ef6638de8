from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvpot.errors import KvpotError
from kvpot.methods.base import Method, Setup, Step, check_positive
from kvpot.rope import Rope, rotate_half
from kvpot.methods.infinitehip.fixed import FixedMasks, fixed_step, width_bound
from kvpot.methods.infinitehip.offload import GpuKvCache, fixed_scan_bytes, scan_bytes, used_tokens
from kvpot.methods.infinitehip.reference import LayerPlan, MaskCache, Stage, refresh_due, sparse_attention

log = logging.getLogger("kvpot")

# The authors' release defaults (the issue's facts): tokens attended besides the selection.
RELEASE_SINK = 256
RELEASE_WINDOW = 1024
RELEASE_KEEP = (32768, 8192, 2048)
RELEASE_EARLY_KEEP = 4096  # the last stage keeps more in the first layers
DEFAULT_GPU_CACHE = 32768  # offloading: GPU-cached entries per layer (128 MiB a layer for llama3-8b in bf16)
OFFLOAD_NEEDS_KERNELS = ("infinitehip: offload=True needs the Triton kernels (CUDA with Triton, head dims 32-256, "
                         "a RoPE with a fixed table).")


def _ints(value, what: str) -> tuple[int, ...] | None:
    """A tuple of positive ints from a tuple/list or a CLI string such as "256/32/8"."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = tuple(int(part) for part in value.replace(" ", "").split("/") if part)
        except ValueError:
            raise KvpotError(f"infinitehip: {what} must look like 256/32/8, got {value!r}.") from None
    value = tuple(value)
    if not value or any(not isinstance(v, int) or isinstance(v, bool) or v <= 0 for v in value):
        raise KvpotError(f"infinitehip: {what} must be positive integers, got {value!r}.")
    return value


@dataclass
class InfiniteHiP(Method):
    """Hierarchical block-sparse attention over the whole context (Lee et al. 2025, InfiniteHiP).

    Nothing is evicted: every KV entry stays in the cache (un-rotated, `positions="hip"`), and each
    block of `query_block` queries attends to `sink` initial keys, a `window` of recent keys and the
    key chunks that a multi-stage pruning selects (Sec. 4, Algorithms 2-3; `kvpot.methods.infinitehip.reference` holds the
    algorithm). Stage `i` splits the previous survivors into chunks of `chunks[i]` keys, finds each
    chunk's representative key by the halving search, and keeps the best `keep[i] // chunks[i]`
    chunks; the first `early_layers` layers keep `early_keep` tokens in the last stage.

    Positions ("Dynamic RoPE", Sec. 4 and Appendix D): `rope="dynamic"` prunes with chunk-indexed
    positions in the first `early_layers` layers and relative positions in the others, and attends
    with streaming positions; `rope="relative"` prunes with relative positions everywhere (the
    Table 6 ablation); `rope="absolute"` uses true positions throughout.

    Selection is shared by a layer's KV heads (`selection="shared"`: scores max-reduced over heads)
    or made per KV head (`"head"`); GQA is read per KV head, keys are never repeated.

    Scan: `scan="paper"` runs the halving search as the paper states it (max over heads at every split,
    a chunk scored by its representative key); `scan="hip"` runs it as the authors' hip-attn 1.2.9 does
    (each query head on its own path, a chunk scored by the best probe its path met, heads max-reduced
    afterwards; in the first `early_layers` layers with `rope="dynamic"` the queries sit at hip-attn's
    column count of the stage + window, the same for every block, where "paper" counts each block's
    valid candidates), so selections can be compared with hip-attn's. Both searches have a Triton kernel
    (`kvpot.kernels.hip.stage_scan`, `hip_stage_scan`) and a PyTorch form (`kernels="torch"`).

    Prefill is chunked (`chunk_size` tokens per forward) and every query block prunes for itself.
    Decoding reuses each layer's stage outputs: stage `i` is recomputed every `refresh[i]` steps
    (Sec. 4 "Sparse Attention Mask Caching"); the window then starts where it started when stage 1
    last ran, so it grows by at most `refresh[0] - 1` keys and no key is skipped.

    Defaults: `sink`, `window`, `keep` and `early_keep` left as None take the release's values
    (256, 1024, 32768/8192/2048, 4096). When the model's trained window
    (`config.max_position_embeddings`) is shorter than sink + window + early_keep + query_block,
    kvpot halves every defaulted one of them until it fits (logged once), so streaming positions
    stay inside the window; values given explicitly are never changed.

    Kernels: `kernels="auto"` runs the stage scan and the sparse attention as Triton kernels
    (`kvpot.kernels.hip`) on CUDA when Triton is installed and the model's RoPE has a fixed cos/sin
    table (every variant but `dynamic`/`longrope`), and the PyTorch reference otherwise;
    `"triton"` insists (an error where they cannot run), `"torch"` always uses the reference.

    Offloading (Sec. 5): `offload=True` keeps every entry in pinned host memory and a GPU cache of
    `gpu_cache_tokens` entries per layer (default 32,768) in front of it, least recently used out
    (`kvpot.methods.infinitehip.offload`); the kernels read what the GPU cache lacks over the bus. GPU memory is then
    weights + GPU cache + activations + 4 bytes per token per layer. Needs the Triton kernels.

    Bound: none on the cache (everything is kept; the KV cache grows with the input, as in the
    paper without offloading); attention reads at most sink + window + early_keep + block keys per
    query block.
    """

    name = "infinitehip"
    paper = "Lee et al. 2025, InfiniteHiP: Extending Language Model Context Up to 3 Million Tokens on a Single GPU"
    bound = "none: every entry is kept; attention reads sink + selected + window keys"
    # query blocks are cut from each forward's first query and each prunes for itself: a forward that ends mid-block
    # changes the blocks' selections
    chunk_dependent = True
    evicts_while_decoding = False  # nothing is evicted
    merges = False
    grows = True  # every entry is kept
    copies_document = "at_admission"  # its question is read in a forward of its own, which reads and evicts the cache
    positions = "hip"
    chunks: tuple[int, ...] | str = (256, 32, 8)
    keep: tuple[int, ...] | str | None = None
    early_keep: int | None = None
    early_layers: int = 3
    sink: int | None = None
    window: int | None = None
    query_block: int = 64
    rope: str = "dynamic"
    selection: str = "shared"
    scan: str = "paper"
    refresh: tuple[int, ...] | str = (32, 16, 8)
    chunk_size: int = 2048
    kernels: str = "auto"
    offload: bool = False
    gpu_cache_tokens: int | None = None

    def __post_init__(self):
        self.chunks = _ints(self.chunks, "chunks")
        self.keep = _ints(self.keep, "keep")
        self.refresh = _ints(self.refresh, "refresh")
        check_positive(self, "query_block", "chunk_size")
        for name in ("early_keep", "sink", "window"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise KvpotError(f"infinitehip: {name} must be a non-negative integer or None, got {value!r}.")
        if not isinstance(self.early_layers, int) or self.early_layers < 0:
            raise KvpotError(f"infinitehip: early_layers must be a non-negative integer, got {self.early_layers!r}.")
        stages = len(self.chunks)
        if self.keep is not None and len(self.keep) != stages:
            raise KvpotError(f"infinitehip: keep has {len(self.keep)} stages but chunks has {stages}.")
        if len(self.refresh) != stages:
            raise KvpotError(f"infinitehip: refresh has {len(self.refresh)} stages but chunks has {stages}.")
        if any(a % b for a, b in zip(self.chunks, self.chunks[1:])):
            raise KvpotError(f"infinitehip: each chunk size must divide the previous one, got {self.chunks}.")
        if self.rope not in ("dynamic", "relative", "absolute"):
            raise KvpotError(f"infinitehip: rope must be 'dynamic', 'relative' or 'absolute', not {self.rope!r}.")
        if self.selection not in ("shared", "head"):
            raise KvpotError(f"infinitehip: selection must be 'shared' or 'head', not {self.selection!r}.")
        if self.scan not in ("paper", "hip"):
            raise KvpotError(f"infinitehip: scan must be 'paper' or 'hip', not {self.scan!r}.")
        if self.kernels not in ("auto", "triton", "torch"):
            raise KvpotError(f"infinitehip: kernels must be 'auto', 'triton' or 'torch', not {self.kernels!r}.")
        if isinstance(self.offload, str):  # from the CLI
            self.offload = self.offload.lower() in ("1", "true", "yes")
        if self.gpu_cache_tokens is not None and (not isinstance(self.gpu_cache_tokens, int) or self.gpu_cache_tokens <= 0):
            raise KvpotError(f"infinitehip: gpu_cache_tokens must be a positive integer, got {self.gpu_cache_tokens!r}.")
        if self.gpu_cache_tokens is not None and not self.offload:
            raise KvpotError("infinitehip: gpu_cache_tokens sizes the GPU cache of offloading; set offload=True too.")
        if self.offload and self.kernels == "torch":
            raise KvpotError("infinitehip: offload=True reads host memory from the Triton kernels; kernels='torch' cannot.")
        self._announced: int | None = None

    # ------------------------------------------------------------------ sizes
    def resolved(self, max_positions: int | None) -> dict:
        """sink, window, keep, early_keep after the short-window rule (see the class docstring)."""
        sink = RELEASE_SINK if self.sink is None else self.sink
        window = RELEASE_WINDOW if self.window is None else self.window
        keep = RELEASE_KEEP[-len(self.chunks):] if self.keep is None else self.keep
        if self.keep is None and len(keep) < len(self.chunks):  # more stages than the release: repeat its first
            keep = (RELEASE_KEEP[0],) * (len(self.chunks) - len(keep)) + keep
        early = RELEASE_EARLY_KEEP if self.early_keep is None else self.early_keep
        halvings = 0

        def need() -> int:
            return sink + window + max(keep[-1], early) + self.query_block

        defaulted = None in (self.sink, self.window, self.keep, self.early_keep)
        while defaulted and max_positions and need() > max_positions and halvings < 16:
            if self.sink is None:
                sink //= 2
            if self.window is None:
                window = max(1, window // 2)
            if self.keep is None:
                keep = tuple(max(c, k // 2) for c, k in zip(self.chunks, keep))
            if self.early_keep is None:
                early = max(self.chunks[-1], early // 2)
            halvings += 1
        return {"sink": sink, "window": window, "keep": keep, "early_keep": early, "halvings": halvings}

    def plans(self, num_layers: int, max_positions: int | None) -> tuple[list[LayerPlan], list[int]]:
        """Each layer's plan and its last stage's token count."""
        sizes = self.resolved(max_positions)
        if sizes["halvings"] and self._announced != max_positions:
            self._announced = max_positions
            log.warning(
                "infinitehip: the model's window (%s positions) is shorter than the release defaults attend; "
                "using sink=%d, window=%d, keep=%s, early_keep=%d (defaults halved %d times; explicit values kept).",
                max_positions, sizes["sink"], sizes["window"], "/".join(map(str, sizes["keep"])),
                sizes["early_keep"], sizes["halvings"])
        stages = tuple(Stage(c, k) for c, k in zip(self.chunks, sizes["keep"]))
        plans, last = [], []
        for index in range(num_layers):
            early = index < self.early_layers
            prune_rope = {"absolute": "absolute", "relative": "relative"}.get(self.rope, "chunk" if early else "relative")
            plans.append(LayerPlan(stages, sizes["sink"], sizes["window"], self.query_block, prune_rope,
                                   "absolute" if self.rope == "absolute" else "streaming", self.selection == "shared",
                                   self.scan))
            last.append(sizes["early_keep"] if early else sizes["keep"][-1])
        return plans, last

    # ------------------------------------------------------------------ engine hooks
    def runtime(self, num_layers: int, max_positions: int | None, rope: Rope) -> HipRuntime:
        """The per-layer sparse attention and its decoding state, for a model of `num_layers` layers."""
        plans, last = self.plans(num_layers, max_positions)
        gpu_cache = (self.gpu_cache_tokens or DEFAULT_GPU_CACHE) if self.offload else None
        return HipRuntime(plans, last, self.refresh, rope, self.kernels, gpu_cache)

    def begin(self, cache, setup: Setup) -> None:
        if cache.parallel is not None and self.selection == "shared":
            # a shared selection takes the max over every KV head at each step of the halving search, inside
            # one kernel per stage: across ranks that would be a collective per halving step, not built
            raise KvpotError("infinitehip: under tensor parallelism each rank holds its own KV heads, and "
                             "selection='shared' ranks over all of them inside its search; use "
                             "selection=head (--method infinitehip:selection=head), which runs unchanged per rank.")
        max_positions = getattr(setup.config, "max_position_embeddings", None)
        cache.attention = self.runtime(len(cache.layers), max_positions, cache.rope)
        cache.host_storage = self.offload

    def before_forward(self, cache, step: Step) -> None:
        runtime = cache.attention
        runtime.decoding = step.phase == "decode"
        if not runtime.decoding:  # new tokens read: the next decoding step starts the refresh schedule
            runtime.restart()

    def decode_plan(self, cache) -> str:
        """Fixed-shape steps ("append": captured once per pattern of due stages), offloaded or not;
        eager where the RoPE has no fixed table."""
        return "append" if cache.attention.prepare_fixed(cache) else "eager"

    def decode_key(self, cache) -> tuple:
        return cache.attention.due

    def after_forward(self, cache, step: Step) -> bool:
        if step.phase == "decode":
            cache.attention.step += 1
        return False

    def report(self, cache) -> dict | None:
        return {"offload": cache.attention.offload_stats()} if self.offload else None


class HipRuntime:
    """The sparse attention a `PotCache` calls instead of dense attention, with its decoding state."""

    def __init__(self, plans: list[LayerPlan], last_keep: list[int], refresh: tuple[int, ...], rope: Rope,
                 kernels: str = "auto", gpu_cache_tokens: int | None = None):
        self.plans, self.last_keep, self.refresh, self.rope = plans, last_keep, refresh, rope
        self.kernels = kernels
        self.gpu_cache_tokens = gpu_cache_tokens  # offloading when set
        self.gpu_caches: list[GpuKvCache | None] = [None] * len(plans)
        self.masks = [MaskCache() for _ in plans]
        self.step = 0  # decoding steps taken
        self.decoding = False
        # fixed-shape decoding (`kvpot.methods.infinitehip.fixed`): the stage outputs in fixed buffers,
        # sized for `fixed_capacity` entries; the stages the next step recomputes; which path ("eager" or
        # "fixed") holds the current masks; the widest window a step attends
        self.fixed: list[FixedMasks | None] = [None] * len(plans)
        self.fixed_capacity = 0
        self.due: tuple[bool, ...] = ()
        self.latest: str | None = None
        self.width = width_bound(plans[0].window, refresh) if plans else 0
        self.bound = 0  # positions a fixed-shape step may rotate at (the RoPE table's rows)
        self.scan_bytes = 0  # offloading: bytes the stage scans asked of host memory while decoding

    def table(self, like: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The RoPE table for the Triton kernels, or None where the reference must run."""
        if self.kernels == "torch":
            return None
        from kvpot import kernels

        runnable = kernels.available(like.device) and kernels.supports_head_dim(like.shape[-1])
        table = self.rope.table(length, like) if runnable else None
        if table is None and self.kernels == "triton":
            if not kernels.available(like.device):
                reason = f"Triton kernels do not run on {like.device.type} (CUDA and Triton are needed)"
            elif not kernels.supports_head_dim(like.shape[-1]):
                reason = f"head dim {like.shape[-1]} is not one of 32, 64, 128, 256"
            else:
                reason = "this RoPE variant has no fixed table"
            raise KvpotError(f"infinitehip: kernels='triton' but {reason}; use kernels='auto' or 'torch'.")
        return table

    def clone(self) -> HipRuntime:
        twin = HipRuntime(self.plans, self.last_keep, self.refresh, self.rope, self.kernels, self.gpu_cache_tokens)
        twin.gpu_caches = [None if c is None else c.clone() for c in self.gpu_caches]
        twin.masks = [m.clone() for m in self.masks]
        twin.step, twin.decoding = self.step, self.decoding
        twin.fixed = [None if m is None else m.clone() for m in self.fixed]
        twin.fixed_capacity, twin.due, twin.latest, twin.bound = self.fixed_capacity, self.due, self.latest, self.bound
        twin.scan_bytes = self.scan_bytes
        return twin

    def restart(self) -> None:
        """Start the refresh schedule again: the next decoding step recomputes every stage."""
        self.step = 0
        self.masks = [MaskCache() for _ in self.plans]
        self.latest = None

    # ------------------------------------------------------------------ fixed-shape decoding
    def prepare_fixed(self, cache) -> bool:
        """Before a decoding step, from host counts only: False where the step must run eagerly (a
        RoPE without a fixed table). Else size the stage buffers, the RoPE table and, offloaded, the
        GPU caches' slot tables for the whole decode (no captured step allocates them), set the
        stages this step recomputes (`due`, part of its graph key), advancing the schedule, and count
        the host bytes its stage scans will ask for."""
        layer0 = cache.layers[0]
        if self.rope.dynamic:
            return False
        capacity = layer0.capacity
        if self.latest == "eager" or (capacity != self.fixed_capacity and self.step):
            self.restart()  # the current masks are the eager path's, or sized for other buffers
        if capacity != self.fixed_capacity:
            self.fixed = [FixedMasks.allocate(plan, keep, capacity, layer.kv_heads, layer.device)
                          for plan, keep, layer in zip(self.plans, self.last_keep, cache.layers)]
            self.fixed_capacity = capacity
        # positions used: up to the capacity (absolute), candidates + window (chunk-indexed), sinks +
        # selection + the widest window (streaming)
        self.bound = capacity + self.width + 2
        like = torch.empty(0, layer0.head_dim, dtype=layer0.dtype, device=layer0.device)  # (offloaded: keys on the host)
        if self.table(like, self.bound + 1) is None:
            if self.gpu_cache_tokens is not None:
                raise KvpotError(OFFLOAD_NEEDS_KERNELS)
            self.rope.table(self.bound + 1, like)  # the reference rotates from the same table
        self.due = tuple(refresh_due(self.step, self.refresh))
        recomputed = [i for i, due in enumerate(self.due) if due]
        for masks in self.masks:
            masks.recomputed.append(recomputed)
        if self.gpu_cache_tokens is not None:
            self._prepare_offload(cache, capacity)
        self.step += 1
        self.latest = "fixed"
        return True

    def _prepare_offload(self, cache, capacity: int) -> None:
        """Offloaded fixed-shape steps: each layer's GPU cache with a slot table for `capacity` entries,
        and the host bytes this step's stage scans ask for (counted here: the captured step cannot)."""
        for index, layer in enumerate(cache.layers):
            if self.gpu_caches[index] is None:
                self.gpu_caches[index] = GpuKvCache(self.gpu_cache_tokens, layer.kv_heads, layer.head_dim,
                                                    layer.dtype, layer.device)
            self.gpu_caches[index].ensure(capacity)
            if any(self.due):  # (most steps scan nothing: no per-layer count on their host path)
                row = layer.kv_heads * layer.head_dim * layer.keys.element_size()
                self.scan_bytes += fixed_scan_bytes(self.plans[index], self.last_keep[index], self.due, layer.n, row)

    def static_attention(self, layer, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         scaling: float) -> torch.Tensor:
        """A fixed-shape decoding step (`kvpot.engine.decoding`): query [1, h, 1, d] un-rotated, keys/values
        the layer's whole buffers [1, kv, capacity, d], the step's token at `layer.slot` (its position:
        nothing is evicted). Runs the stages `due` (set by `prepare_fixed`). -> [1, h, 1, d]."""
        index, bound = layer.layer_idx, self.bound

        def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            cos, sin = self.rope.cos_sin(positions, x, bound)
            return x * cos + rotate_half(x) * sin

        def step() -> torch.Tensor:
            return fixed_step(query[0], keys[0], values[0], scaling, layer.slot, self.plans[index],
                              self.last_keep[index], self.due, self.fixed[index], self.width, rotate,
                              self.table(query, bound + 1), self.gpu_caches[index]).unsqueeze(0)

        if query.device.type != "cuda":
            return step()
        with torch.cuda.device(query.device):
            return step()

    def __call__(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
        """query [1, heads, q, d] un-rotated, key/value [1, kv_heads, n, d] (keys un-rotated)."""
        if query.shape[0] != 1:
            raise KvpotError("infinitehip runs one sequence at a time (batch 1).")
        decoding = self.decoding and query.shape[2] == 1
        if query.device.type != "cuda":
            return self.attend(layer.layer_idx, query[0], key[0], value[0], scaling, decoding).unsqueeze(0)
        # Triton launches on the current CUDA device; a model split over GPUs runs this layer on its own
        with torch.cuda.device(query.device):
            return self.attend(layer.layer_idx, query[0], key[0], value[0], scaling, decoding).unsqueeze(0)

    def attend(self, index: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
               decoding: bool) -> torch.Tensor:
        """Layer `index`'s sparse attention: query [heads, q, d], keys/values [kv_heads, n, d] -> [heads, q, d].
        Decoding (q == 1) reuses the layer's mask cache on the refresh schedule at `self.step`."""
        if decoding:
            if self.latest == "fixed":  # the current masks are in the fixed buffers: start over
                self.restart()
            self.latest = "eager"
        bound = keys.shape[1] + self.plans[index].window + 2  # above every position any style uses

        def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            cos, sin = self.rope.cos_sin(positions, x, bound)
            return x * cos + rotate_half(x) * sin

        table = self.table(query, bound + 1)
        gpu_cache = None
        if self.gpu_cache_tokens is not None:
            if table is None:
                raise KvpotError(OFFLOAD_NEEDS_KERNELS)
            gpu_cache = self.gpu_caches[index]
            if gpu_cache is None:
                gpu_cache = self.gpu_caches[index] = GpuKvCache(self.gpu_cache_tokens, keys.shape[0], keys.shape[2],
                                                                keys.dtype, query.device)
            gpu_cache.ensure(keys.shape[1])
        plan, masks = self.plans[index], self.masks[index] if decoding else None
        out = sparse_attention(
            query, keys, values, scaling, plan, self.last_keep[index], rotate, masks=masks,
            due=refresh_due(self.step, self.refresh) if decoding else None, table=table, gpu_cache=gpu_cache,
        )
        if gpu_cache is not None and decoding and masks.stages:
            if masks.recomputed[-1] or len(masks.recomputed) == 1:  # a new selection: a new read set
                selection = masks.stages[-1]
                w0 = selection.window_starts[0]
                tokens, valid = used_tokens(min(plan.sink, w0), selection.starts.flatten(),
                                            selection.ends.flatten(), plan.stages[-1].chunk, w0, keys.shape[1])
                gpu_cache.touch(tokens, valid, keys, values)
            else:  # same selection and window start: only the newest key is new
                gpu_cache.touch_newest(keys.shape[1] - 1, keys, values)
            self.scan_bytes += scan_bytes(plan, masks, keys)
        return out

    def offload_stats(self) -> dict | None:
        """Decoding reads served by the GPU caches (hits, reads, hit rate) and the bytes read from host
        memory (`attention_host_bytes`: misses, read by the attention; `fetched_bytes`: the same copied
        into the GPU cache; `scan_host_bytes`: stage-scan probes; `host_bytes` their sum, and per step),
        over every layer and decoding step so far (synchronises with the device); None without offloading."""
        if self.gpu_cache_tokens is None:
            return None
        caches = [c for c in self.gpu_caches if c is not None]
        hits, used = sum(int(c.hits) for c in caches), sum(int(c.used) for c in caches)
        # a miss is read from host memory twice: by the attention, then by the copy into the GPU cache
        missed = sum((int(c.used) - int(c.hits)) * c.row_bytes for c in caches)
        return {"hits": hits, "reads": used, "hit_rate": hits / used if used else None,
                "gpu_cache_tokens": self.gpu_cache_tokens, "attention_host_bytes": missed, "fetched_bytes": missed,
                "scan_host_bytes": self.scan_bytes, "host_bytes": 2 * missed + self.scan_bytes,
                "host_bytes_per_token": (2 * missed + self.scan_bytes) / self.step if self.step else None}
