"""The mixed step in fixed shapes: decoding rows and prompt chunks in one forward that a CUDA graph replays.

The eager mixed step (`kvpot.engine.mixed.mixed_forward`) makes ~4,300-4,500 torch calls a step on an 8B shape at
1,024 prompt tokens, for ~40-50 ms of device work, so its wall time follows the host (docs/design.md, *The batched
step*). Here the step has fixed shapes for a key `(decoding bucket, token bucket, observes, decode observation,
picking mode)`, so the same body is captured once and replayed (`StepGraphs`, as `BatchDecoder` does):

- the host packs what varies into one int64 upload a step (`Meta`): each chunk token's id, slot, entry offset,
  row and stream position; each row's slot, bounds, per-layer cached count, and observed rows. Tokens past the
  real ones pad the bucket and write the pool's scratch slot;
- each layer appends every chunk token in one indexed write (`PackedLayer.update`), attends the chunks in one
  varlen launch over their slots, and writes the observations the rows asked for in one more
  (`kvpot.kernels.observe.observe_varlen`); the decoding rows go through `StepCache` as in `BatchDecoder`;
- after the replay the host mirrors the counts, rolls back tail probes, and runs each chunk's method hooks
  (`Engine._after_forward`: logits, NuC, compression) eagerly, as the eager mixed step does.

`PackedStep.takes` says which steps it runs; the others take the eager mixed step: a method's own attention or
`before_forward` (not `mixable`), CItruS' instruction cache, positions other than `absolute` or ranked ones, RoPE
without a table, an observation other than `head_reduce="mean"` over every key, more than `ROWS` chunks (or more
observing chunks than `OBSERVED_BYTES` holds rows for), more tokens than the buckets captured ahead (`capture`), and
tensor parallelism. On a CPU the body runs uncaptured, with the kernels' PyTorch references, and gives
the eager step's tokens; it is off there (`BatchDecoder.fixed_mix`), since padding buys nothing uncaptured.

The cache the model is handed, its layers and the step's device inputs are in `kvpot.engine.packed_cache`.
"""

from __future__ import annotations

import functools

import torch

from kvpot.attention import AttentionRequest
from kvpot.compat import cache_kwargs
from kvpot.engine.graphs import StepGraphs
from kvpot.engine.packed_cache import ROWS, Meta, PackedCache
from kvpot.engine.pool import SlotLayer
from kvpot.positions import Rank

GRAIN = 256  # token buckets: 64, 128, 256, then multiples of this
# A packed step's decoding rows pad to at least this many (or the pool's size): a padding row costs a step of a
# thousand prompt tokens little (one more row in the products, a scratch slot's entry to attend), while every
# batch size is one more key to warm and capture (an open loop of 60 s met ~60 keys at per-size buckets)
ROWS_FLOOR = 64
# The packed observations' buffer ([layers, rows, kv heads, capacity] float32) at most this: a slot of 128K entries on
# an 8B shape takes 134 MB a row. Observing chunks go first in a step; a step with more than fit takes the eager step.
OBSERVED_BYTES = 256 << 20
# Ranked positions store keys un-rotated, and the varlen kernel rotates each key in every tile that reads it: on an
# H200 that cost 25-27% of the kernel at the 8B shapes (records/engine-core-h200/packed/, `varlen_sweep.py --forms`).
# With this on, each chunk row's keys are rotated once a layer into a buffer of `[ROWS, kv heads, capacity, d]` (at
# most ROW_KEYS_BYTES) that both kernels read (`kvpot.kernels.varlen.rotate_rows`). A 16K read through the scheduler
# (1,024 tokens a step beside 32 decoding rows, an H200): the varlen kernel 196 -> 158 ms, the rotation pass 4.8 ms,
# the read's device time 818 -> 786 ms (`prefill_ops.py`, `--rotate-on-load` for the other side;
# records/engine-core-h200/packed-2/).
ROTATE_AHEAD = True
ROW_KEYS_BYTES = 256 << 20
# With `Engine(compile_step=True)`, run the packed step's decoder layers through the compiled layer
# (`Engine.step_decoder`, `kvpot.engine.regions`) as the decoding step does: a third of a 1,024-token step's device
# time is small kernels (RMSNorm, transformers' RoPE at position 0, SiLU, adds, copies) that only compilation fuses.
# The chunks' writes and attention stay eager inside it (`PackedCache._attend_chunks`). On an H200, issue 43's open
# loop at 1,024 prompt tokens a step: the mixed step's p50 51 -> 45 ms, ITL p99 68.4 -> 61.1-61.7 ms, TTFT p50
# 2.51 -> 2.01-2.16 s (records/engine-core-h200/packed-3/). Without `compile_step` this changes nothing.
COMPILED = True


