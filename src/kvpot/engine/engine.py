"""The engine: chunked prefill, compression after each forward, decoding, statistics.

One forward at a time, the engine announces the original positions of the incoming tokens and
the attention the method wants observed (`PotCache.begin_forward`), runs the model's decoder with
`position_ids` all zero and the `PotCache` as its cache (`kvpot.compat`), and then lets the method evict
(`Method.after_forward`). Nothing in the model is patched: the cache and the registered `kvpot`
attention function do the work (docs/design.md, "How a forward pass flows").
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import nullcontext
from collections.abc import Callable, Iterator

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from kvpot.attention import AttentionRequest, register
from kvpot.cache import PotCache
from kvpot.compat import cache_kwargs
from kvpot.engine.batch import batches_rows
from kvpot.defaults import RUNNER
from kvpot.engine.decoding import MODES, Decoder, decode_eager, resolve_mode
from kvpot.engine.linear import decoding_numerics, single_row_scope
from kvpot.engine.one_slot import check_runner, core_decodes, generate_in_core
from kvpot.engine.regions import CompiledStep
from kvpot.engine.score import Scoring
from kvpot.engine.text import TextApi
from kvpot.engine.results import Result, ScoreResult, State, Stats, _Run  # noqa: F401 - ScoreResult: public via kvpot
from kvpot.engine.sampling import _as_ids, _eos_ids, _stopping
from kvpot.engine.reading import PromptReader
from kvpot.engine.requests import check_generation
from kvpot.errors import KvpotError
from kvpot.methods import Full, Method, Step
from kvpot.methods.base import Setup
from kvpot.models import architecture_of, load_pretrained, rotary_embedding
from kvpot.models.shapes import head_dim
from kvpot.models.devices import input_device, model_devices, output_device, peak_memory, reset_peak_memory, synchronize
from kvpot.models.parallel import TensorParallel
from kvpot.positions import make_policy
from kvpot.rope import Rope
from kvpot.scoring import token_nll
from kvpot.engine.state_io import model_fingerprint


class Engine(TextApi, Scoring):
    """Runs a Hugging Face causal LM over long inputs with a kvpot method.

    >>> engine = Engine.from_pretrained(path, method=StreamingLLM(sinks=4, window=1020))
    >>> out = engine.generate(context, question="...", max_new_tokens=64)
    >>> out.text, out.stats.max_kv_entries
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer=None,
        method: Method | None = None,
        chat_template: bool | str = "auto",
        decode: str = "auto",
        compile_step: bool = False,
        linear: str = "auto",
        batch_invariant: bool = False,
        runner: str = RUNNER,
    ):
        architecture_of(model.config)
        if chat_template not in (True, False, "auto"):
            raise KvpotError("chat_template must be True, False or 'auto'.")
        if decode not in MODES:
            raise KvpotError(f"decode must be one of {MODES}, got {decode!r}.")
        self.decode = decode  # kvpot.engine.decoding: "auto" = CUDA graphs on a GPU, eager on a CPU
        self.runner = check_runner(runner, decode)  # who decodes one sequence (kvpot.engine.one_slot)
        if not isinstance(compile_step, bool):
            raise KvpotError(f"compile_step must be True or False, got {compile_step!r}.")
        self.compile_step = compile_step
        self._step_decoder, self.core = None, None  # core: `runner="core"`'s scheduler of one slot, kept (one_slot)
        model.set_attn_implementation(register())
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.method = method if method is not None else Full()
        self.chat_template = chat_template
        self.rope = Rope(rotary_embedding(model))
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        # split by accelerate (device_map), each layer's cache lives on its layer's device (kvpot.models.devices)
        self._device, self.output_device = input_device(model), output_device(model)
        self.devices = model_devices(model)
        self.parallel = TensorParallel.of(model)  # sharded by transformers' TP plan (kvpot.models.parallel)
        # decoding's numerics (kvpot.engine.linear): single-token steps' products on kvpot's matrix-vector kernel on a
        # GPU; batch-invariant, each request's numbers the same at any batch (docs/design.md, *Batch-invariant decoding*)
        self.linear, self._linear_devices, self.split_entries = decoding_numerics(
            linear, self._device, self.parallel is not None, batch_invariant, head_dim(model.config), decode)
        self.batch_invariant = batch_invariant

    @classmethod
    def from_pretrained(
        cls,
        name_or_path=None, method: Method | None = None, device: str | None = None, dtype: torch.dtype | None = None,
        chat_template: bool | str = "auto", decode: str = "auto", compile_step: bool = False, linear: str = "auto",
        device_map: str | dict | None = None, max_memory: dict | None = None, gguf_file: str | None = None,
        tp_size: int | None = None, batch_invariant: bool = False, runner: str = RUNNER,
    ) -> Engine:
        """Load a model on `device` (default "cpu"), or split over several by `device_map` ("auto", or a dict
        module -> device) within `max_memory` ({0: "70GiB", ...}); each layer's cache lives on its device.
        The model: a Hub id, a local folder, a named model (`kvpot.models.SMOLLM2_135M` or "smollm2-135m"),
        or a GGUF file (`gguf_file`: a path, or a file name in the folder or Hub repository `name_or_path`),
        de-quantized once into kvpot's cache. `tp_size=N`: sharded by transformers' tensor-parallel plan over the
        N processes of `torchrun --nproc-per-node N`, one engine each (docs/scaling.md, *Tensor parallelism*)."""
        model, tokenizer = load_pretrained(name_or_path, device=device, dtype=dtype, device_map=device_map,
                                           max_memory=max_memory, gguf_file=gguf_file, tp_size=tp_size)
        return cls(model, tokenizer, method=method, chat_template=chat_template, decode=decode,
                   compile_step=compile_step, linear=linear, batch_invariant=batch_invariant, runner=runner)

    def step_decoder(self):
        """The decoder that fixed-shape decoding steps run: with `compile_step`, its decoder layer `torch.compile`d
        once per engine and reused for every layer (`kvpot.engine.regions`), so the norms, activations, residual
        adds and cache writes around the weights fuse into fewer kernels (the step is then captured as before)."""
        if not self.compile_step:
            return self.decoder
        if self._step_decoder is None:
            self._step_decoder = CompiledStep(self.decoder)
        return self._step_decoder

    def single_row(self):
        """The context every single-token forward runs in (eager, static or captured alike, so the decoding
        paths agree): with `linear="gemv"`, its linear layers go through kvpot's kernel."""
        return single_row_scope(self.linear, self._linear_devices)

    @property
    def device(self) -> torch.device:
        return self._device  # where ids and positions live: the input embedding's execution device

    # ------------------------------------------------------------------ token API
    @torch.no_grad()
    def prefill_ids(
        self, input_ids, question_ids=None, progress: bool = False, _max_new_tokens: int = 0, should_stop=None
    ) -> State:
        """Token-level `prefill` of `input_ids` (then `question_ids`); `should_stop` as in `generate_ids`."""
        self._reset_peak_memory()
        reading = self.prefill_steps(input_ids, question_ids, _max_new_tokens, should_stop)
        with tqdm(unit="tok", desc="prefill", disable=not progress, leave=False) as bar:
            while True:
                try:
                    bar.update(next(reading))
                except StopIteration as done:
                    return done.value

    def prefill_steps(self, input_ids, question_ids=None, _max_new_tokens: int = 0, should_stop=None,
                      max_chunk: int | None = None) -> Iterator[int]:
        """`prefill_ids` one model forward per iteration (yields the tokens it read; returns the `State`):
        a server interleaves these forwards with other sequences' decoding steps. `max_chunk` caps a
        forward's tokens where the method's result does not depend on its chunking."""
        with torch.no_grad():
            run, segments = self._start(input_ids, question_ids, self._new_cache, _max_new_tokens, should_stop)
        run.max_chunk = max_chunk
        started = self._clock()
        reading = self._read(run, segments)
        while True:
            with torch.no_grad():  # per forward: the caller's code between them runs as it likes
                size = next(reading, None)
            if size is None:
                break
            yield size
        run.stats.prefill_seconds = self._clock() - started
        with torch.no_grad():
            return self._finish_state(run)

    @torch.no_grad()
    def generate_ids(
        self,
        input_ids=None,
        question_ids=None,
        max_new_tokens: int = 64,
        state: State | None = None,
        on_token: Callable[[int], None] | None = None,
        progress: bool = False,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        keep_state: bool = True,
        should_stop: Callable[[], bool] | None = None,
        time_steps: bool = False,
    ) -> Result:
        """Generate up to `max_new_tokens` after the context (or `state`) and the question.

        Greedy by default (`temperature=0`; otherwise sampling with `top_p`, seeded by `seed`),
        stopping at the model's end-of-sequence tokens unless `ignore_eos` (benchmarks decode a
        fixed count). `token_ids` of the result are the new tokens only. A `state` is copied first
        unless `keep_state=False`, which decodes in its cache and spends it. `should_stop()` is asked
        before every prefill forward and after every token delivered: True raises `kvpot.errors.Cancelled`.
        `time_steps=True` records each step's time in `stats.decode["step_ms"]` (GPU events, no sync). `runner="core"`:
        a request of a scheduler of one slot reads and decodes (`kvpot.engine.one_slot`; step times: the host's)."""
        check_generation(input_ids, state, max_new_tokens, temperature, top_p, seed)
        if core_decodes(self):
            return generate_in_core(self, input_ids, question_ids, state, max_new_tokens, on_token, progress,
                                    should_stop, time_steps, keep_state, temperature=temperature, top_p=top_p,
                                    seed=seed, ignore_eos=ignore_eos)
        if state is None:
            state = self.prefill_ids(input_ids, question_ids, progress=progress, _max_new_tokens=max_new_tokens,
                                     should_stop=should_stop)
            run = _Run(state.cache, state.next_position, state.stats, state.last_logits)
        else:
            run = self._resume(state, question_ids, progress, keep_state, should_stop)
        if should_stop is not None:
            on_token = _stopping(on_token, should_stop)
        return self._decode(run, max_new_tokens, on_token, temperature, top_p, seed, ignore_eos, time_steps)

    # ------------------------------------------------------------------ internals
    def _new_cache(self, total_tokens: int) -> PotCache:
        bound = self.method.max_entries()
        hint = bound if bound is not None else total_tokens
        policy = make_policy(self.method.positions)
        return PotCache(self.model.config.num_hidden_layers, self.rope, policy, capacity_hint=hint, parallel=self.parallel)

    def _resume(self, state: State, question_ids, progress: bool, keep: bool = True, should_stop=None) -> _Run:
        self.check_state(state)
        question = _as_ids(question_ids, self.device, "question_ids")
        cache = state.cache.clone() if keep else state.cache
        if not keep:
            state.cache = None  # spent: decoding appends to (and compresses) this cache
        run = self._resumed(state, cache, question, should_stop)
        if question.numel():
            self._reset_peak_memory()
            started = self._clock()
            with tqdm(total=question.numel(), unit="tok", desc="question", disable=not progress, leave=False) as bar:
                for size in self._read(run, [("question", question)]):
                    bar.update(size)
            run.stats.prefill_seconds += self._clock() - started
        return run

    def _resumed(self, state: State, cache: PotCache, question: torch.Tensor, should_stop=None) -> _Run:
        """A run that continues `state` in `cache` (its copy), its method begun with `question`."""
        run = _Run(cache, state.next_position, dataclasses.replace(state.stats), state.last_logits, should_stop)
        run.stats.question_tokens = question.numel()
        self._begin(run.cache, question if question.numel() else None)
        return run

    def check_state(self, state: State) -> None:
        """Refuse a state this engine cannot continue (spent, or read with another method)."""
        if state.cache is None:
            raise KvpotError("this state was spent by generate(..., keep_state=False); prefill again, or pass "
                             "keep_state=True to ask a state more than once.")
        if state.method_config != self.method.config():
            raise KvpotError(f"this state was prefilled with {state.method_config}, but the engine now runs "
                             f"{self.method.config()}; prefill again with the current method.")

    def _begin(self, cache: PotCache, question: torch.Tensor | None) -> None:
        setup = Setup(self.model.config, self.tokenizer, question, self.device)
        self.method.begin(cache, setup)

    def _start(self, input_ids, question_ids, new_cache: Callable[[int], PotCache], max_new_tokens: int = 0,
               should_stop=None) -> tuple[_Run, list[tuple[str, torch.Tensor]]]:
        """A run that will read `input_ids` (then `question_ids`) into `new_cache(tokens)`, and the
        segments to read: nothing is read yet (`_read` does it, one forward at a time)."""
        context = _as_ids(input_ids, self.device, "input_ids")
        if context.numel() == 0:
            raise KvpotError("the context is empty; give at least one token.")
        question = _as_ids(question_ids, self.device, "question_ids")
        context, question = self.method.prepare(context, question)
        total = context.numel() + question.numel()
        run = _Run(new_cache(total + max_new_tokens), 0, Stats(), should_stop=should_stop)
        self._begin(run.cache, question)
        run.stats.context_tokens, run.stats.question_tokens = context.numel(), question.numel()
        segments = [("context", context)] + ([("question", question)] if question.numel() else [])
        return run, segments

    def _read(self, run: _Run, segments: list[tuple[str, torch.Tensor]]) -> Iterator[int]:
        """Read `segments` into the run's cache, one model forward per iteration (yields its tokens):
        the batched scheduler interleaves these forwards with other sequences' decoding steps."""
        reader = PromptReader(self.method, run, segments)
        while True:
            chunk = reader.peek()
            if chunk is None:
                return
            run.check()  # before each forward (not once more after the last)
            self._forward(run, *chunk)
            yield reader.advance()

    def _forward(self, run: _Run, ids: torch.Tensor, step: Step) -> torch.Tensor:
        """One model forward of `ids` [q] on the cache, then the method's compression.

        Returns the last hidden states [q, hidden] (computed before the compression).
        """
        tail, request = self._before_forward(run, step)
        observation = None
        if tail is None:
            with self.single_row() if ids.numel() == 1 else nullcontext():
                hidden = self._run_model(run, ids, request)  # [q, hidden]
        else:
            hidden, observation = self._forward_with_tail(run, ids, *tail)
        return self._after_forward(run, ids, step, hidden, observation)

    def _before_forward(self, run: _Run, step: Step):
        """The method's work before a forward: (its tail probe or None, the observation it asks for)."""
        self.method.before_forward(run.cache, step)
        tail, request = self.method.tail_probe(run.cache, step), self.method.request(step)
        if tail is not None and request is not None:
            raise KvpotError(f"{self.method.name} asked for an observation and a tail probe in one forward.")
        return tail, request

    def _after_forward(self, run: _Run, ids: torch.Tensor, step: Step, hidden: torch.Tensor,
                       observation=None, heads: tuple | None = None) -> torch.Tensor:
        """After a forward of `ids` gave `hidden` [q, hidden]: the run's logits and position, then the method's
        compression (`after_forward`). `heads`: (the last logits [vocab], the tokens' -log p or None) where the mixed
        step computed its chunks' at once (`kvpot.engine.mixed.chunk_heads`). Returns `hidden`."""
        if heads is None:
            with self.single_row() if ids.numel() == 1 else nullcontext():  # as the decoding paths' head
                heads = (self.head(hidden[-1]).float(),
                         self._token_nll(run.logits, hidden, ids) if self.method.needs_token_nll else None)
        logits, token_nll = heads
        run.logits = logits
        run.next_position += ids.numel()
        step = dataclasses.replace(step, token_nll=token_nll, tail_observation=observation,
                                   probe=lambda probe_ids, request, cache=None: self.probe(
                                       cache if cache is not None else run.cache, run.next_position, probe_ids,
                                       request))
        # timed with device events, read once at the end: a sync here would stall the chunk loop
        begun = self._mark()
        if self.method.after_forward(run.cache, step):
            run.stats.compressions += 1
            run.compress_marks.append((begun, self._mark()))
        run.cache.begin_forward(None, -1, None)
        return hidden

    def _forward_with_tail(self, run: _Run, ids: torch.Tensor, tail_ids, request: AttentionRequest):
        """One forward of `ids` followed by probe tokens `tail_ids`; the probe's entries rolled back.

        Returns the hidden states of `ids` [q, hidden] and, per layer, the probe's attention over
        the entries before it (cache and `ids`).
        """
        tail_ids = _as_ids(tail_ids, self.device, "tail probe ids")
        q, m = ids.numel(), tail_ids.numel()
        start, _, _ = slice(*(request.rows or (None, None))).indices(q + m)
        if m == 0 or start < q:
            raise KvpotError("a tail probe must observe its own rows only (rows=(-len(ids), None)).")
        before = [n + q for n in run.cache.lengths()]  # entries the probe may score
        hidden = self._run_model(run, torch.cat([ids, tail_ids]), request)
        observation = [layer.observation[..., :n] for layer, n in zip(run.cache.layers, before)]
        run.cache.truncate(before)
        return hidden[:q], observation

    def _token_nll(self, previous_logits, hidden: torch.Tensor, ids: torch.Tensor, rest=None) -> torch.Tensor:
        """-log p(x_t | cache) for the forward's tokens [q]; the first uses the previous logits (0 for the very first
        token of a stream, which nothing predicts). `rest`: the later tokens' [q - 1], if computed already."""
        nll = torch.zeros(ids.numel(), dtype=torch.float32, device=ids.device)
        if previous_logits is not None:
            first = ids[:1].to(previous_logits.device)  # logits live on the head's device
            nll[0] = torch.nn.functional.cross_entropy(previous_logits.view(1, -1), first).to(nll.device)
        nll[1:] = (token_nll(self.head, hidden[:-1], ids[1:]) if rest is None else rest).to(nll.device)
        return nll

    def _run_model(self, run: _Run, ids: torch.Tensor, request: AttentionRequest | None) -> torch.Tensor:
        """The decoder over `ids` [q] at positions `run.next_position...`; last hidden states [q, h]."""
        q, cache = ids.numel(), run.cache
        positions = torch.arange(run.next_position, run.next_position + q, device=ids.device)
        cache.begin_forward(positions, run.next_position + q - 1, request)
        zeros = torch.zeros(1, q, dtype=torch.long, device=ids.device)  # RoPE is applied by kvpot
        out = self.decoder(input_ids=ids.view(1, q), position_ids=zeros, use_cache=True, kvpot_cache=cache,
                           **cache_kwargs(self.decoder, cache))
        return out.last_hidden_state[0]

    @torch.no_grad()
    def probe(self, cache: PotCache, next_position: int, ids, request: AttentionRequest) -> list[torch.Tensor]:
        """Run `ids` on top of `cache`, read their attention, then roll their entries back.

        One mechanism for InfiniPot's catalyst prompt, CItruS' instruction and SnapKV-style
        observation windows (docs/design.md, "Probes"). The probe tokens take the positions that would
        follow the cache (`next_position` onwards); their entries count towards the cache's
        `max_entries` while they exist. Returns, per layer, the observation restricted to the
        entries that were cached before the probe (`[b, kv_heads, n_layer]`). Rollback leaves the
        cache bit-for-bit as it was.
        """
        ids = _as_ids(ids, self.device, "probe ids")
        if ids.numel() == 0:
            raise KvpotError("a probe needs at least one token.")
        lengths = cache.lengths()
        run = _Run(cache, next_position, Stats())
        try:
            self._run_model(run, ids, request)
            return [layer.observation[..., :n] for layer, n in zip(cache.layers, lengths)]
        finally:
            cache.truncate(lengths)
            cache.begin_forward(None, -1, None)

    def _finish_state(self, run: _Run) -> State:
        self._settle(run)
        run.stats.max_kv_entries = run.cache.max_entries
        run.stats.final_kv_entries = max(run.cache.lengths())
        run.stats.peak_memory_by_device, run.stats.peak_memory_bytes = peak_memory(self.devices)
        fingerprint = model_fingerprint(self.model)
        return State(run.cache, run.next_position, run.logits, self.method.config(), run.stats, fingerprint)

    def _decode(self, run: _Run, max_new_tokens, on_token, temperature, top_p, seed, ignore_eos,
                time_steps=False) -> Result:
        eos = set() if ignore_eos else _eos_ids(self.model)
        # a model split over several GPUs decodes eagerly: one captured step would span devices; batch-invariant, a
        # method whose rows a batch steps eagerly (InfLLM, InfiniteHiP) decodes so alone too
        batched = batches_rows(self, make_policy(self.method.positions))
        eager = len(self.devices) > 1 or self.batch_invariant and not batched
        mode = "eager" if eager else resolve_mode(self.decode, self.device)
        started = self._clock()
        if mode == "eager" or max_new_tokens == 0:
            times: list[float] | None = [] if time_steps else None
            tokens = decode_eager(self, run, max_new_tokens, on_token, temperature, top_p, seed, eos, times)
            report = {"mode": "eager", "runner": "sequence", "step_ms": times}
        else:
            decoder = Decoder(self, run, max_new_tokens, temperature, top_p, seed, eos, mode, time_steps=time_steps)
            tokens = decoder.generate(on_token)
            report = {"mode": mode, "runner": "sequence", **decoder.report.to_dict()}
        stats = run.stats
        stats.decode_seconds = self._clock() - started
        self._settle(run)
        stats.new_tokens = len(tokens)
        stats.max_kv_entries = run.cache.max_entries
        stats.final_kv_entries = max(run.cache.lengths())
        stats.peak_memory_by_device, stats.peak_memory_bytes = peak_memory(self.devices)
        stats.method = self.method.report(run.cache)
        stats.decode = report
        text = self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else None
        return Result(text, tokens, stats)

    def _mark(self):
        """A point in time without a sync: a recorded CUDA event, or the host clock on a CPU."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _settle(self, run: _Run) -> None:
        """Add the compressions timed since the last settle to `stats.compress_seconds`."""
        for begun, ended in run.compress_marks:
            if isinstance(begun, float):
                run.stats.compress_seconds += ended - begun
            else:
                ended.synchronize()
                run.stats.compress_seconds += begun.elapsed_time(ended) / 1000
        run.compress_marks.clear()

    def _clock(self) -> float:
        synchronize(self.devices)  # a split model: every GPU's work so far
        return time.perf_counter()

    def _reset_peak_memory(self) -> None:
        reset_peak_memory(self.devices)
