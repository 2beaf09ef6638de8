"""One model forward for a batched step's decoding rows and the next chunks of prompts being read.

Without it, every prompt chunk is a forward of its own between decoding steps, and every user
decoding waits for it and then for its own step. Here the step's tokens are packed into one
sequence, `[decode tokens of B rows | chunk of prompt 1 | chunk of prompt 2 | ...]`: the weights are
read once for all of them, and only attention is done per part (docs/design.md, *The batched step*):

- the B decoding rows append their token to their pool slots and attend over them with the batched
  decode kernel, exactly as `BatchDecoder`'s step does (`StepCache`);
- each prompt chunk goes through its own slot's `PotCache` (its layers are views of the slot's row,
  `SlotPool.cache`), as `Engine._forward` would read it: the same positions and the observations its
  method asked for; then the method's compression runs on that run alone (`Engine._after_forward`).
  The chunks' attention is one varlen launch a layer over their slots (`kvpot.kernels.varlen`,
  `MixedCache._varlen`); a chunk that observes its attention gets it from `observe`, as alone.

The chunks are the method's own (`kvpot.engine.reading.PromptReader`): a method whose result depends
on where its forwards end (`Method.chunk_dependent`) reads the same forwards it reads alone. A chunk
whose method needs a forward of its own stays out (`mixable`: a method's own attention, InfiniteHiP's and
InfLLM's). A tail probe rides in the chunk's part as it does alone (`Engine._forward_with_tail`): InfiniPot's
catalyst at a pot's fill, CItruS' instruction, their attention observed and their entries rolled back.

A decoding row whose method reshapes its cache at this token (InfiniPot's pot filling, a cache reaching its
budget: `Method.decode_plan` "eager") joins as a chunk too: its last token as a one-token chunk of its run, the
forward `BatchDecoder.eager_step` would run alone (`BatchDecoder.ride`), its method's work after it, then its next
token picked (`BatchDecoder.rode`). Alone, those forwards took 85-272 ms between steps on an H200.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers.cache_utils import Cache

from kvpot.attention import AttentionRequest, observe, sequence_attention
from kvpot.compat import cache_kwargs
from kvpot.defaults import MIXES
from kvpot.engine.documents import shares
from kvpot.engine.packed import PackedStep
from kvpot.engine.packed_cache import ROWS, StepForwardLayer, as_rows, chunk_documents, varlen_kernel
from kvpot.engine.plan import Candidate
from kvpot.engine.pool import SlotLayer
from kvpot.engine.results import _Run
from kvpot.engine.sampling import _as_ids
from kvpot.errors import KvpotError
from kvpot.methods.base import Method, Step
from kvpot.methods.token_scores import store_chunks
from kvpot.scoring import token_nll


@dataclass
class Chunk:
    """A prompt chunk that joins a mixed forward: its run, token ids [q] and step."""

    run: _Run
    ids: torch.Tensor
    step: Step


def resolve_mix(mix: bool | str, device: torch.device, head_dim: int, parallel: bool = False,
                invariant: bool = False) -> bool:
    """`Scheduler(mix=...)`: True/"on", False/"off", "eager" (on, each mixed step in its own shapes, never the captured
    fixed-shape step of `kvpot.engine.packed`: to compare), or "auto": on where the varlen Triton kernel attends the
    chunks (a CUDA device with Triton, a head dim the kernels take). Without it each chunk is attended alone
    (`sequence_attention`), and the mixed step measured slower than prompts read apart (an H200,
    records/engine-core-h100/); with it, faster (an H100, records/engine-core-h100/varlen/). With shared documents
    too, where a reader's question is read as a chunk over the region: 64 readers on an H100 got 6,188 tok/s, against
    5,140-5,575 with their questions fed a token a step in three earlier runs (records/shared-document-h100/). "auto"
    stays off under tensor parallelism (`parallel`: the mixed step is untested there). Batch-invariant decoding
    (`invariant`) reads prompts as one request alone does, in forwards of their own: "auto" is off there and "on"
    refused."""
    if mix not in (*MIXES, True, False):
        raise KvpotError(f"mix must be one of {MIXES} (or a bool), got {mix!r}.")
    if invariant and mix in ("on", "eager", True):
        raise KvpotError("mix='on' under batch-invariant decoding: a prompt chunk read beside the decoding rows is "
                         "attended and multiplied in other sums than alone; use 'auto' or 'off'.")
    if isinstance(mix, bool):
        return mix
    if mix != "auto":
        return mix in ("on", "eager")
    if parallel or invariant:
        return False
    from kvpot import kernels

    return device.type == "cuda" and kernels.available(device) and kernels.supports_head_dim(head_dim)


def peek_candidate(method: Method, slot: int, run: _Run, reader, cuttable: bool,
                   pool=None) -> tuple[Candidate, tuple | None]:
    """A reading request's next chunk (`reader.peek()`: ids, step) and what a plan weighs of it (`plan_chunks`): its
    tokens, whether it can share a forward, the tokens of the tail probe its method would add to that forward, and
    whether the slot reads a shared document of `pool`. A peek that fails gives no chunk, and the request is left to
    read apart (where it fails alone)."""
    shared = pool is not None and shares(pool, slot)
    try:
        chunk = reader.peek()
        fits = chunk is not None and mixable(method, run)
        tail = tail_tokens(method, run, chunk[1]) if fits else 0
    except Exception:  # noqa: BLE001 - left to `Scheduler._prefill`, which fails this request alone
        return Candidate(slot, 0, False, cuttable), None
    return Candidate(slot, 0 if chunk is None else chunk[0].numel(), fits, cuttable, tail, shared), chunk


def tail_tokens(method: Method, run: _Run, step: Step) -> int:
    """Tokens of the tail probe `method` adds to a forward of `step` on `run` (as `Engine._before_forward` asks)."""
    tail = method.tail_probe(run.cache, step)
    return 0 if tail is None else torch.as_tensor(tail[0]).numel()


def mixable(method: Method, run: _Run) -> bool:
    """Whether a chunk of this run can share a forward: not where the method attends for itself (InfiniteHiP,
    InfLLM) or prepares each forward itself (`before_forward`)."""
    return run.cache.attention is None and type(method).before_forward is Method.before_forward


class MixedLayer(StepForwardLayer):
    """One layer of a mixed forward: the decoding rows' tokens to the pool, each chunk to its run's cache."""

    def __init__(self, cache: MixedCache, index: int):
        super().__init__()
        self.mixed, self.index = cache, index
        self.step_layer = cache.step.layers[index]
        self.parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value_states [1, kv_heads, T, d], un-rotated: the rows' tokens first, then each chunk's."""
        b = self.mixed.batch
        if b:
            self.step_layer.update(as_rows(key_states[:, :, :b]), as_rows(value_states[:, :, :b]))
        spans = zip(self.mixed.spans, self.mixed.caches)
        if self.mixed.varlen:  # the varlen kernel reads the slots: nothing to rotate and hand back
            for (start, stop), cache in spans:
                cache.layers[self.index].append(key_states[:, :, start:stop], value_states[:, :, start:stop])
        else:
            self.parts = [cache.layers[self.index].update(key_states[:, :, start:stop], value_states[:, :, start:stop])
                          for (start, stop), cache in spans]
        return key_states, value_states


