"""InfLLM's attention as a `PotCache` runs it: chunks of queries, their lookups, decoding steps.

`PotCache.attention` is an `InfLLMRuntime` (the same seat InfiniteHiP's runtime takes): every layer's
attention comes here with the forward's un-rotated queries and the layer's un-rotated keys (policy
"hip"). A forward of q queries (`__call__`):

1. adds its queries' share to the representative scores of the keys they see (`memory.add_scores`);
2. cuts its queries into lookup chunks of `lookup` (from the forward's first query); each chunk c has
   its window start w0 = max(0, c - window + 1): the window w0 .. c + lookup - 1 (its later queries see
   up to window + lookup - 1 keys at true distances), its initial tokens, its complete units;
3. summarises the units complete for its last chunk (`Memory.form`), scores them against each chunk's
   summed queries and takes each chunk's `topk` (`memory.relevance`);
4. gathers each chunk's distant keys (initial, selected units, remainder) and window, and attends
   (`attend.two_part_attention`); chunks with equal shapes go together (with `lookup` a multiple of the
   unit size, every full chunk past the first window has the same shape).

A forward of one query (decoding, or a one-token segment) takes the fixed-shape step (`decode`), as
do the decoding steps the engine captures (`static_attention`).

Offloaded (keys in pinned host memory), every read goes through InfiniteHiP's GPU cache
(`GpuKvCache.touch`: hits stay on the GPU, misses are copied in, least recently used out), and unit
summaries read their keys with a direct copy (`kvpot.kernels.hip.fetch`), leaving the cache alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpot.errors import KvpotError
from kvpot.methods.infinitehip.offload import GpuKvCache
from kvpot.methods.infllm import decode
from kvpot.methods.infllm.attend import two_part_attention
from kvpot.methods.infllm.memory import SCORE, Memory, add_scores, relevance, unit_count
from kvpot.methods.infllm.turn import Turner
from kvpot.rope import Rope


@dataclass(frozen=True)
class Sizes:
    initial: int
    window: int
    block: int
    reps: int
    topk: int
    lookup: int


def device_ints(values: list[int], device: torch.device) -> torch.Tensor:
    """A small long tensor on `device` without waiting for it: a copy from pageable memory would
    synchronise the stream, and with it the host, at every layer of every forward. An arithmetic run
    (the usual case: consecutive lookup chunks) is made on the device."""
    run = arithmetic(values)
    if run is not None:
        return run[0] + run[1] * torch.arange(len(values), device=device)
    host = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def arithmetic(values: list[int]) -> tuple[int, int] | None:
    """(first, step) when `values` is an arithmetic run (one value: step 0), else None."""
    step = values[1] - values[0] if len(values) > 1 else 0
    if any(b - a != step for a, b in zip(values, values[1:])):
        return None
    return values[0], step


class InfLLMRuntime:
    """The attention a `PotCache` calls instead of dense attention, with each layer's memory units."""

    def __init__(self, sizes: Sizes, rope: Rope, kernels: str = "auto", gpu_cache_tokens: int | None = None):
        self.sizes, self.rope, self.kernels = sizes, rope, kernels
        self.gpu_cache_tokens = gpu_cache_tokens
        self.memories: dict[int, Memory] = {}
        self.gpu_caches: dict[int, GpuKvCache] = {}
        self.max_attended = 0  # most keys one query attended to (host-side counts: not fixed-shape steps)
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # RoPE tables (`Turner`)
        # tensor parallelism (kvpot.models.parallel): a lookup ranks units by a sum over the model's KV heads, so each
        # rank's partial sum over its own heads is summed over the ranks (all-reduce) before the top-k
        self.parallel = None

    def clone(self) -> InfLLMRuntime:
        twin = InfLLMRuntime(self.sizes, self.rope, self.kernels, self.gpu_cache_tokens)
        twin.memories = {i: m.clone() for i, m in self.memories.items()}
        twin.gpu_caches = {i: c.clone() for i, c in self.gpu_caches.items()}
        twin.max_attended = self.max_attended
        twin.parallel = self.parallel
        return twin

    def memory(self, index: int) -> Memory:
        return self.memories.setdefault(index, Memory())

    # ------------------------------------------------------------------ rotations
    def rotator(self, like: torch.Tensor, queries: int = 1) -> Turner:
        """RoPE at the positions this method uses for a forward of `queries` queries: at most the window +
        the larger of a lookup and the forward (its representative scores)."""
        return Turner(self.rope, like, self.sizes.window + max(self.sizes.lookup, queries) + 1, self._tables)

    def far_turn(self, query: torch.Tensor, rotate: Turner) -> torch.Tensor:
        """Queries [..., d] rotated at the shared distant position (the window size), times the keys'
        rotation at 0 (cos(0), the RoPE's scaling; sin(0) = 0), so that keys enter un-rotated."""
        return rotate.at(query, self.sizes.window) * rotate.cos0(query.dtype)

    # ------------------------------------------------------------------ reading entries
    def reader(self, index: int, keys: torch.Tensor, values: torch.Tensor, device: torch.device):
        """read(tokens [c, L], valid [c, L] or None: all) -> keys, values [c, kv, L, d] on `device`."""
        n = keys.shape[1]
        if keys.device == device:
            heads = torch.arange(keys.shape[0], device=device).view(1, -1, 1)

            def read(tokens, valid=None):  # one gather straight into [c, kv, L, d]
                at = tokens.clamp(0, n - 1).unsqueeze(1)
                return keys[heads, at], values[heads, at]

            return read
        cache = self.gpu_cache(index, keys, device)

        def read_through(tokens, valid=None):
            rows_k, rows_v = [], []
            valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid
            for row, ok in zip(tokens, valid):  # one touch per row: a row's tokens are distinct
                cache.touch(row, ok, keys, values)
                slot = cache.slot_of[row.clamp(0, n - 1)].long().clamp(min=0)
                rows_k.append(cache.keys[:, slot])
                rows_v.append(cache.values[:, slot])
            return torch.stack(rows_k), torch.stack(rows_v)

        return read_through

    def gpu_cache(self, index: int, keys: torch.Tensor, device: torch.device) -> GpuKvCache:
        if self.gpu_cache_tokens is None:
            raise KvpotError("infllm: this layer's entries are in host memory but offload is off.")
        cache = self.gpu_caches.get(index)
        if cache is None:
            cache = self.gpu_caches[index] = GpuKvCache(self.gpu_cache_tokens, keys.shape[0], keys.shape[2],
                                                        keys.dtype, device)
        cache.ensure(keys.shape[1])
        return cache

    @staticmethod
    def window_reader(keys: torch.Tensor, values: torch.Tensor, device: torch.device):
        """windows(first, step, count, width) -> keys, values [count, kv, width, d]: the windows of `width`
        tokens starting at first + i * step, as strided views of the buffers (no copy); None when the
        entries are elsewhere (offloaded: they go through the GPU cache)."""
        if keys.device != device:
            return None

        def windows(first: int, step: int, count: int, width: int):
            def view(buf):
                heads, tokens, dims = buf.stride()
                return buf.as_strided((count, buf.shape[0], width, buf.shape[2]), (step * tokens, heads, tokens, dims),
                                      buf.storage_offset() + first * tokens)

            return view(keys), view(values)

        return windows

    def block_reader(self, keys: torch.Tensor, values: torch.Tensor, device: torch.device):
        """read_block(start, stop) -> keys [kv, stop - start, d] on `device`, bypassing the GPU cache."""
        if keys.device == device:
            return lambda start, stop: keys[:, start:stop]

        def fetch(start: int, stop: int) -> torch.Tensor:
            from kvpot.kernels.hip import fetch as copy_rows

            kv, _, d = keys.shape
            out_k = torch.empty(kv, stop - start, d, dtype=keys.dtype, device=device)
            out_v = torch.empty_like(out_k)
            tokens = torch.arange(start, stop, device=device)
            copy_rows(keys, values, out_k, out_v, tokens, torch.arange(stop - start, device=device))
            return out_k

        return fetch

    # ------------------------------------------------------------------ a forward
    def __call__(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
        """query [1, heads, q, d] un-rotated, key/value [1, kv_heads, n, d] un-rotated -> [1, heads, q, d]."""
        if query.shape[0] != 1:
            raise KvpotError("infllm runs one sequence at a time (batch 1).")
        if query.device.type == "cuda":  # kernels launch on the current device: a split model's layer has its own
            with torch.cuda.device(query.device):
                return self._forward(layer, query[0], key[0], value[0], scaling).unsqueeze(0)
        return self._forward(layer, query[0], key[0], value[0], scaling).unsqueeze(0)

    def _forward(self, layer, query, keys, values, scaling) -> torch.Tensor:
        s, index = self.sizes, layer.layer_idx
        h, q, d = query.shape
        n = keys.shape[1]
        rotate = self.rotator(query, q)
        score = layer.score(SCORE)[0]  # [kv, n]
        if q == 1:
            t = torch.full((1,), n - 1, dtype=torch.long, device=query.device)
            self.form_for(layer, keys, values, n - 1)
            self.max_attended = max(self.max_attended, self._attended(n - 1, n - 1))
            return self.step(index, query[:, 0], keys, values, score, t, scaling, rotate, eager=True).unsqueeze(1)
        first = n - q
        start = max(0, first - s.window + 1)
        read = self.reader(index, keys, values, query.device)
        if keys.device == query.device:
            seen = keys[:, start:n]
        else:
            tokens = torch.arange(start, n, device=query.device).view(1, -1)
            seen = read(tokens)[0][0]
        add_scores(score, seen, query, start, s.window, rotate)
        chunks = [(c, min(s.lookup, n - c)) for c in range(first, n, s.lookup)]
        memory = self.form_for(layer, keys, values, chunks[-1][0])
        out = torch.empty_like(query)
        groups: dict[tuple, list[int]] = {}
        for c, rows in chunks:
            w0 = max(0, c - s.window + 1)
            units = unit_count(w0, s.initial, s.block)
            rest = s.initial + units * s.block if w0 > s.initial else w0
            shape = (min(s.initial, w0), min(s.topk, units), w0 - rest, c + rows - w0, rows)
            groups.setdefault(shape, []).append(c)
            self.max_attended = max(self.max_attended, self._attended(c, c + rows - 1))
        windows = self.window_reader(keys, values, query.device)
        for shape, starts in groups.items():
            self._lookup(query, out, first, starts, shape, memory, read, scaling, rotate, windows)
        return out

    def _attended(self, c: int, t: int) -> int:
        """Keys query t of a chunk starting at c attends to (initial + selected units + remainder + window)."""
        s = self.sizes
        w0 = max(0, c - s.window + 1)
        units = unit_count(w0, s.initial, s.block)
        rest = s.initial + units * s.block if w0 > s.initial else w0
        return min(s.initial, w0) + min(s.topk, units) * s.block + (w0 - rest) + (t - w0 + 1)

    def form_for(self, layer, keys, values, c: int) -> Memory:
        """Summarise the units complete for a chunk (or a query) starting at position c."""
        s = self.sizes
        memory = self.memory(layer.layer_idx)
        units = unit_count(max(0, c - s.window + 1), s.initial, s.block)
        if units > memory.formed:
            score = layer.score(SCORE)[0]
            memory.form(units, score, self.block_reader(keys, values, score.device), s.initial, s.block, s.reps)
        return memory

    def _lookup(self, query, out, first, starts, shape, memory, read, scaling, rotate, windows=None) -> None:
        """Attention of the lookup chunks beginning at `starts` (all of one shape) into `out` [h, q, d].

        Consecutive chunks (the usual group) are sliced from the forward's queries and written back as one
        slice, and their windows are read as strided views of the layer's buffers (`windows`, when on the
        device): no gather of the window, the rotation reads it in place. Other groups, and offloaded
        entries, go through index tensors; both give the same tensors, element by element."""
        s = self.sizes
        initial, top, rest_len, width, rows = shape
        h, _, d = query.shape
        kv = memory.summaries.shape[1] if memory.summaries is not None else None
        device, c = query.device, len(starts)
        run = arithmetic([b - first for b in starts])  # (first row, step): the rows are one slice if step == rows
        if run is not None and (c == 1 or run[1] == rows):
            rows_at = slice(run[0], run[0] + c * rows)
            chunk_q = query[:, rows_at].unflatten(1, (c, rows)).contiguous().transpose(0, 1)  # [c, h, rows, d]
        else:
            begin = device_ints([b - first for b in starts], device)  # each chunk's first row in this forward
            rows_at = begin.view(-1, 1) + torch.arange(rows, device=device)  # [c, rows]
            chunk_q = query[:, rows_at].transpose(0, 1)
        starts_w0 = [max(0, b - s.window + 1) for b in starts]
        w0 = device_ints(starts_w0, device)
        far_q = self.far_turn(chunk_q, rotate)
        parts = [torch.arange(initial, device=device).expand(c, -1)]
        if top:
            summed = far_q.float().view(c, kv, h // kv, rows, d).sum((2, 3))  # [c, kv, d]
            units = device_ints([unit_count(w, s.initial, s.block) for w in starts_w0], device)
            scores = self._all_ranks(relevance(summed, memory.summaries[: memory.formed], units))
            chosen = scores.topk(top, dim=-1).indices.sort(dim=-1).values  # [c, top]
            lane = torch.arange(s.block, device=device)
            parts.append((s.initial + chosen.unsqueeze(-1) * s.block + lane).flatten(1))
        parts.append(w0.view(-1, 1) - rest_len + torch.arange(rest_len, device=device))
        far_k, far_v = read(torch.cat(parts, dim=1))
        span = arithmetic(starts_w0)
        if windows is not None and span is not None:
            view_k, view_v = windows(span[0], span[1], c, width)  # [c, kv, width, d], strided, overlapping
            near_k = rotate.span(view_k, 0, out=torch.empty(view_k.shape, dtype=view_k.dtype, device=device))
            near_v = view_v.contiguous()
        else:
            near_k, near_v = read(w0.view(-1, 1) + torch.arange(width, device=device))
            near_k = rotate.span(near_k, 0)
        near_q = rotate.span(chunk_q, width - rows)
        result = two_part_attention(far_q, far_k, far_v, near_q, near_k, near_v, scaling)  # [c, h, rows, d]
        if isinstance(rows_at, slice):
            out[:, rows_at].unflatten(1, (c, rows)).copy_(result.transpose(0, 1))
        else:
            out[:, rows_at] = result.transpose(0, 1)

    # ------------------------------------------------------------------ one query, fixed shapes
    def step(self, index, query, keys, values, score, t, scaling, rotate, eager: bool) -> torch.Tensor:
        """query [h, d] at position t (a device tensor [1]) over keys/values [kv, N, d] -> [h, d]. The
        units complete for it must be summarised already (`form_for`)."""
        s = self.sizes
        selected = self._select(self.memory(index), query, keys.shape[0], rotate)
        kernel = self._kernel(query, keys)
        offloaded = keys.device != query.device
        if offloaded and kernel is None:
            raise KvpotError("infllm: offloaded decoding reads host memory from a Triton kernel; it needs CUDA "
                             "and Triton, head dims 32-256 and a RoPE with a fixed table.")
        cached = self.gpu_cache(index, keys, query.device) if offloaded else None
        if kernel is None:
            c = decode.counts(t, s.initial, s.window, s.block)
            far_turn = self.far_turn(query, rotate)  # [h, d]
            out = decode.step_reference(query, keys, values, score, c, selected, s, scaling, rotate, far_turn)
        else:
            out = kernel(query, keys, values, score, t, selected, s, scaling, *self.table(query), gpu_cache=cached)
        if cached is not None and eager:
            c = decode.counts(t, s.initial, s.window, s.block)
            far, far_ok, near, near_ok = decode.read_set(c, selected, s.initial, s.window, s.block)
            cached.touch(torch.cat([far, near]), torch.cat([far_ok, near_ok]), keys, values)
        return out

    def _select(self, memory: Memory, query: torch.Tensor, kv: int, rotate: Turner) -> torch.Tensor:
        """A step's `topk` units: its query summed over each group's heads and rotated at the distant
        position once (rotation is linear: the sum of the turned heads), against every summary plus its
        bias (one matrix-vector product: units not summarised get -inf, and the kernel masks any pick that
        is not complete). (As one [kv, group * d] x [group * d, d] product with a rotation matrix instead,
        cuBLAS ran one thread block for 54 us a layer on an H100: 1.7 ms of the 8B step at 128K.)"""
        top = min(self.sizes.topk, memory.capacity)
        if top == 0:
            return torch.zeros(0, dtype=torch.long, device=query.device)
        h, d = query.shape
        summed = self.far_turn(query.float().view(kv, h // kv, d).sum(dim=1), rotate)  # [kv, d]
        scores = torch.addmv(memory.bias, memory.summaries.view(memory.capacity + 1, -1), summed.view(-1))
        return self._all_ranks(scores).topk(top).indices

    def _all_ranks(self, scores: torch.Tensor) -> torch.Tensor:
        """Unit scores summed over every rank's KV heads (tensor parallelism; as they are on one process). The
        sum is the one-process sum regrouped, so a near-tie may round the other way; a bias of -inf (a unit not
        complete) stays -inf."""
        return scores if self.parallel is None else self.parallel.all_reduce(scores)

    def table(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope.table(self.sizes.window + self.sizes.lookup + 1, like)

    def _kernel(self, query: torch.Tensor, keys: torch.Tensor):
        """The Triton step where it runs (see `InfLLM.kernels`), else None (the PyTorch reference)."""
        if self.kernels == "torch":
            return None
        from kvpot import kernels

        runs = (kernels.available(query.device) and kernels.supports_head_dim(query.shape[-1])
                and not self.rope.dynamic)
        if not runs:
            if self.kernels == "triton":
                raise KvpotError("infllm: kernels='triton' but the Triton kernel cannot run here (it needs CUDA and "
                                 "Triton, head dims 32-256 and a RoPE with a fixed table); use 'auto' or 'torch'.")
            return None
        from kvpot.kernels.infllm import decode_step

        return decode_step

    # ------------------------------------------------------------------ fixed-shape decoding
    def prepare_fixed(self, cache) -> bool:
        """Before a decoding step (host counts only): summarise the units complete for it, size the
        summaries for the whole decode and size the RoPE table, so a captured step never reallocates
        them. False when offloaded (those steps run eagerly, the GPU cache updated after each)."""
        layer0 = cache.layers[0]
        if layer0.keys.device != layer0.device or self.rope.dynamic:
            return False
        s = self.sizes
        t = layer0.n  # the position of the token the step appends
        for layer in cache.layers:
            memory = self.memory(layer.layer_idx)
            keys = layer.keys[0]
            memory.reserve(unit_count(layer.capacity, s.initial, s.block) + 1, keys.shape[0], keys.shape[2],
                           keys.device)
            self.form_for(layer, keys, layer.values[0], t)
        self.table(layer0.keys)  # sized now: no step grows it (the distant rotation's matrix is built by
        return True  # the first step, which the decoding loop always runs uncaptured before a capture)

    def static_attention(self, layer, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         scaling: float) -> torch.Tensor:
        """A fixed-shape decoding step: query [1, h, 1, d] un-rotated, keys/values the layer's whole
        buffers [1, kv, capacity, d]; the step's token is at `layer.slot` on the device. -> [1, h, 1, d]."""
        q = query[0, :, 0]
        score = layer.scores[SCORE][0]  # [kv, capacity]: the whole buffer (the host count is a mirror)
        out = self.step(layer.layer_idx, q, keys[0], values[0], score, layer.slot, scaling, self.rotator(q),
                        eager=False)
        return out.view(1, -1, 1, out.shape[-1])

    def report(self) -> dict | None:
        caches = list(self.gpu_caches.values())
        result = {"units": max((m.formed for m in self.memories.values()), default=0),
                  "max_attended": self.max_attended}
        if self.gpu_cache_tokens is not None:
            hits, used = sum(int(c.hits) for c in caches), sum(int(c.used) for c in caches)
            result["offload"] = {"hits": hits, "reads": used, "hit_rate": hits / used if used else None,
                                 "gpu_cache_tokens": self.gpu_cache_tokens}
        return result