def token_bucket(tokens: int) -> int:
    """The packed chunk tokens a step of `tokens` pads to."""
    for size in (64, 128, GRAIN):
        if tokens <= size:
            return size
    return -(-tokens // GRAIN) * GRAIN


def observable(request: AttentionRequest | None) -> bool:
    """Whether `observe_varlen` computes `request`: every key's probability averaged over each group's heads."""
    return request is None or (request.head_reduce == "mean" and request.over == "all" and request.keys is None)


def _asked(probe) -> AttentionRequest | None:
    """What a chunk's (tail probe, request) asks to observe: the probe's request, or the forward's."""
    tail, request = probe
    return tail[1] if tail is not None else request


class PackedStep:
    """Fixed-shape mixed steps over a `BatchDecoder`'s pool, captured per key on a GPU (`StepGraphs`)."""

    def __init__(self, decoder):
        self.decoder, self.pool, self.engine = decoder, decoder.pool, decoder.engine
        self.graphs = StepGraphs()
        self.meta: Meta | None = None
        self.cache: PackedCache | None = None
        self.hidden: torch.Tensor | None = None  # [T, hidden]: the chunk tokens' last hidden states
        self.zeros: torch.Tensor | None = None  # position_ids: RoPE is kvpot's
        self.observed: torch.Tensor | None = None
        self.max_position = 0
        self.steps = 0
        self.ahead: int | None = None  # the largest token bucket captured ahead (`capture`), None before
        self.rotated_keys: torch.Tensor | None = None  # `_row_keys`' buffer, kept across the meta's growth

    # ------------------------------------------------------------------ what it takes
    def takes(self, chunks, probes) -> bool:
        """Whether this step's chunks (`kvpot.engine.mixed.Chunk`) with their (tail, request) `probes` fit a
        packed step (the module's docstring lists what does not)."""
        pool = self.pool
        if not chunks or len(chunks) > ROWS or not self.usable:
            return False
        if self.ahead is not None:  # past the buckets captured ahead: growing the buffers would drop every graph
            tails = sum(0 if tail is None else torch.as_tensor(tail[0]).numel() for tail, _ in probes)
            if token_bucket(sum(chunk.ids.numel() for chunk in chunks) + tails) > self.ahead:
                return False
        if sum(_asked(probe) is not None for probe in probes) > self.observing_rows:
            return False
        for chunk, probe in zip(chunks, probes):
            cache = chunk.run.cache
            if cache.static or cache.attention is not None or not all(
                    isinstance(layer, SlotLayer) and layer.storage is store
                    for layer, store in zip(cache.layers, pool.layers)):
                return False
            if not observable(_asked(probe)):
                return False
        return True

    @property
    def usable(self) -> bool:
        """Whether any step of this pool can be packed: not under tensor parallelism, with dynamic RoPE, or with
        positions other than absolute and ranked ones. Readers of shared documents pack: their rows attend through
        `StepCache.attend` (the cascade kernel, groups made again each step by `begin_rows`), and their chunks
        (riders) copied their document first (`copy_before_step`)."""
        pool, policy = self.pool, self.pool.policy
        if self.engine.parallel is not None or pool.rope.dynamic or policy.raw_keys:
            return False
        return policy.stores_rotated or isinstance(policy, Rank)

    @property
    def observing_rows(self) -> int:
        """Chunks of one step that may observe (the observation buffer's rows, within `OBSERVED_BYTES`)."""
        like = self.pool.layers[0]
        return max(1, min(ROWS, OBSERVED_BYTES // (4 * self.pool.num_layers * like.kv_heads * like.capacity)))

    def _observed_buffer(self) -> None:
        if self.observed is None:
            like = self.pool.layers[0]
            self.observed = torch.zeros(self.pool.num_layers, self.observing_rows, like.kv_heads, like.capacity,
                                        dtype=torch.float32, device=self.pool.device)

    @property
    def rows_floor(self) -> int:
        """The decoding rows a packed step pads to at least (`BatchDecoder.load_rows`' floor)."""
        return min(self.pool.slots, ROWS_FLOOR)

    def capture(self, max_tokens: int, observes: bool) -> int:
        """Warm and capture now the packed step of every token bucket up to `max_tokens` (greedy, no decoding
        observation; with and without chunk observations if `observes`), on padding rows and tokens alone (the
        scratch slot), as `BatchDecoder.capture` does for decoding: otherwise the first steps of each key warm
        and capture while users wait. Returns the graphs captured (0 on a CPU)."""
        if not self.decoder.graphs_on or not self.usable:
            return 0
        before = self.graphs.captures
        batch = self.decoder.load_rows([], [], self.rows_floor)
        sizes = sorted({token_bucket(n) for n in range(1, max_tokens + 1, 64)} | {token_bucket(max_tokens)},
                       reverse=True)  # the largest first: the buffers are made once, at their final size
        for tokens in sizes:
            self._pad(tokens, observes)
            for observed in (False, True) if observes else (False,):
                key = (batch, tokens, observed, False, "greedy")
                while key not in self.graphs:  # warm, then capture (again if a buffer moved meanwhile)
                    self._follow()
                    self.graphs.run(key, functools.partial(self._body, batch, tokens, observed, None, "greedy"))
        self.ahead = sizes[0]
        return self.graphs.captures - before

    def _pad(self, tokens: int, observes: bool) -> None:
        """Device inputs of a step of `tokens` padding tokens and no rows (what `capture` runs)."""
        self._size(tokens)
        if observes:
            self._observed_buffer()
        host = self.meta.host()
        host.slot[:], host.token_row[:], host.row_slot[:] = self.pool.scratch, ROWS, self.pool.scratch
        self.meta.buffer.copy_(host.buffer, non_blocking=True)

    # ------------------------------------------------------------------ the step
    def run(self, batch: int, observe: AttentionRequest | None, mode: str, chunks, probes) -> list:
        """One forward: `batch` decoding rows (already in the decoder's row buffers, padded to their bucket) and
        `chunks` packed after them. Returns, per chunk, (its hidden states [q, hidden], its tail probe's
        observation per layer or None); each chunk's counts are mirrored and its probe rolled back."""
        order = sorted(range(len(chunks)), key=lambda i: _asked(probes[i]) is None)  # observing rows first
        done = self._run([chunks[i] for i in order], [probes[i] for i in order], batch, observe, mode)
        return [done[order.index(i)] for i in range(len(chunks))]

    def _run(self, chunks, probes, batch: int, observe: AttentionRequest | None, mode: str) -> list:
        parts, spans, total = [], [], 0
        for chunk, (tail, _) in zip(chunks, probes):
            tail_ids = tail[0] if tail is not None else None
            size = chunk.ids.numel() + (0 if tail_ids is None else torch.as_tensor(tail_ids).numel())
            spans.append((total, size))
            parts.append(tail_ids)
            total += size
        tokens = token_bucket(total)
        self._size(tokens)
        meta, host = self.meta, self.meta.host()
        late = []  # ids already on the device: copied there after the upload
        for r, (chunk, tail_ids, (start, size)) in enumerate(zip(chunks, parts, spans)):
            run, q = chunk.run, chunk.ids.numel()
            rows = slice(start, start + size)
            for ids, at in ((chunk.ids, slice(start, start + q)), (tail_ids, slice(start + q, start + size))):
                if ids is None:
                    continue
                ids = torch.as_tensor(ids).view(-1)
                if ids.device.type == "cpu":
                    host.ids[at] = ids
                else:
                    late.append((at, ids))
            host.slot[rows] = run.cache.layers[0].row
            host.offset[rows] = torch.arange(size)
            host.token_row[rows] = r
            host.position[rows] = torch.arange(run.next_position, run.next_position + size)
            host.row_slot[r], host.starts[r + 1] = run.cache.layers[0].row, start + size
            host.cached[:, r] = torch.tensor(run.cache.lengths())
            asked = _asked(probes[r])
            if asked is not None:
                first, stop, _ = slice(*(asked.rows or (None, None))).indices(size)
                host.row0[r], host.count[r], host.mean[r] = first, max(stop - first, 0), asked.row_reduce == "mean"
            for layer, n in zip(run.cache.layers, run.cache.lengths()):
                layer.reserve(n + size)
            self.max_position = max(self.max_position, run.next_position + size)
        scratch = self.pool.scratch
        host.slot[total:] = scratch
        host.token_row[total:] = ROWS  # `cached`'s last column: 0, so padding tokens write scratch's first entries
        host.row_slot[len(chunks):] = scratch
        host.starts[len(chunks) + 1 :] = total
        meta.buffer.copy_(host.buffer, non_blocking=True)  # pageable: staged before the call returns
        for at, ids in late:
            meta.ids[at].copy_(ids)
        observes = bool(host.count.any())
        if observes:
            self._observed_buffer()
        self._follow()
        key = (batch, tokens, observes, observe is not None, mode)
        body = functools.partial(self._body, batch, tokens, observes, observe, mode)
        if self.decoder.graphs_on:
            self.graphs.run(key, body)
        else:
            body()
        self.steps += 1
        return self._mirror(chunks, probes, spans)

    def _mirror(self, chunks, probes, spans) -> list:
        """The host's counts after the device appended each chunk's tokens; the observations; probes rolled back."""
        done = []
        for r, (chunk, (tail, request), (start, size)) in enumerate(zip(chunks, probes, spans)):
            cache, q = chunk.run.cache, chunk.ids.numel()
            before = cache.lengths()
            last = chunk.run.next_position + size - 1  # the part's last stream position
            for layer in cache.layers:
                layer.mirror_append(size, last)
            cache.note_entries(max(cache.lengths()))
            observed = None
            if tail is not None:  # the probe's attention over what it may score (read at once by the method)
                observed = [self.observed[i, r : r + 1, :, : n + q] for i, n in enumerate(before)]
                cache.truncate([n + q for n in before])
            elif request is not None:  # kept by the method's layers: a copy, the buffer is the next step's
                for i, (layer, n) in enumerate(zip(cache.layers, before)):
                    layer.observation = self.observed[i, r : r + 1, :, : n + size].clone()
            done.append((self.hidden[start : start + q], observed))
        return done

    def _body(self, batch: int, tokens: int, observes: bool, observe: AttentionRequest | None, mode: str) -> None:
        """The step in fixed shapes (what a graph captures): reads the decoder's row buffers and `meta`."""
        decoder, engine, cache = self.decoder, self.engine, self.cache
        cache.batch, cache.tokens, cache.observes = batch, tokens, observes
        cache.max_position, cache.observed = self.max_position, self.observed
        ids = self.meta.ids[:tokens]
        nll = None
        if batch:
            rows_ids, nll = decoder.begin_rows(batch, observe)
            ids = torch.cat([rows_ids, ids])
        model = engine.step_decoder() if COMPILED else engine.decoder
        out = model(input_ids=ids.view(1, -1), position_ids=self.zeros[:, : batch + tokens], use_cache=True,
                    kvpot_cache=cache, **cache_kwargs(engine.decoder, cache))
        hidden = out.last_hidden_state[0]
        self.hidden[:tokens].copy_(hidden[batch:])
        if batch:
            decoder.end_rows(batch, engine.head(hidden[:batch]).float(), mode, nll)

    # ------------------------------------------------------------------ buffers
    def _size(self, tokens: int) -> None:
        """Buffers for `tokens` packed chunk tokens (grown by doubling; the graphs follow, `_follow`)."""
        if self.meta is not None and self.meta.tokens >= tokens:
            return
        device, size = self.pool.device, max(tokens, 2 * (self.meta.tokens if self.meta else 0))
        self.meta = Meta(size, self.pool.num_layers, device)
        self.cache = PackedCache(self.decoder.cache, self.meta)
        hidden = self.engine.head.weight.shape[1]
        self.hidden = torch.zeros(size, hidden, dtype=self.engine.head.weight.dtype, device=device)
        self.zeros = torch.zeros(1, self.decoder.pool.slots + size, dtype=torch.long, device=device)
        self.cache.row_keys = self._row_keys()

    def _row_keys(self) -> torch.Tensor | None:
        """The buffer of keys rotated ahead (`ROTATE_AHEAD`), where it applies: ranked positions, the Triton
        kernels, within `ROW_KEYS_BYTES`."""
        from kvpot import kernels

        like = self.pool.layers[0]
        size = ROWS * like.kv_heads * like.capacity * like.head_dim * like.keys.element_size()
        if not ROTATE_AHEAD or self.pool.policy.stores_rotated or size > ROW_KEYS_BYTES or not (
                kernels.available(self.pool.device) and kernels.supports_head_dim(like.head_dim)):
            return None
        if self.rotated_keys is None:
            self.rotated_keys = torch.zeros(ROWS, like.kv_heads, like.capacity, like.head_dim, dtype=like.dtype,
                                            device=self.pool.device)
        return self.rotated_keys

    def _follow(self) -> None:
        """RoPE tables sized before any capture reads them (as `BatchDecoder.size_tables`), and the graphs
        dropped when what they were captured against moved."""
        decoder = self.decoder
        decoder.max_position = max(decoder.max_position, self.max_position)
        decoder.size_tables()
        identity = (decoder.graphs.identity, self.meta.buffer.data_ptr(),
                    0 if self.observed is None else self.observed.data_ptr(),
                    0 if self.cache.row_keys is None else self.cache.row_keys.data_ptr())
        self.graphs.follow(identity)