class MixedCache(Cache):
    """The cache a mixed forward hands the model; the kvpot attention function calls `attend`."""

    batched = True

    def __init__(self, step, batch: int, chunks: list[Chunk], sizes: list[int]):
        self.step, self.batch = step, batch
        self.caches = [chunk.run.cache for chunk in chunks]
        self.spans, start = [], batch
        for size in sizes:  # each chunk's tokens, and its tail probe's
            self.spans.append((start, start + size))
            start += size
        super().__init__(layers=[MixedLayer(self, i) for i in range(len(step.layers))])
        self.varlen = varlen_chunks(self.step, self.caches)
        self.bounds: dict[tuple, torch.Tensor] = {}  # the varlen launch's slots, starts and cached counts
        self.longest = max((stop - start for start, stop in self.spans), default=0)

    @property
    def is_compileable(self) -> bool:  # transformers' API
        return False

    def attend(self, layer: MixedLayer, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """query [1, heads, T, d] un-rotated -> [1, T, heads, d]: the rows by the batched kernel, the chunks
        over their slots by the varlen kernel where `_varlen` allows, else each over its own cache."""
        outputs = []
        if self.batch:
            rows = self.step.attend(layer.step_layer, as_rows(query[:, :, : self.batch]), scaling)  # [B, 1, heads, d]
            outputs.append(rows.reshape(1, self.batch, *rows.shape[2:]))
        if self.varlen:
            outputs.append(self._attend_varlen(layer, query[:, :, self.batch :], scaling))
        else:
            for (start, stop), cache, (key, value) in zip(self.spans, self.caches, layer.parts):
                part = cache.layers[layer.index]
                outputs.append(sequence_attention(cache, part, query[:, :, start:stop], key, value, scaling))
        return torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]

    def _attend_varlen(self, layer: MixedLayer, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """query [1, heads, T, d] of the chunks, un-rotated -> [1, T, heads, d] (`kvpot.kernels.varlen`)."""
        parts = [cache.layers[layer.index] for cache in self.caches]
        storage, device = layer.step_layer.storage, query.device
        # the chunk's own entries were appended last (`update`); layers with the same counts share one copy
        cached = tuple(part.n - (stop - start) for part, (start, stop) in zip(parts, self.spans))
        if cached not in self.bounds:
            slots, starts = [part.row for part in parts], [0] + [stop - self.batch for _, stop in self.spans]
            self.bounds[cached] = torch.tensor([*slots, *starts, *cached]).to(device, non_blocking=True)
        bounds, count = self.bounds[cached], len(parts)
        rope, unrotated = self.step.rope, query
        if self.step.policy.stores_rotated:  # keys stored rotated: each chunk's queries turn at its own positions
            query = torch.cat([part.rotate_queries(query[:, :, start - self.batch : stop - self.batch])
                               for part, (start, stop) in zip(parts, self.spans)], dim=2)
            tables = (None, None, None)
        else:  # rotated on load, keys and queries, from the entries' RoPE positions
            query = rope.unscale(query)
            tables = (*rope.table(max(part.max_rope for part in parts) + 1, query), storage.rope_positions)
        out, lse = varlen_kernel(device, query.shape[-1])(
            query[0].transpose(0, 1), storage.keys, storage.values, bounds[:count], bounds[count : 2 * count + 1],
            bounds[2 * count + 1 :], scaling, self.longest, *tables, **chunk_documents(layer.step_layer))
        # the log-sum-exp goes to `observe` where the chunk's attention alone usually gives it one
        # (`attend_with_lse`: half precision on CUDA); elsewhere `observe` normalises itself, as alone
        with_lse = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
        for part, cache, (start, stop) in zip(parts, self.caches, self.spans):
            if cache.request is not None:  # as `sequence_attention`: rotated queries over every rotated key
                rows = slice(start - self.batch, stop - self.batch)
                turned = query[:, :, rows] if tables[0] is None else part.rotate_queries(unrotated[:, :, rows])
                part.observation = observe(turned, part.attention_keys(), cache.request, scaling,
                                           lse[rows].transpose(0, 1)[None] if with_lse else None)
        return out.unsqueeze(0)


def mixed_forward(decoder, slots: list[int], live: list[bool], observe: AttentionRequest | None,
                  chunks: list[Chunk]) -> None:
    """A token for each of `slots` (as `BatchDecoder.step`: appended, the method's per-token work, the next
    token picked) and each chunk of `chunks` read into its run, in one forward of the model. Each chunk's
    method compresses after it (`Engine._after_forward`). In fixed shapes, captured on a GPU, where
    `PackedStep.takes` the step (`kvpot.engine.packed`); else eagerly."""
    engine = decoder.engine
    probes = [engine._before_forward(chunk.run, chunk.step) for chunk in chunks]  # (tail, request) each
    packed = _packed(decoder)
    takes = packed is not None and packed.takes(chunks, probes)
    _copy_readers(decoder, chunks, probes, takes)
    if takes:
        b = decoder.load_rows(slots, live, packed.rows_floor)
        for chunk, (tail, request) in zip(chunks, probes):
            chunk.run.cache.begin_forward(None, -1, tail[1] if tail is not None else request)
        results = packed.run(b, observe, decoder.mode(slots), chunks, probes)
    else:
        results = _eager(decoder, slots, live, observe, chunks, probes)
    if slots:
        decoder.steps += 1
    after_chunks(engine, chunks, results)


def after_chunks(engine, chunks: list[Chunk], results: list) -> None:
    """Each chunk's work after the mixed forward (`Engine._after_forward`), with what batches across chunks done once:
    the head's products (`chunk_heads`) and the token scores' writes to the pool (`token_scores.store_chunks`). Alone,
    each chunk took two products of the head and a write a layer: 8 questions of 32 tokens over a stored document
    took 5.8 ms of a 31 ms step in the head's 16 products, and ~10 ms of the host's time in 256 writes (the 8B
    shape, an H100: records/shared-document-h100/, call15)."""
    heads = chunk_heads(engine, chunks, [hidden for hidden, _ in results])
    method, stored = engine.method, False
    if method.token_score is not None and method.needs_token_nll:
        batched = [i for i, head in enumerate(heads) if head is not None]
        stored = len(batched) > 1 and store_chunks([chunks[i].run.cache for i in batched], method.token_score,
                                                   [heads[i][1] for i in batched])
    for chunk, (hidden, observation), head in zip(chunks, results, heads):
        step = replace(chunk.step, scores_stored=True) if stored and head is not None else chunk.step
        engine._after_forward(chunk.run, chunk.ids, step, hidden, observation, heads=head)


def chunk_heads(engine, chunks: list[Chunk], hiddens: list[torch.Tensor]) -> list[tuple | None]:
    """Per chunk, what `Engine._after_forward` takes of the head: (its last logits [vocab] float32, its tokens'
    -log p [q] where the method keeps them, else None): one product over every chunk's last row, and `token_nll`
    over all their other rows at once. None for a one-token chunk (a riding row, whose head runs as a decoding
    row's) and where fewer than two chunks would share the products."""
    picked = [i for i, chunk in enumerate(chunks) if chunk.ids.numel() > 1]
    out: list[tuple | None] = [None] * len(chunks)
    if len(picked) < 2:
        return out
    lasts = engine.head(torch.stack([hiddens[i][-1] for i in picked])).float()  # [chunks, vocab]
    rests = [None] * len(picked)
    if engine.method.needs_token_nll:
        ids = [chunks[i].ids.to(hiddens[i].device) for i in picked]
        rest = token_nll(engine.head, torch.cat([hiddens[i][:-1] for i in picked]), torch.cat([x[1:] for x in ids]))
        rests = rest.split([x.numel() - 1 for x in ids])
    for k, i in enumerate(picked):
        nll = None
        if rests[k] is not None:
            nll = engine._token_nll(chunks[i].run.logits, hiddens[i], chunks[i].ids.to(hiddens[i].device), rests[k])
        out[i] = (lasts[k], nll)
    return out


def chunk_rows(decoder, rides: list) -> int | None:
    """The chunks a mixed step may read beside `rides` (rows riding as chunks): the packed step's rows where its
    mixed steps are captured (more would run eagerly), else no limit."""
    return max(0, ROWS - len(rides)) if decoder.fixed_mix else None


def _copy_readers(decoder, chunks: list[Chunk], probes: list, packed: bool) -> None:
    """Copy on write for chunks of shared documents' readers that would read their slot's first entries: a chunk
    attends its document in the region only through the varlen kernel (the packed step, or the eager step's
    `varlen_chunks`), and nothing else of the forward may read the document's keys (a tail probe, an observation).
    The scheduler reads a reader's question as a chunk only where neither happens (`documents.question_chunk`);
    this keeps every other case exact."""
    region = decoder.pool.documents
    if region is None:
        return
    varlen = packed or varlen_chunks(decoder.cache, [chunk.run.cache for chunk in chunks])
    for chunk, (tail, request) in zip(chunks, probes):
        slot = getattr(chunk.run.cache.layers[0], "row", None)
        if slot is not None and region.shares(slot) and (tail is not None or request is not None or not varlen):
            region.copy_out(slot, "question")


def varlen_chunks(step, caches: list) -> bool:
    """Whether the chunks can be attended in one varlen launch over their pool slots: each chunk's keys
    are in its slot's row (the run's cache is the slot's, `SlotPool.cache`: not CItruS' instruction cache),
    stored rotated or with their RoPE positions (then rotated on load from a fixed table: not `dynamic`
    RoPE). A chunk that observes its attention (a tail probe, an observation request) gets it from
    `observe` with the kernel's log-sum-exp, as `sequence_attention` does alone."""
    rope, policy = step.rope, step.policy
    if not caches or policy.raw_keys or (rope.dynamic and not policy.stores_rotated):
        return False
    return all(not cache.static and cache.attention is None
               and all(isinstance(layer, SlotLayer) for layer in cache.layers) for cache in caches)


def capture_mixed(decoder, method: Method, prefill_tokens: int) -> int:
    """`PackedStep.capture` of the scheduler's packed steps up to its prompt budget and one more bucket (a tail probe
    rides in its chunk), observing chunks too if the method ever observes a chunk; 0 where mixed steps are eager."""
    packed = _packed(decoder)
    if packed is None:
        return 0
    kind = type(method)
    observes = kind.tail_probe is not Method.tail_probe or kind.request is not Method.request
    return packed.capture(prefill_tokens + 256, observes)


def _packed(decoder) -> PackedStep | None:
    """The decoder's packed step (made at the first use), or None where its mixed steps are eager."""
    if decoder.fixed_mix and decoder.packed is None:
        decoder.packed = PackedStep(decoder)
    return decoder.packed if decoder.fixed_mix else None


def _eager(decoder, slots: list[int], live: list[bool], observe: AttentionRequest | None, chunks: list[Chunk],
           probes: list) -> list:
    """`mixed_forward` with the shapes of this step: returns, per chunk, its hidden states and its tail probe's
    observation (None without one), the probe's entries rolled back."""
    engine, pool = decoder.engine, decoder.pool
    b, device = len(slots), pool.device
    inputs, nll = [], None
    if b:
        decoder.rows[:b].copy_(torch.tensor(slots, dtype=torch.long), non_blocking=True)
        decoder.live[:b].copy_(torch.tensor([1.0 if flag else 0.0 for flag in live]), non_blocking=True)
        decoder.size_tables()
        ids, nll = decoder.begin_rows(b, observe)
        inputs.append(ids)
    tails = []
    for chunk, (tail, request) in zip(chunks, probes):
        run, q = chunk.run, chunk.ids.numel()
        ids = chunk.ids.to(device)
        if tail is not None:  # as `Engine._forward_with_tail`: the probe follows the chunk's tokens
            tail_ids, request = tail  # its observation is the forward's
            tails.append([n + q for n in run.cache.lengths()])  # the entries the probe may score
            ids = torch.cat([ids, _as_ids(tail_ids, device, "tail probe ids")])
        else:
            tails.append(None)
        positions = torch.arange(run.next_position, run.next_position + ids.numel(), device=device)
        run.cache.begin_forward(positions, run.next_position + ids.numel() - 1, request)
        inputs.append(ids)
    ids = torch.cat(inputs).view(1, -1)
    cache = MixedCache(decoder.cache, b, chunks, [part.numel() for part in inputs[1 if b else 0:]])
    zeros = torch.zeros_like(ids)  # RoPE is applied by kvpot
    out = engine.decoder(input_ids=ids, position_ids=zeros, use_cache=True, kvpot_cache=cache,
                         **cache_kwargs(engine.decoder, cache))
    hidden = out.last_hidden_state[0]  # [T, hidden]
    if b:
        decoder.end_rows(b, engine.head(hidden[:b]).float(), decoder.mode(slots), nll)
    results = []
    for chunk, (start, _), before in zip(chunks, cache.spans, tails):
        observation = None
        if before is not None:  # the probe's attention over what it may score, then its entries go
            observation = [layer.observation[..., :n] for layer, n in zip(chunk.run.cache.layers, before)]
            chunk.run.cache.truncate(before)
        results.append((hidden[start : start + chunk.ids.numel()], observation))
    return results
