"""Fixed-shape decoding: one token per step over buffers allocated at the method's bound.

The eager loop (`Engine._decode_eager`) slices the cache at its host-side length, rotates every
cached key at every step and reads each token back to the host. Here instead:

- every layer's buffers are reserved once at the method's bound (or context + new tokens when
  the method has none), so their addresses never change while decoding;
- the live count, the slot being written and the query's position live in device tensors
  (`PotLayer.length/slot/query_position`), and the attention reads the whole buffers masked to the
  live entries, rotating keys while it loads them (`kvpot.attention.static_attention`);
- the next token is picked on the device and fed back through a device tensor;

so a step has the same shapes at every length and is captured once as a CUDA graph and replayed
(`mode="graph"`). A method says, before each step, what the step does (`Method.decode_plan`):

- "append": only appends (Full, SnapKV after its prompt, InfiniPot between distillations, CItruS
  between evictions, any evicting method below its budget): one graph serves every length;
- "steady": appends and evicts back to the same count (StreamingLLM, H2O, TOVA, D2O at their
  budget): the method's own eviction is captured at that count;
- "eager": changes the cache's shape (a distillation, an eviction over a chunk): runs uncaptured
  between replays, through the engine's ordinary forward.

The host keeps a mirror of every count (a step's effect on it is known in advance), so no value
comes back from the device except the generated tokens, read every `readback` steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpot.errors import KvpotError
from kvpot.engine.graphs import WARMED, StepGraphs
from kvpot.engine.sampling import pick_rows, picking, request_seed
from kvpot.engine.sequence import counting_capture, mirror_replay, prepare_static, sequence_body, step_key
from kvpot.methods.base import Step
from kvpot.methods.replace import restore_order

MODES = ("auto", "graph", "static", "eager")
PLANS = ("append", "steady", "eager")


@dataclass
class DecodeReport:
    """What the decoding loop did: steps per kind (graph replays, uncaptured static steps, eager
    steps) and the graphs it captured."""

    replays: int = 0
    static_steps: int = 0
    eager_steps: int = 0
    captures: int = 0
    step_ms: list[float] | None = None  # with `time_steps`: each step's time, read once at the end

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def decode_eager(engine, run, max_new_tokens: int, on_token, temperature: float, top_p: float, seed: int | None,
                 eos: set[int], times: list[float] | None = None) -> list[int]:
    """The ordinary loop: one forward per token through the engine, each token read back to the
    host (where a method's step cannot have fixed shapes, and on a CPU)."""
    # logits (so sampling) live on the head's device, which differs from the input's in a split model
    sampler = OneRowSampler(engine.output_device, temperature, top_p, seed)
    tokens: list[int] = []
    last = time.perf_counter()
    for index in range(max_new_tokens):
        token = int(sampler.pick(run.logits))  # reads the token back: a sync
        if engine.parallel is not None:  # tensor parallelism: every rank continues with rank 0's token
            token = engine.parallel.same_token(token, run.logits.device)
        if times is not None:
            now = time.perf_counter()
            if index:
                times.append(1000 * (now - last))  # one forward and its pick
            last = now
        tokens.append(token)
        if on_token:
            on_token(token)
        if token in eos or index == max_new_tokens - 1:
            break
        ids = torch.tensor([token], device=engine.device)
        engine._forward(run, ids, Step("decode", 1, segment_end=True))
    return tokens


class OneRowSampler:
    """One sequence's picks through the batched sampler (`pick_rows`) as a batch of one row: its seed and its
    count of draws live on the device, so a captured step replays them, and a seeded request draws the tokens it
    draws in any batch."""

    def __init__(self, device: torch.device, temperature: float, top_p: float, seed: int | None):
        self.mode = picking(temperature, top_p)
        self.temperature = torch.full((1,), temperature, dtype=torch.float32, device=device)
        self.top_p = torch.full((1,), top_p, dtype=torch.float32, device=device)
        self.seed = torch.full((1,), request_seed(seed, temperature), dtype=torch.long, device=device)
        self.counter = torch.zeros(1, dtype=torch.long, device=device)  # draws so far

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token [1] from logits [vocab], on the device (no read-back)."""
        token = pick_rows(logits.reshape(1, -1), self.temperature, self.top_p, self.seed, self.counter, self.mode)
        self.counter.add_(1)
        return token


def resolve_mode(mode: str, device: torch.device) -> str:
    if mode not in MODES:
        raise KvpotError(f"decode must be one of {MODES}, got {mode!r}.")
    if mode == "auto":
        return "graph" if device.type == "cuda" else "eager"
    if mode == "graph" and device.type != "cuda":
        raise KvpotError("decode='graph' captures CUDA graphs and needs a CUDA device; use 'static' or 'eager'.")
    return mode


class Decoder:
    """Decodes `max_new_tokens` from a prefilled run (`kvpot.engine._Run`) with fixed-shape steps."""

    def __init__(self, engine, run, max_new_tokens: int, temperature: float, top_p: float, seed: int | None,
                 eos: set[int], mode: str, readback: int = 8, time_steps: bool = False):
        self.engine, self.run, self.method = engine, run, engine.method
        self.cache = run.cache
        self.cache.split_entries = engine.split_entries
        self.mode = mode
        self.max_new_tokens = max_new_tokens
        self.temperature, self.top_p = temperature, top_p
        self.eos = eos
        self.readback = readback
        self.report = DecodeReport()
        device = engine.device
        # per-step timing without a sync per step: an event after each step on the GPU
        self.marks: list | None = [] if time_steps else None
        self.sampler = OneRowSampler(device, temperature, top_p, seed)
        self.token = torch.zeros(1, dtype=torch.long, device=device)  # the token the next step reads
        self.position = torch.full((1,), run.next_position, dtype=torch.long, device=device)
        self.zero = torch.zeros(1, 1, dtype=torch.long, device=device)  # position_ids: RoPE is kvpot's
        self.logits = run.logits.clone()  # [vocab] float32, the last step's
        self.out = torch.zeros(max(max_new_tokens, 1), dtype=torch.long, device=device)
        self.index = torch.zeros(1, dtype=torch.long, device=device)  # next slot of `out`
        self.max_position = run.next_position + max_new_tokens + 1  # host bound for RoPE tables
        self.graphs = StepGraphs()  # sampling draws from the sequence's seed and counter: no generator state
        if self.cache.rope.dynamic and not self.cache.policy.stores_rotated:
            # frequencies that change with the longest position seen have no table to rotate
            # keys from while loading them: every step runs the ordinary way
            self.method_plan = lambda cache: "eager"
        else:
            self.method_plan = self.method.decode_plan
        self._prepare()

    # ------------------------------------------------------------------ setup
    def _prepare(self) -> None:
        """Reserve every layer at its decoding capacity and start the device-side counts."""
        cache, method = self.cache, self.method
        bound = method.max_entries()
        longest = max(cache.lengths())
        capacity = bound if bound is not None else longest + self.max_new_tokens + 1
        capacity = max(capacity, longest + 1)
        for layer in cache.layers:
            if not layer.is_initialized:
                raise KvpotError("decoding needs a prefilled cache.")
            layer.reserve(capacity)
            # stale tails would reach the attention's masked lanes: keep them finite and in range
            for buf in (layer.keys, layer.values, layer.positions, layer.rope_positions):
                buf[:, :, layer.n :].zero_()
        prepare_static(cache, capacity, self.max_position, observes=True)
        self.graphs.follow(self._buffer_addresses())

    def _buffer_addresses(self) -> tuple:
        return tuple(layer.keys.data_ptr() for layer in self.cache.layers)

    # ------------------------------------------------------------------ the loop
    def generate(self, on_token: Callable[[int], None] | None) -> list[int]:
        tokens: list[int] = []
        self._pick(self.logits)  # the first token comes from the prefill's logits
        done = self.max_new_tokens <= 1
        step = 1
        self._mark()
        while True:
            if not done:
                self._step()
                self._mark()
                step += 1
                done = step >= self.max_new_tokens
            if done or step - len(tokens) >= self.readback:
                fresh = self.out[len(tokens) : step].tolist()  # the only read-back: every `readback` steps
                for token in fresh:
                    tokens.append(token)
                    if on_token:
                        on_token(token)
                    if token in self.eos:
                        return self._finish(tokens)
                if done:
                    return self._finish(tokens[: self.max_new_tokens])

    def _mark(self) -> None:
        if self.marks is None:
            return
        if self.engine.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def _finish(self, tokens: list[int]) -> list[int]:
        restore_order(self.cache)  # steady steps may have replaced entries out of stream order
        if self.marks is not None and len(self.marks) > 1:
            if self.engine.device.type == "cuda":
                self.marks[-1].synchronize()
                gaps = [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
            else:
                gaps = [1000 * (b - a) for a, b in zip(self.marks, self.marks[1:])]
            self.report.step_ms = gaps
        return tokens

    def _step(self) -> None:
        plan = self.method_plan(self.cache)
        if plan not in PLANS:
            raise KvpotError(f"{self.method.name}.decode_plan returned {plan!r}; expected one of {PLANS}.")
        if plan == "eager":
            self._eager_step()  # the engine's forward advances run.next_position itself
            self.report.eager_steps += 1
            return
        if self.mode == "static":
            self._static_step(plan)
            self.report.static_steps += 1
        else:
            self._replay(plan)
        if plan == "steady":  # every steady step evicts (its time is inside the step's, not in compress_seconds)
            self.run.stats.compressions += 1
        self.run.next_position += 1

    def _eager_step(self) -> None:
        """A step that changes the cache's shape: the engine's ordinary forward, then the device
        counts are set from the host's."""
        run = self.run
        run.logits = self.logits
        self.engine._forward(run, self.token.clone(), Step("decode", 1, segment_end=True))
        for layer in self.cache.layers:
            layer.length.fill_(layer.n)
        self.logits.copy_(run.logits)
        self._pick(self.logits)
        self.position.add_(1)

    def _static_step(self, plan: str) -> None:
        """One fixed-shape step (the body of a captured graph, `kvpot.engine.sequence.sequence_body`)."""
        sequence_body(self.engine, self.cache, plan, self.token, self.position, self.logits, self.zero,
                      self.max_position, self._pick)

    def _pick(self, logits: torch.Tensor) -> None:
        token = self.sampler.pick(logits)
        if self.engine.parallel is not None:
            # tensor parallelism: the logits are the same on every rank, but a seed drawn per process
            # (seed=None) is not; rank 0's token goes to all, a device broadcast inside the captured step
            token = self.engine.parallel.broadcast(token.view(-1)).view_as(token)
        self.token.copy_(token)
        self.out.index_copy_(0, self.index.clamp(max=self.out.numel() - 1), token)
        self.index.add_(1)

    # ------------------------------------------------------------------ graphs
    def _replay(self, plan: str) -> None:
        self.graphs.follow(self._buffer_addresses())  # an eager step grew a buffer: the graphs are stale
        key = step_key(self.method, self.cache, plan)
        done, effect = self.graphs.run(key, lambda: self._static_step(plan), counting_capture(self.cache))
        if done == WARMED:
            self.report.static_steps += 1
            return
        self.report.replays += 1
        self.report.captures = self.graphs.captures
        mirror_replay(self.cache, plan, effect)

