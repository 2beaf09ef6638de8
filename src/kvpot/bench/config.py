"""What `kvpot bench` is asked: the mode, the shape, the methods and lengths, validated in `BenchConfig`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvpot.bench.backends import DEFAULT_SDPA, SDPA_CHOICES
from kvpot.defaults import FEED_QUESTIONS, LAUNCH_AHEAD, MIX, PREFILL_TOKENS, PROMPT_ORDER, PROMPT_PATIENCE, RUNNER
from kvpot.errors import KvpotError


MODES = ("prefill", "decode", "attention", "throughput")

# Baselines measured beside kvpot's methods (kvpot.bench.baselines runs them)
BASELINES = ("hf", "kvpress")
KVPRESS_PRESSES = ("snapkv", "expected_attention", "streaming_llm", "pyramidkv")
DEFAULT_KEPT = 4096


def baseline_labels(config) -> list[str]:
    labels: list[str] = []
    for name in config.baselines:
        labels += ["hf"] if name == "hf" else [f"kvpress:{press}" for press in KVPRESS_PRESSES]
    return labels



FLOOR = "floor"


DEFAULT_LENGTHS = "4k,32k,128k"


# Length of the untimed warm-up prefill of every method: two full 2,048-token chunks, so the
# kernels of the timed chunk shapes are chosen and loaded before timing (1,024 tokens left the
# first timed floor run on an H100 ~70% slow).
WARMUP_TOKENS = 4096


def check_load(config) -> None:
    """The open-loop options (`bench throughput` and `bench serve`); a length mix replaces --lengths by its
    longest length (the row's `length`; each request draws its own)."""
    from kvpot.bench.load import mix_bounds

    if config.arrival_rate is not None and not config.arrival_rate > 0:
        raise KvpotError(f"--arrival-rate must be positive (or inf), got {config.arrival_rate}.")
    for name, value in (("--slo-ttft", config.slo_ttft), ("--slo-itl", config.slo_itl)):
        if value is not None and not value > 0:
            raise KvpotError(f"{name} must be a positive number of seconds, got {value}.")
    if config.new_tokens_mix:
        # what a row records as its most; each request draws its own
        config.new_tokens = mix_bounds(config.new_tokens_mix, "--new-tokens-mix")[1]
    if getattr(config, "share_documents", False) and not config.document:
        raise KvpotError("--share-documents shares one stored document among its readers: give --document.")
    if getattr(config, "reader_room", None) is not None and not config.share_documents:
        raise KvpotError("--reader-room sizes the slots of a shared document's readers: give --share-documents.")
    if getattr(config, "batch_invariant", False) and (getattr(config, "linear", "auto") != "auto" or
                                                      getattr(config, "tp", 1) > 1):
        raise KvpotError("--batch-invariant chooses the linear layers' kernel itself and does not run under tensor "
                         "parallelism: drop --linear / --tp.")
    if getattr(config, "batch_invariant", False) and (config.mix in ("on", "eager") or config.mixed):
        raise KvpotError("--batch-invariant reads prompts as one request alone does: it does not run with --mix on or "
                         "--mixed.")
    if config.length_mix:
        if config.document:
            raise KvpotError("--length-mix draws a context length per user; with --document every user reads one "
                             "document (give its length with --lengths).")
        config.lengths = [mix_bounds(config.length_mix, "--length-mix")[1]]


@dataclass
class BenchConfig:
    """The resolved `kvpot bench` request, saved in results.json."""

    mode: str
    shape: str
    out: Path
    methods: list[str] = field(default_factory=list)
    lengths: list[int] = field(default_factory=lambda: [4096])
    budget: int | None = None
    settings: dict[str, str] = field(default_factory=dict)
    device: str = "cpu"
    dtype: str = "auto"
    device_map: str | None = None  # split the shape over GPUs (accelerate) instead of `device`
    max_memory: dict | None = None  # with device_map: {0: "70GiB", 1: "70GiB"}
    model_devices: str | None = None  # set by run_bench: "cuda:0,cuda:1" for a split model
    tp: int = 1  # tensor parallelism over `tp` torchrun processes (transformers' TP plan), one GPU each
    repeats: int = 1
    decode_steps: int = 64
    warmup_steps: int = 8
    question_tokens: int = 32
    floor: bool = True
    floor_chunk: int = 2048
    block: int = 128
    min_time: float = 0.2
    threads: int | None = None
    seed: int = 0
    profile: bool = False
    breakdown: bool = False  # decode: a step's time by part (kvpot.bench.breakdown)
    decode: str = "auto"  # the engine's decoding path (kvpot.engine.decoding)
    runner: str = RUNNER  # who decodes one sequence (`Engine(runner=...)`, kvpot.engine.one_slot)
    compile_step: bool = False  # torch.compile the fixed-shape step's decoder (Engine(compile_step=True))
    linear: str = "auto"  # single-token linear layers (Engine(linear=...), kvpot.engine.linear)
    batch_invariant: bool = False  # decode and throughput: Engine(batch_invariant=True), what it costs
    baselines: list[str] = field(default_factory=list)  # "hf", "kvpress" (kvpot.bench.baselines)
    # folder holding transformers 5.2 + kvpress (benchmarks/kvpress-env/make_wheels.sh): the kvpress
    # baseline rows run in a second Python process with it first on PYTHONPATH; None: no kvpress rows
    kvpress_path: Path | None = None
    # throughput (kvpot.bench.throughput): the workload and the scheduler
    users: int = 16
    new_tokens: int = 128
    document: bool = False  # every user asks about one stored document of each length
    slots: int | None = None  # sequences decoding at once (None: every user, within free memory)
    prefill_tokens: int = PREFILL_TOKENS  # prompt tokens the scheduler reads per step
    sequential_users: int | None = None  # users the one-at-a-time row serves (None: all)
    hf_timeout: float = 200.0  # seconds before transformers' continuous batching is stopped
    mix: str = MIX  # the [batch] rows' Scheduler(mix=...): auto, on, off
    prompt_order: str = PROMPT_ORDER  # the [batch] rows' Scheduler(prompt_order=...): arrival, shortest
    prompt_patience: float = PROMPT_PATIENCE  # the [batch] rows' Scheduler(prompt_patience=...)
    launch_ahead: str = LAUNCH_AHEAD  # the [batch] rows' Scheduler(launch_ahead=...): auto, on, off
    feed_questions: str = FEED_QUESTIONS  # the [batch] rows' Scheduler(feed_questions=...): auto, always, never
    mixed: bool = False  # a row of the batch that reads prompt chunks in the decoding rows' forward (mix on)
    prompts_apart: bool = False  # a row of the batch that reads them in forwards of their own (mix off)
    share_documents: bool = False  # with --document, a row whose readers share the document (share_documents=True)
    reader_room: int | None = None  # that row's tail slots: KV entries a reader holds of its own (Scheduler)
    # open-loop load (kvpot.bench.load): Poisson arrivals, per-request mixes, SLOs
    arrival_rate: float | None = None  # requests per second; None (`inf`): all at once
    length_mix: str | None = None  # `2k,8k,32k` (drawn from the list) or `2k-32k` (a uniform range)
    new_tokens_mix: str | None = None  # `64,256` or `64-256`
    slo_ttft: float | None = None  # seconds from arrival to the first token
    slo_itl: float | None = None  # seconds: a request's own p99 inter-token gap
    # SDPA's backends for every row of the run (kvpot.bench.backends): no cuDNN plan built per decoding step
    sdpa: str = DEFAULT_SDPA

    def __post_init__(self):
        from kvpot.models.shapes import get_shape

        self.out = Path(self.out)
        if self.mode not in MODES:
            raise KvpotError(f"unknown mode {self.mode!r}; choose one of: {', '.join(MODES)}.")
        get_shape(self.shape)
        if self.tp > 1 and self.mode == "attention":
            raise KvpotError("bench attention times one layer on one device; --tp applies to prefill, decode and "
                             "throughput.")
        if self.device_map is not None and self.mode == "attention":
            raise KvpotError("bench attention times one layer on one device; --device-map applies to prefill and decode.")
        if self.mode != "attention" and not self.methods:
            raise KvpotError(f"bench {self.mode} needs at least one --method (e.g. --method full --method streaming).")
        for name, value, low in (("--repeats", self.repeats, 1), ("--decode-steps", self.decode_steps, 1),
                                 ("--warmup-steps", self.warmup_steps, 0), ("--question-tokens", self.question_tokens, 0),
                                 ("--floor-chunk", self.floor_chunk, 1), ("--block", self.block, 1)):
            if value < low:
                raise KvpotError(f"{name} must be at least {low}, got {value}.")
        for name, value in (("--users", self.users), ("--new-tokens", self.new_tokens),
                            ("--prefill-tokens", self.prefill_tokens), ("--slots", self.slots or 1),
                            ("--sequential-users", self.sequential_users or 1)):
            if value < 1:
                raise KvpotError(f"{name} must be at least 1, got {value}.")
        check_load(self)
        if self.hf_timeout <= 0:
            raise KvpotError(f"--hf-timeout must be positive, got {self.hf_timeout}.")
        if self.baselines and self.mode == "throughput" and "kvpress" in self.baselines:
            raise KvpotError("bench throughput compares with transformers' continuous batching (--baseline hf); "
                             "kvpress serves one sequence at a time.")
        if self.threads is not None and self.threads < 1:
            raise KvpotError(f"--threads must be at least 1, got {self.threads}.")
        if self.min_time <= 0:
            raise KvpotError(f"--min-time must be positive, got {self.min_time}.")
        if self.budget is not None and self.budget <= 0:
            raise KvpotError(f"the budget must be a positive number of KV entries, got {self.budget}.")
        from kvpot.engine.decoding import MODES as DECODE_MODES

        unknown = [b for b in self.baselines if b not in BASELINES]
        if unknown:
            raise KvpotError(f"unknown baseline {unknown[0]!r}; choose from: {', '.join(BASELINES)}.")
        if self.baselines and self.mode == "attention":
            raise KvpotError("--baseline applies to bench prefill and decode.")
        if self.breakdown and self.mode != "decode":
            raise KvpotError("--breakdown applies to bench decode.")
        if self.decode not in DECODE_MODES:
            raise KvpotError(f"--decode must be one of {', '.join(DECODE_MODES)}, got {self.decode!r}.")
        if self.linear not in ("auto", "gemv", "torch"):
            raise KvpotError(f"--linear must be auto, gemv or torch, got {self.linear!r}.")
        if self.sdpa not in SDPA_CHOICES:
            raise KvpotError(f"--sdpa must be one of {', '.join(SDPA_CHOICES)}, got {self.sdpa!r}.")
        if not self.lengths:
            raise KvpotError("--lengths is empty; give lengths such as 32k,128k.")
        if self.kvpress_path is not None:
            self.kvpress_path = Path(self.kvpress_path)
            if not self.kvpress_path.is_dir():
                raise KvpotError(f"--kvpress-path {self.kvpress_path} is not a folder; give the folder the kvpress "
                                 "wheels were installed into (pip install --no-deps --target DIR).")
        if not self.out.parent.is_dir():
            raise KvpotError(f"--out {self.out}: the folder {self.out.parent} does not exist; create it first.")
        if self.out.exists() and not self.out.is_dir():
            raise KvpotError(f"--out {self.out} is a file; give a folder to write results into.")

    @property
    def devices(self) -> str:
        """Every device the model runs on, comma-separated: what timing waits for and memory sums over."""
        return self.model_devices or self.device

    def to_dict(self) -> dict:
        data = asdict(self)
        data["out"] = str(self.out)
        data["kvpress_path"] = None if self.kvpress_path is None else str(self.kvpress_path)
        data["prompt_patience"] = json_seconds(self.prompt_patience)
        return data


def json_seconds(value: float) -> float | str:
    """A duration as results.json holds it: "inf" for an unbounded one (`--prompt-patience inf`), since JSON has no
    infinity (Python would write `Infinity`, which jq and strict readers refuse); `float()` reads both back."""
    return value if value != float("inf") else "inf"
