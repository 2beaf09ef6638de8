"""Batched decoding: one forward appends a token to each of many pool slots (`kvpot.engine.pool`).

A step takes B rows, each a slot of the pool, feeds each its last token, and through `StepCache`
(what the model is handed as its cache) writes each row's key and value at its slot's next
entry; the attention reads every row's live entries with the batched decode kernel (RoPE applied
on load from stored positions, per-slot lengths read on the device). Then the method's per-token
work runs for all rows at once (`Method.batch_append`: H2O's accumulation, InfiniPot's NuC) and
each row's next token is picked on the device with its own sampling parameters.

What the model is handed as its cache, `StepCache`, and the kernels it runs are `kvpot.engine.step_cache`'s.

The step has fixed shapes for a batch size, so on a GPU it is captured once per bucket of batch
sizes (1, 2, 4, ... up to the pool) as a CUDA graph and replayed; rows past the real batch point at
the pool's scratch slot. What does not fit one fixed shape stays outside the graph, in the
scheduler (`kvpot.engine.scheduler`): a row whose method reshapes its cache at this token
(InfiniPot's distillation, CItruS' chunk eviction, InfiniteHiP's sparse attention) reads its token
as a one-token chunk of its run in the step's mixed forward where prompts mix (`ride`, `rode`), else
runs the one-sequence engine's forward on its slot (`eager_step`). A row at its budget ("steady") appends
in the batch and evicts inside the step where its method drops one entry by a ranking (StreamingLLM, H2O, TOVA;
`kvpot.engine.evict.evict_in_step`, captured with it), else after it (D2O's merges; `evict_steady`). A pool of one
slot steps what the batched step cannot take (a method's own attention) and its steady rows as one sequence instead:
the one-sequence fixed-shape step on the slot's cache, captured (`sequence_step`, `kvpot.engine.alone`).
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F

from kvpot.attention import AttentionRequest
from kvpot.compat import cache_kwargs
from kvpot.engine.evict import evict_in_step
from kvpot.engine.graphs import REPLAYED, StepGraphs
from kvpot.engine.pool import SlotPool
from kvpot.engine.sampling import PICKING, pick_rows
from kvpot.engine.sequence import counting_capture, mirror_replay, observes, prepare_static, sequence_body, step_key
from kvpot.engine.step_cache import StepCache
from kvpot.errors import KvpotError
from kvpot.methods.base import DECODE_STEP, Method, Step


def batchable_request(request: AttentionRequest | None) -> bool:
    """Whether the batched kernel's observation (each group's mean probability of the token's attention
    over every live entry, itself included) is what `request` asks of a one-token forward."""
    if request is None:
        return True
    rows = request.rows in (None, (-1, None), (-1, 0))
    return rows and request.over == "all" and request.head_reduce == "mean"


def batches_rows(engine, policy) -> bool:
    """Whether a `Scheduler` steps `engine`'s rows in batched forwards (else each row's steps are the engine's
    eager forward): a batched form of the method's per-token work, a RoPE table, kernels that read the policy."""
    dynamic = engine.rope.dynamic and not policy.stores_rotated
    return batched_method(engine.method) and not dynamic and policy.kernel_decoding


def batched_method(method: Method) -> bool:
    """Whether the method's per-token work has a batched form (a method that overrides the
    one-sequence `decode_append` must override `batch_append` too, or its rows run alone)."""
    kind = type(method)
    return kind.decode_append is Method.decode_append or kind.batch_append is not Method.batch_append


def buckets(slots: int) -> list[int]:
    """Batch sizes a step is captured at: powers of two below the pool's size, and the size itself."""
    return [1 << i for i in range(max(slots - 1, 0).bit_length())] + [slots]


