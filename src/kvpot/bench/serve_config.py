"""What `kvpot bench serve` is asked, validated in `ServeBenchConfig`: a server to drive (`url`) or
kvpot's own to launch (`shape`/`model` + `methods`), and the workload its users send."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvpot.defaults import FEED_QUESTIONS, LAUNCH_AHEAD, MIX, PREFILL_TOKENS, PROMPT_ORDER, PROMPT_PATIENCE
from kvpot.errors import KvpotError

MODE = "serve"


@dataclass
class ServeBenchConfig:
    """The resolved `kvpot bench serve` request, saved in results.json."""

    out: Path
    url: str | None = None  # a running OpenAI-compatible server; None: launch kvpot's in this process
    api_key: str | None = None
    served_model: str | None = None  # the model id requests name (None: the first of GET /v1/models)
    ignore_eos: bool = False  # --url: send `ignore_eos: true` (vLLM honours it)
    # launched server: kvpot's engine on a random-weight shape, or on a checkpoint (`model`)
    shape: str = "tiny"
    model: str | None = None
    methods: list[str] = field(default_factory=list)
    budget: int | None = None
    settings: dict[str, str] = field(default_factory=dict)
    device: str | None = None
    dtype: str = "auto"
    decode: str = "auto"
    slots: int | None = None  # the server's (and the engine row's) sequences at once
    prefill_tokens: int = PREFILL_TOKENS
    mix: str = MIX  # the launched server's and the engine row's Scheduler(mix=...)
    prompt_order: str = PROMPT_ORDER  # the launched server's and the engine row's Scheduler(prompt_order=...)
    prompt_patience: float = PROMPT_PATIENCE  # theirs too: Scheduler(prompt_patience=...)
    launch_ahead: str = LAUNCH_AHEAD  # theirs too: Scheduler(launch_ahead=...)
    feed_questions: str = FEED_QUESTIONS  # theirs too: Scheduler(feed_questions=...)
    threads: int | None = None
    seed: int = 0
    # the workload
    lengths: list[int] = field(default_factory=lambda: [4096])
    users: int = 16
    new_tokens: int = 128
    question_tokens: int = 32
    document: bool = False  # one uploaded document every user asks about
    upload_during: int | None = None  # tokens of a second document uploaded while the users decode
    timeout: float = 600.0  # seconds per request
    # open-loop load (kvpot.bench.load), as `bench throughput`'s
    arrival_rate: float | None = None
    length_mix: str | None = None
    new_tokens_mix: str | None = None
    slo_ttft: float | None = None
    slo_itl: float | None = None

    def __post_init__(self):
        from kvpot.bench.config import check_load

        self.out = Path(self.out)
        self._check_counts()
        check_load(self)
        if self.url is not None:
            self._check_url()
        else:
            self._check_launch()
        if not self.lengths:
            raise KvpotError("--lengths is empty; give lengths such as 4k,32k.")
        if not self.out.parent.is_dir():
            raise KvpotError(f"--out {self.out}: the folder {self.out.parent} does not exist; create it first.")
        if self.out.exists() and not self.out.is_dir():
            raise KvpotError(f"--out {self.out} is a file; give a folder to write results into.")

    def _check_counts(self) -> None:
        for name, value, low in (("--users", self.users, 1), ("--new-tokens", self.new_tokens, 1),
                                 ("--prefill-tokens", self.prefill_tokens, 1), ("--slots", self.slots or 1, 1),
                                 ("--upload-during", self.upload_during or 1, 1), ("--threads", self.threads or 1, 1),
                                 ("--question-tokens", self.question_tokens, 0),
                                 *(("--lengths", n, 1) for n in self.lengths)):
            if value < low:
                raise KvpotError(f"{name} must be at least {low}, got {value}.")
        if self.document and self.question_tokens < 1:
            raise KvpotError("with --document a user sends only its question: --question-tokens must be at least 1.")
        if self.timeout <= 0:
            raise KvpotError(f"--timeout must be positive, got {self.timeout}.")
        if self.budget is not None and self.budget <= 0:
            raise KvpotError(f"the budget must be a positive number of KV entries, got {self.budget}.")

    def _check_url(self) -> None:
        self.url = self.url.rstrip("/").removesuffix("/v1")
        if not self.url.startswith(("http://", "https://")):
            raise KvpotError(f"--url {self.url!r}: give the server's address, e.g. http://127.0.0.1:8000.")
        if self.methods or self.model:
            raise KvpotError("--method and --model choose what a launched server runs; a --url server runs its own "
                             "(drop them, or drop --url to launch kvpot's).")

    def _check_launch(self) -> None:
        from kvpot.engine.decoding import MODES as DECODE_MODES
        from kvpot.models.shapes import get_shape

        if self.model is None:
            get_shape(self.shape)
        if not self.methods:
            raise KvpotError("bench serve launches kvpot's server for each --method (e.g. --method infinipot); "
                             "or give --url to drive a running server.")
        if self.ignore_eos:
            raise KvpotError("--ignore-eos applies to --url servers; a launched kvpot server is sent it when it "
                             "accepts it.")
        if self.decode not in DECODE_MODES:
            raise KvpotError(f"--decode must be one of {', '.join(DECODE_MODES)}, got {self.decode!r}.")

    @property
    def mode(self) -> str:
        return MODE

    @property
    def launched(self) -> bool:
        return self.url is None

    def engine_config(self, device: str, devices: str):
        """The `kvpot bench throughput` configuration of the `[engine]` rows: the same workload."""
        from kvpot.bench.config import BenchConfig

        config = BenchConfig(
            mode="throughput", shape=self.shape, out=self.out, methods=list(self.methods), lengths=list(self.lengths),
            budget=self.budget, settings=dict(self.settings), device=device, dtype=self.dtype, seed=self.seed,
            decode=self.decode, threads=self.threads, users=self.users, new_tokens=self.new_tokens,
            question_tokens=self.question_tokens, document=self.document, slots=self.slots,
            prefill_tokens=self.prefill_tokens, mix=self.mix, prompt_order=self.prompt_order,
            prompt_patience=self.prompt_patience, launch_ahead=self.launch_ahead, feed_questions=self.feed_questions,
            arrival_rate=self.arrival_rate,
            length_mix=self.length_mix, new_tokens_mix=self.new_tokens_mix, slo_ttft=self.slo_ttft, slo_itl=self.slo_itl)
        config.model_devices = devices
        return config

    def to_dict(self) -> dict:
        data = asdict(self)
        data["out"] = str(self.out)
        data["api_key"] = None if self.api_key is None else "(given)"  # never written to results
        data["mode"] = MODE
        from kvpot.bench.config import json_seconds

        data["prompt_patience"] = json_seconds(self.prompt_patience)
        return data
