"""`kvpot serve`'s configuration, validated when it is built."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kvpot.defaults import (FEED_QUESTIONS, FEED_QUESTIONS_CHOICES, LAUNCH_AHEAD, LAUNCH_AHEADS, MIX, MIXES, PREFILL_TOKENS,
                            PROMPT_ORDER, PROMPT_ORDERS, PROMPT_PATIENCE)
from kvpot.errors import KvpotError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_bytes(text: str | int, what: str) -> int:
    """`4GiB`, `512MB`, `1000000` -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise KvpotError(f"{what}: {text!r} is not a size; write e.g. 4GiB, 512MB or 1000000.")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass
class ServeConfig:
    """What `kvpot serve` runs with (the CLI flags, one for one)."""

    model: str | None = None  # path or Hugging Face id; None: the bundled reference model
    method: str = "infinipot:pot_size=4096"  # a method spec (`name:key=value,...`); bounded by default
    host: str = "127.0.0.1"
    port: int = 8000
    device: str | None = None
    dtype: str = "auto"
    chat_template: str = "auto"  # auto, on, off
    served_model_name: str | None = None  # the id /v1/models lists; default: the model's name
    api_key: str | None = None  # requests must carry `Authorization: Bearer <key>`
    max_queue: int = 64  # requests waiting beyond a pool's slots (and documents waiting to be read); beyond: 429
    max_slots: int | None = None  # sequences decoding at once with the server's method; None: what fits
    kv_memory_fraction: float = 0.7  # of the GPU memory free after loading, for the method's slots (max_slots None)
    method_slots: int = 4  # slots of the pool made for another method (a document read with it)
    prefill_tokens: int = PREFILL_TOKENS  # prompt tokens read per step beside the decoding rows (chunked prefill)
    mix: str = MIX  # prompt chunks in the decoding rows' forward: auto (a CUDA GPU), on, off (Scheduler)
    prompt_order: str = PROMPT_ORDER  # which prompts a step reads first: arrival or shortest (Scheduler)
    prompt_patience: float = PROMPT_PATIENCE  # shortest first: seconds after which a prompt goes first (Scheduler)
    launch_ahead: str = LAUNCH_AHEAD  # a decode-only step launched before the last one's tokens are handed over
    slot_capacity: int | None = None  # KV entries per slot for methods whose cache grows with the input
    feed_questions: str = FEED_QUESTIONS  # a stored document's questions: mixed chunks or fed (Scheduler, defaults)
    feed_tokens: int = 64  # the longest question fed so
    share_documents: bool = False  # a stored document's readers share one copy of its entries (Scheduler)
    reader_room: int | None = None  # tail slots: KV entries such a reader holds of its own (Scheduler reader_room)
    max_context_tokens: int = 1 << 20  # prompt tokens (context + question); beyond: 413
    max_body_bytes: int = 64 * 1024**2  # request bodies beyond: 413
    max_tokens_limit: int = 8192  # largest max_tokens a request may ask for
    default_max_tokens: int = 512  # chat completions without max_tokens
    state_memory: int = 4 * 1024**3  # bytes of prefilled states kept in memory; LRU out
    state_dir: Path | None = None  # where states spill and persist; None: memory only
    state_disk: int | None = None  # bytes of states kept in state_dir (None: no limit); LRU out
    cache_min_tokens: int = 1024  # contexts shorter than this are read for each request, not stored
    read_timeout: float = 30.0  # seconds for a request's headers, and then for its body (408 beyond)
    shutdown_grace: float = 30.0  # seconds requests in flight get to finish after SIGTERM
    allowed_hosts: tuple[str, ...] = ()  # without an API key: Host values served beside loopback ("*": any)
    tp_timeout: float = 600.0  # tensor parallelism: seconds a rank waits for the others' turn before giving up
    state_dir_shared: bool = False  # other servers use state_dir too (replicas: kvpot.serve.cluster), not a flag

    def __post_init__(self):
        for name in ("max_context_tokens", "max_body_bytes", "max_tokens_limit", "default_max_tokens",
                     "state_memory", "cache_min_tokens", "method_slots", "prefill_tokens", "feed_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise KvpotError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}.")
        if self.reader_room is not None and not self.share_documents:
            raise KvpotError("--reader-room sizes the slots of a shared document's readers: give --share-documents.")
        for name in ("max_slots", "slot_capacity", "reader_room"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise KvpotError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}.")
        for name in ("read_timeout", "shutdown_grace", "tp_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise KvpotError(f"--{name.replace('_', '-')} must be a number of seconds >= 0, got {value!r}.")
        if self.read_timeout == 0 or self.tp_timeout == 0:
            raise KvpotError(f"--{'read' if self.read_timeout == 0 else 'tp'}-timeout must be positive.")
        if self.mix not in MIXES:
            raise KvpotError(f"--mix must be one of {', '.join(MIXES)}, got {self.mix!r}.")
        self.allowed_hosts = tuple(h.strip().lower() for h in self.allowed_hosts if h.strip())
        if not 0 < self.kv_memory_fraction <= 1:
            raise KvpotError(f"--kv-memory-fraction must be in (0, 1], got {self.kv_memory_fraction!r}.")
        if self.max_queue < 0:
            raise KvpotError(f"--max-queue must be >= 0, got {self.max_queue}.")
        if not 0 <= self.port <= 65535:
            raise KvpotError(f"--port must be in 0..65535, got {self.port}.")
        if self.state_disk is not None and self.state_disk <= 0:
            raise KvpotError("--state-disk must be a positive size.")
        if self.state_disk is not None and self.state_dir is None:
            raise KvpotError("--state-disk needs --state-dir.")
        if self.feed_questions not in FEED_QUESTIONS_CHOICES:
            raise KvpotError(f"--feed-questions must be auto, always or never, got {self.feed_questions!r}.")
        if self.launch_ahead not in LAUNCH_AHEADS:
            raise KvpotError(f"--launch-ahead must be one of {', '.join(LAUNCH_AHEADS)}, got {self.launch_ahead!r}.")
        if self.prompt_order not in PROMPT_ORDERS:
            raise KvpotError(f"--prompt-order must be {' or '.join(PROMPT_ORDERS)}, got {self.prompt_order!r}.")
        from kvpot.engine.plan import check_patience  # the scheduler's own test, under the flag's name

        check_patience(self.prompt_patience, "--prompt-patience")
        if self.chat_template not in ("auto", "on", "off"):
            raise KvpotError("--chat-template must be auto, on or off.")
        if self.default_max_tokens > self.max_tokens_limit:
            self.default_max_tokens = self.max_tokens_limit
        if self.state_dir is not None:
            self.state_dir = Path(self.state_dir)
            try:
                self.state_dir.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise KvpotError(f"--state-dir {self.state_dir}: cannot create it ({err}).") from None


@dataclass(frozen=True)
class EngineRecipe:
    """How a server loads its engine (the CLI's model flags): sent to each replica, which loads its own."""

    model: str | None = None
    method: str = "infinipot:pot_size=4096"
    device: str | None = None
    dtype: str = "auto"
    chat_template: str = "auto"  # auto, on, off
    decode: str = "auto"
    compile_step: bool = False
    linear: str = "auto"
    batch_invariant: bool = False  # Engine(batch_invariant=...): each request's numbers the same at any batch
    tp: int = 1  # tensor parallelism over the processes of one torchrun (kvpot.serve.parallel)

    def check(self, config: ServeConfig) -> None:
        """What this engine cannot serve with `config`, refused before a model loads (the CLI, Ray Serve's builder)."""
        mixing = config.mix in ("on", "eager")
        if self.batch_invariant and (mixing or config.feed_questions == "always"):
            raise KvpotError("--batch-invariant reads prompts and questions as one request alone does: it does not run "
                             "with --mix on or --feed-questions always.")
        from kvpot.engine.linear import check_invariant_options

        check_invariant_options(self.batch_invariant, self.linear, self.tp)

    def build(self):
        """The engine (the model loaded on `device`, or this rank's shard with `tp` > 1); an error if its
        tokenizer is missing (a server needs one)."""
        from kvpot.engine import Engine
        from kvpot.methods.spec import build_method
        from kvpot.models.support import resolve_device, resolve_dtype, resolve_model

        template = {"auto": "auto", "on": True, "off": False}[self.chat_template]
        engine = Engine.from_pretrained(resolve_model(self.model), method=build_method(self.method),
                                        device=resolve_device(self.device), dtype=resolve_dtype(self.dtype),
                                        chat_template=template, decode=self.decode, compile_step=self.compile_step,
                                        linear=self.linear, tp_size=self.tp, batch_invariant=self.batch_invariant)
        if engine.tokenizer is None:
            raise KvpotError(f"{resolve_model(self.model)} has no tokenizer; kvpot serve needs one.")
        return engine