class BatchDecoder:
    """The batched decoding step over a pool, with each slot's last token, logits and sampling
    parameters in device tensors (row `pool.scratch` serves padding rows; a pool of one has none and never pads)."""

    evict_inside = True  # steady rows evict inside the step where they can (`evict.steady_form`); tests compare off

    def __init__(self, engine, pool: SlotPool, graphs: bool):
        self.engine, self.pool, self.method = engine, pool, engine.method
        device, rows = pool.device, pool.rows
        vocab = engine.head.weight.shape[0]
        self.logits = torch.zeros(rows, vocab, dtype=torch.float32, device=device)  # each slot's last logits
        self.last_token = torch.zeros(rows, dtype=torch.long, device=device)  # the token its next step reads
        self.next_position = torch.zeros(rows, dtype=torch.long, device=device)  # that token's stream position
        self.temperature = torch.zeros(rows, dtype=torch.float32, device=device)
        self.top_p = torch.ones(rows, dtype=torch.float32, device=device)
        self.seed = torch.zeros(rows, dtype=torch.long, device=device)
        self.counter = torch.zeros(rows, dtype=torch.long, device=device)  # draws so far (sampling's counter)
        self.rows = torch.full((pool.slots,), pool.pad_row, dtype=torch.long, device=device)
        self.live = torch.zeros(pool.slots, dtype=torch.float32, device=device)  # 1: the row's append is the whole step
        self.zeros = torch.zeros(pool.slots, 1, dtype=torch.long, device=device)  # position_ids: RoPE is kvpot's
        self.cache = StepCache(pool)
        self.cache.split_entries, self.cache.written = engine.split_entries, frozenset(self.method.batch_scores)
        self.buckets = buckets(pool.slots)
        self.graphs_on = graphs
        self.graphs = StepGraphs()  # sampling draws from each row's seed and counter: no generator to register
        self.max_position = 0
        self.steps = 0
        self.picking: dict[int, str] = {}  # decoding slot -> what its picks need (`PICKING`)
        # mixed steps in fixed shapes (`kvpot.engine.packed`, made at the first): where graphs replay them. On a
        # CPU the eager mixed step is the faster (no padding), so tests turn this on to check the body there. A pool
        # without a scratch slot has nowhere to pad a packed step's tokens: its mixed steps run eager.
        self.fixed_mix = graphs and pool.scratch is not None
        self.packed = None
        self.sequence_graphs = StepGraphs()  # a pool of one's one-sequence steps (`sequence_step`)
        self.sequence_cache = None  # (a weak reference to) the cache they were captured on

    # ------------------------------------------------------------------ per-slot state
    def start(self, slot: int, logits: torch.Tensor, next_position: int, temperature: float, top_p: float,
              seed: int, remaining: int) -> None:
        """A slot begins decoding: its prefill's last logits, the position its first fed token takes."""
        self.logits[slot].copy_(logits.view(-1))
        self.next_position[slot] = next_position
        self.temperature[slot], self.top_p[slot] = temperature, top_p
        self.seed[slot], self.counter[slot] = seed, 0
        self.max_position = max(self.max_position, next_position + remaining + 1)

    def mode(self, slots: list[int]) -> str:
        """What the picks of `slots` need (`kvpot.engine.sampling.PICKING`): their most demanding row's."""
        return PICKING[max((PICKING.index(self.picking.get(slot, "greedy")) for slot in slots), default=0)]

    def pick(self, slots: list[int]) -> None:
        """Pick each slot's next token from its stored logits (the first token, and after an eager step)."""
        at = torch.tensor(slots, dtype=torch.long).to(self.pool.device, non_blocking=True)
        self.pick_from(at, self.logits[at], self.mode(slots))

    def pick_from(self, rows: torch.Tensor, logits: torch.Tensor, mode: str) -> None:
        token = pick_rows(logits, self.temperature[rows], self.top_p[rows], self.seed[rows], self.counter[rows], mode)
        if self.engine.parallel is not None:  # tensor parallelism: rank 0's picks for every rank (seeds may differ)
            token = self.engine.parallel.broadcast(token.contiguous())
        self.last_token[rows] = token
        self.counter[rows] += 1

    def eager_step(self, slot: int, run) -> None:
        """The one-sequence engine's forward on this slot (a distillation, an eviction, a sparse attention)."""
        self.engine._forward(run, *self.ride(slot, run))
        self.rode(slot, run)

    def ride(self, slot: int, run) -> tuple[torch.Tensor, Step]:
        """The forward `eager_step` runs, as (ids [1], step): the slot's last token, read as a one-token chunk of
        its run (the scheduler may read it in a mixed forward instead, `kvpot.engine.mixed`); then `rode`."""
        run.logits = self.logits[slot].clone()  # the token's NLL is scored from the logits that picked it
        return self.last_token[slot : slot + 1].clone(), Step("decode", 1, segment_end=True)

    def rode(self, slot: int, run) -> None:
        """After `ride`'s forward and its method's work: the slot's logits, position, counts; its next token picked."""
        self.logits[slot].copy_(run.logits)
        self.next_position[slot] = run.next_position
        self.pool.sync_lengths(slot)
        self.pick([slot])

    def sequence_step(self, slot: int, run, plan: str) -> None:
        """A pool of one's row the batched step cannot take (a method's own attention, an observation or per-token
        work without a batched form) or that is steady (`kvpot.engine.plan.row_plan`): the one-sequence step on its
        slot's cache, `plan` "append" or "steady" (`kvpot.engine.sequence`), captured per form in graphs of its own,
        made again for each new request (they read its cache's and its method's buffers). The host counts are mirrored
        here."""
        cache, rows = run.cache, self.rows[:1]
        if self.sequence_cache is None or self.sequence_cache() is not cache:
            self.sequence_graphs.clear()  # another request's cache: its graphs read buffers that are gone
            self.sequence_cache = weakref.ref(cache)
            cache.split_entries = self.engine.split_entries
            prepare_static(cache, self.pool.capacity, self.max_position, observes(self.method))
        self.load_rows([slot], [True])
        mode = self.mode([slot])
        body = functools.partial(sequence_body, self.engine, cache, plan, self.last_token[slot : slot + 1],
                                 self.next_position[slot : slot + 1], self.logits[slot], self.zeros[:1],
                                 self.max_position, lambda logits: self.pick_from(rows, logits.view(1, -1), mode))
        if not self.graphs_on:
            body()
            return
        like = cache.layers[0].keys
        tables = self.engine.rope.table(max(self.pool.capacity, self.max_position) + 1, like)
        self.sequence_graphs.follow(() if tables is None else tuple(t.data_ptr() for t in tables))
        done, effect = self.sequence_graphs.run(step_key(self.method, cache, plan) + (mode,), body,
                                                counting_capture(cache))
        if done == REPLAYED:
            mirror_replay(cache, plan, effect)

    def feed(self, slots: list[int], tokens: list[int]) -> None:
        """Make `tokens` the next input of `slots` (a question read one token per step), not their picks."""
        at = torch.tensor(slots, dtype=torch.long).to(self.pool.device, non_blocking=True)
        self.last_token[at] = torch.tensor(tokens, dtype=torch.long).to(self.pool.device, non_blocking=True)

    def token_nll(self, rows: torch.Tensor) -> torch.Tensor:
        """-log p(token) under the logits that produced it, per row (InfiniPot's NuC of the fed token)."""
        return F.cross_entropy(self.logits[rows], self.last_token[rows], reduction="none")

    # ------------------------------------------------------------------ the step
    def step(self, slots: list[int], live: list[bool], observe: AttentionRequest | None,
             evict: tuple[int, ...] | None = None) -> int:
        """One token for each of `slots` (`live[i]`: the row's step is the append alone; False for steady
        rows, whose method evicts after it, or inside the step from the counts `evict`: `evict_in_step`).
        Returns the batch size it ran at."""
        if not slots:
            return 0
        if evict is not None and self.pool.scratch is None and any(live):
            raise KvpotError("a step evicting inside its body points appending rows at the scratch slot, and this "
                             "pool has none (a bug: please report).")
        bucket = self.load_rows(slots, live)
        mode = self.mode(slots)
        self.size_tables()
        body = functools.partial(self._run, bucket, observe, mode, evict)
        if self.graphs_on:
            self.graphs.run((bucket, observe is not None, mode, evict), body)
        else:
            body()
        self.steps += 1
        return bucket

    def load_rows(self, slots: list[int], live: list[bool], floor: int = 0) -> int:
        """Put `slots` (padded to their bucket, at least `floor`, with the scratch slot) and their `live` flags in
        the static row buffers a step reads; returns the bucket."""
        count = len(slots)
        bucket = next(size for size in self.buckets if size >= max(count, floor))
        padded = slots + [self.pool.pad_row] * (bucket - count)  # (a pool without scratch: one bucket, no padding)
        weights = [1.0 if flag else 0.0 for flag in live] + [0.0] * (bucket - count)
        self.rows[:bucket].copy_(torch.tensor(padded, dtype=torch.long), non_blocking=True)
        self.live[:bucket].copy_(torch.tensor(weights, dtype=torch.float32), non_blocking=True)
        return bucket

    def capture(self, observes: list[AttentionRequest | None], steady: tuple | None = None) -> int:
        """Warm and capture every bucket's step now, for each observation in `observes` and picking mode, and
        `steady` = (its observation, counts) the form whose steady rows evict inside it (`evict.steady_capture`), on
        padding rows alone (the scratch slot; a pool without one warms its one slot, so only while it is free): the
        first users of each batch size then replay a graph instead of waiting for kernels to compile and a capture.
        Returns the graphs captured (0 on a CPU)."""
        if not self.graphs_on:
            return 0
        if self.pool.scratch is None and self.pool.used:
            raise KvpotError("a pool of one slot captures its steps on that slot, so only before a request takes it.")
        forms = [(observe, None) for observe in observes] + ([steady] if steady is not None else [])
        keys = [(bucket, observe, mode, evict) for bucket in self.buckets for observe, evict in forms for mode in PICKING]
        before = self.captures
        for _ in range(3):  # a warm-up that made a buffer (a score array) dropped the graphs captured before it
            for bucket, observe, mode, evict in keys:
                self.rows[:bucket].fill_(self.pool.pad_row)
                self.live[:bucket].zero_()
                key = (bucket, observe is not None, mode, evict)
                while key not in self.graphs:  # warm, then capture (warm again if the warm-up made a buffer)
                    self.size_tables()
                    self.clear_pad_row()
                    self.graphs.run(key, functools.partial(self._run, bucket, observe, mode, evict))
            if all((b, o is not None, m, e) in self.graphs for b, o, m, e in keys):
                break
        self.clear_pad_row()  # (a scratch slot's is cleared by every step: `begin_rows`, `end_rows`)
        return self.captures - before

    def clear_pad_row(self) -> None:
        """The pad row's count and position back to 0: a pool without scratch warms its one slot, which a request
        takes next (its count is set then too: `SlotPool.cache`)."""
        self.pool.clear_pad_row()
        self.next_position[self.pool.pad_row].zero_()

    def size_tables(self) -> None:
        """RoPE tables big enough for every position this pool will see, before any capture reads them.
        The captured graphs go stale when a table had to grow, or when a method made a score array or an
        observation buffer since: a graph captured before it never writes it, and a compiled step (whose
        trace branches on which arrays exist) would recompile inside the next capture."""
        like = self.pool.layers[0].keys
        # rank policies rotate by entry index (below the capacity); absolute ones by stream position
        needed = max(self.pool.capacity, self.max_position if self.pool.policy.stores_rotated else 0)
        tables = self.engine.rope.table(needed + 1, like)
        arrays = sum(len(layer.scores) + (layer.probs is not None) for layer in self.pool.layers)
        self.graphs.follow((arrays,) + (() if tables is None else tuple(t.data_ptr() for t in tables)))

    def _run(self, bucket: int, observe: AttentionRequest | None, mode: str, evict: tuple[int, ...] | None) -> None:
        """The step's body, in fixed shapes (what a graph captures): the steady rows' eviction too, from `evict`."""
        engine, cache = self.engine, self.cache
        ids, nll = self.begin_rows(bucket, observe)
        with engine.single_row():  # a bucket of one: its linear layers as a single sequence's (engine.linear)
            out = engine.step_decoder()(input_ids=ids.view(bucket, 1), position_ids=self.zeros[:bucket], use_cache=True,
                                        kvpot_cache=cache, **cache_kwargs(engine.decoder, cache))
            logits = engine.head(out.last_hidden_state[:, -1]).float()  # [bucket, vocab]
        self.end_rows(bucket, logits, mode, nll)
        if evict is not None:
            evict_in_step(self.method, self.pool, self.rows[:bucket], self.live[:bucket], evict)

    def begin_rows(self, bucket: int, observe: AttentionRequest | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A fixed-shape step's first part, for the rows in `rows[:bucket]`: the step cache reads them, and
        each row's token to feed [bucket] and its -log p (None unless the method needs it). Shared with the
        mixed steps (`kvpot.engine.mixed`, `kvpot.engine.packed`)."""
        cache, rows = self.cache, self.rows[:bucket]
        if self.pool.scratch is not None:
            self.pool.lengths[:, self.pool.scratch] = 0  # padding rows write the scratch slot's first entry
        cache.rows, cache.stream_positions = rows, self.next_position[rows]
        cache.max_position, cache.request = self.max_position, observe
        cache.groups = None  # readers of shared documents, grouped once per step (`kvpot.kernels.shared`)
        nll = self.token_nll(rows) if self.method.needs_token_nll else None
        if observe is not None:  # made here: first made inside a compiled layer, its existence is a guard there,
            for layer in self.pool.layers:  # which the next step fails, recompiling inside a graph's capture
                layer.observation_buffer()
        return self.last_token[rows], nll

    def end_rows(self, bucket: int, logits: torch.Tensor, mode: str, nll: torch.Tensor | None) -> None:
        """A fixed-shape step's last part, given the rows' logits [bucket, vocab]: the method's per-token work
        for every row, the logits kept, the next token picked."""
        rows, live = self.rows[:bucket], self.live[:bucket]
        self.method.batch_append(self.pool.layers, rows, self.cache.appended, live,
                                 Step("decode", 1, segment_end=True, token_nll=nll))
        self.logits[rows] = logits
        self.pick_from(rows, logits, mode)
        self.next_position[rows] += 1
        # padding rows (the scratch slot) take position 0 again: counted up a step at a time, their position would
        # pass the RoPE table of a long-running server, which rotates them by it where keys are stored rotated
        if self.pool.scratch is not None:  # (`[i] = 0` copies a host scalar: refused in a capture)
            self.next_position[self.pool.scratch].zero_()
        self.cache.request = None

    @property
    def captures(self) -> int:
        return self.graphs.captures

    @property
    def replays(self) -> int:
        return self.graphs.replays


def step_observations(method: Method) -> list[AttentionRequest | None]:
    """The observations a batched step of `method` may record (one per graph key: none, or the method's)."""
    requests = [method.decode_request(plan) for plan in ("append", "steady")]
    requests = {r is None: r for r in requests if r is None or batchable_request(r)}
    return list(requests.values())


__all__ = ["BatchDecoder", "StepCache", "batchable_request", "batched_method", "buckets",
           "step_observations", "DECODE_STEP"]

