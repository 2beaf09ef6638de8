"""InfLLM (Xiao et al. 2024): the method's parameters, its hooks into the engine, its bound."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvpot.errors import KvpotError
from kvpot.methods.base import Method, Setup, Step, check_positive
from kvpot.methods.infllm.runtime import InfLLMRuntime, Sizes

log = logging.getLogger("kvpot")

# InfiniteHiP's comparison runs "InfLLM-12K": the release's 12K configuration (128 initial tokens, a
# 4,096-token local window, 64 memory units of 128 tokens looked up per 512-query chunk, 4 representative
# tokens per unit): 128 + 4,096 + 8,192 keys attended, about 12K.
RELEASE_WINDOW = 4096
RELEASE_LOOKUP = 512
DEFAULT_GPU_CACHE = 32768  # offloading: GPU-cached entries per layer, as InfiniteHiP's


@dataclass
class InfLLM(Method):
    """Training-free block memory over a sliding window (Xiao et al. 2024, InfLLM).

    Every KV entry is kept (un-rotated, `positions="hip"`). A query attends to three parts (Sec. 3.1):
    the `initial` tokens, the local `window` of the most recent tokens, and `topk` memory units looked
    up in the distant context between them. The distant context is cut into units of `block_size`
    tokens (Sec. 3.2); each unit is represented by its `representatives` tokens of highest
    representative score r_m = sum of q_t . k_m over the queries whose local window holds m (their
    `window` queries), kept per KV head (the group's query heads summed). Queries are read in chunks
    of `lookup`: a chunk looks up the units whose relevance sum_i sum_j q_i . k_j (its queries, the
    unit's representatives) is highest, one selection for a layer's heads. Positions (Sec. 3.3): the
    local window at its true distances; every initial token, memory unit and the few tokens between
    the last complete unit and the window at one shared distance, the window size. The two parts are
    attended separately and merged by their log-sum-exps, as InfiniteHiP's split attention does.

    Defaults are the release's 12K configuration, the one InfiniteHiP's comparison runs (InfLLM-12K):
    128 initial tokens, a 4,096-token window, 64 units of 128 tokens looked up per 512 queries, 4
    representatives each. `window` and `lookup` left as None take 4,096 and 512, halved together while
    window + lookup exceeds the model's trained window (logged once; explicit values are kept).

    Offloading (Sec. 3.4): `offload=True` keeps every entry in pinned host memory and a GPU cache of
    `gpu_cache_tokens` entries per layer in front of it (default 32,768), least recently used out:
    InfiniteHiP's cache (`kvpot.methods.infinitehip.offload`), token-level where the paper caches
    whole units by use frequency. Needs CUDA and Triton (the cache is filled by a Triton copy).

    Decoding runs in fixed shapes (CUDA graphs on a GPU): one Triton kernel attends to both parts
    where it can (CUDA, Triton, head dims 32-256, a RoPE with a table), else the PyTorch reference;
    a unit that completes is summarised between steps. Offloaded, decoding is eager.

    Bound: none on the cache (every entry is kept: on the GPU, or in host memory with offload); a query
    attends to at most initial + topk * block_size + block_size + window + lookup - 1 keys. With offload
    the GPU holds gpu_cache_tokens entries per layer, a representative key per unit, and 4 bytes per
    token per layer and KV head (representative scores) plus 4 per token per layer (the cache's table).
    """

    name = "infllm"
    paper = "Xiao et al. 2024, InfLLM: Training-Free Long-Context Extrapolation for LLMs with an Efficient Context Memory"
    bound = "none: every entry is kept; a query reads initial + topk*block_size + block_size + window + lookup - 1"
    chunk_dependent = True  # lookup chunks are cut from each forward's first query, and each chunk looks up its own units
    evicts_while_decoding = False  # nothing is evicted
    merges = False
    grows = True  # every entry is kept
    copies_document = "at_admission"  # its question is read in a forward of its own, which reads and evicts the cache
    positions = "hip"
    initial: int = 128
    window: int | None = None
    block_size: int = 128
    representatives: int = 4
    topk: int = 64
    lookup: int | None = None
    chunk_size: int = 2048
    kernels: str = "auto"
    offload: bool = False
    gpu_cache_tokens: int | None = None

    def __post_init__(self):
        if isinstance(self.offload, str):  # from the CLI
            self.offload = self.offload.lower() in ("1", "true", "yes")
        if not isinstance(self.initial, int) or isinstance(self.initial, bool) or self.initial < 0:
            raise KvpotError(f"infllm: initial must be an integer >= 0, got {self.initial!r}.")
        check_positive(self, "block_size", "representatives", "topk", "chunk_size")
        for name in ("window", "lookup", "gpu_cache_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise KvpotError(f"infllm: {name} must be a positive integer or None, got {value!r}.")
        if self.representatives > self.block_size:
            raise KvpotError(f"infllm: {self.representatives} representatives do not fit a unit of "
                             f"{self.block_size} tokens; use at most block_size.")
        if self.window is not None and self.lookup is not None and self.lookup > self.window:
            raise KvpotError(f"infllm: lookup ({self.lookup}) must not exceed the window ({self.window}): a "
                             "chunk's queries would otherwise attend keys the window has passed.")
        if self.kernels not in ("auto", "triton", "torch"):
            raise KvpotError(f"infllm: kernels must be 'auto', 'triton' or 'torch', not {self.kernels!r}.")
        if self.gpu_cache_tokens is not None and not self.offload:
            raise KvpotError("infllm: gpu_cache_tokens sizes the GPU cache of offloading; set offload=True too.")
        if self.offload and self.kernels == "torch":
            raise KvpotError("infllm: offload=True fills its GPU cache with a Triton copy; kernels='torch' cannot.")
        self._announced: int | None = None

    # ------------------------------------------------------------------ sizes
    def sizes(self, max_positions: int | None = None) -> Sizes:
        """Every size resolved: the short-window rule applied to a defaulted window and lookup."""
        window = RELEASE_WINDOW if self.window is None else self.window
        lookup = RELEASE_LOOKUP if self.lookup is None else self.lookup
        halvings = 0
        defaulted = self.window is None or self.lookup is None
        while defaulted and max_positions and window + lookup > max_positions and halvings < 16:
            window = window // 2 if self.window is None else window
            lookup = lookup // 2 if self.lookup is None else lookup
            window, lookup, halvings = max(window, 1), max(lookup, 1), halvings + 1
        if lookup > window:
            raise KvpotError(f"infllm: lookup ({lookup}) must not exceed the window ({window}).")
        if halvings and self._announced != max_positions:
            self._announced = max_positions
            log.warning("infllm: the model's window (%s positions) is shorter than window + lookup (%d + %d); "
                        "using window=%d, lookup=%d (defaults halved %d times; explicit values kept).",
                        max_positions, RELEASE_WINDOW, RELEASE_LOOKUP, window, lookup, halvings)
        return Sizes(self.initial, window, self.block_size, self.representatives, self.topk, lookup)

    def attended(self, max_positions: int | None = None) -> int:
        """Most keys one query attends to (the bound on the attention's working set)."""
        s = self.sizes(max_positions)
        return s.initial + s.topk * s.block + s.block + s.window + s.lookup - 1

    # ------------------------------------------------------------------ engine hooks
    def begin(self, cache, setup: Setup) -> None:
        if isinstance(cache.attention, InfLLMRuntime):  # a resumed state keeps its memory units
            return
        max_positions = getattr(setup.config, "max_position_embeddings", None)
        gpu_cache = None
        if self.offload:
            if setup.device.type != "cuda":
                raise KvpotError("infllm: offload=True keeps the entries in host memory for a GPU; on "
                                 f"{setup.device.type} they are there already: drop offload.")
            gpu_cache = self.gpu_cache_tokens or DEFAULT_GPU_CACHE
            # a lookup's keys, or the keys a forward's queries score, pass through the cache in one read
            need = 2 * max(self.attended(max_positions), self.sizes(max_positions).window + self.chunk_size - 1)
            if gpu_cache < need:
                raise KvpotError(f"infllm: gpu_cache_tokens={gpu_cache} is too small: one read takes up to "
                                 f"{need // 2} keys and the cache must hold twice that ({need}).")
        cache.attention = InfLLMRuntime(self.sizes(max_positions), cache.rope, self.kernels, gpu_cache)
        cache.attention.parallel = cache.parallel  # a lookup's scores sum over every rank's heads
        cache.host_storage = self.offload

    def after_forward(self, cache, step: Step) -> bool:
        return False

    def decode_plan(self, cache) -> str:
        """Fixed-shape steps ("append": one captured graph serves every length), except offloaded."""
        return "append" if cache.attention.prepare_fixed(cache) else "eager"

    def report(self, cache) -> dict | None:
        return cache.attention.report()
