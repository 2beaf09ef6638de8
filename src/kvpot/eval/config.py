"""What `kvpot eval` is asked: lengths, depths, task options, and the validated `EvalConfig`.

Lengths are written in binary units (`2k` = 2048, `1m` = 1048576) by every command that takes
them (`eval`, `bench`, `demo`), which parse them here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpot.defaults import MIXES
from kvpot.errors import KvpotError


PERPLEXITY = "perplexity"

DEFAULT_LENGTHS = "2k,8k,32k"

DEFAULT_PERPLEXITY_LENGTH = "32k"

DEFAULT_DEPTHS = "0.1,0.5,0.9"

DEFAULT_TEMPLATES = "all"  # the prompt's wording is part of the protocol (issue 32), not a fixed choice

ANSWER_SLACK_TOKENS = 8  # generated beyond the answer's own tokens (punctuation, a space, EOS)

_LENGTH = re.compile(r"(\d+(?:\.\d+)?)([km]?)")

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20}


def parse_length(text: str) -> int:
    """Tokens from `4096`, `2k` (2048), `128K`, `1m` (1048576) or `1.5k` (1536): binary units."""
    match = _LENGTH.fullmatch(str(text).strip().lower())
    if not match:
        raise KvpotError(f"{text!r} is not a length; write tokens as 4096, 2k, 128K or 1m.")
    value = float(match.group(1)) * _UNITS[match.group(2)]
    if value < 1 or not value.is_integer():
        raise KvpotError(f"{text!r} is not a whole positive number of tokens.")
    return int(value)


def parse_lengths(text: str) -> list[int]:
    """`--lengths 2k,8k,32k` as sorted, distinct token counts."""
    parts = [p for p in str(text).split(",") if p.strip()]
    if not parts:
        raise KvpotError("--lengths is empty; give lengths such as 2k,8k,32k.")
    return sorted({parse_length(p) for p in parts})


def parse_depths(text: str) -> list[float]:
    """`--depths 0.1,0.5,0.9` as sorted, distinct fractions of the context in [0, 1]."""
    depths = set()
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        try:
            depth = float(part)
        except ValueError:
            raise KvpotError(f"--depths: {part!r} is not a number; give fractions such as 0.1,0.5,0.9.") from None
        if not 0.0 <= depth <= 1.0:
            raise KvpotError(f"--depths: {part} is outside [0, 1]; a depth is a fraction of the context.")
        depths.add(depth)
    if not depths:
        raise KvpotError("--depths is empty; give fractions such as 0.1,0.5,0.9.")
    return sorted(depths)


def parse_templates(text: str) -> list[int] | None:
    """`--templates all` -> None (every template of the task), `0,2` -> [0, 2] (sorted, distinct)."""
    if str(text).strip().lower() == "all":
        return None
    try:
        picked = {int(p) for p in str(text).split(",") if p.strip()}
    except ValueError:
        raise KvpotError(f"--templates {text!r}: give 'all' or template numbers such as 0,2.") from None
    if not picked:
        raise KvpotError("--templates is empty; give 'all' or template numbers such as 0,2.")
    return sorted(picked)


def parse_key_formats(text: str | None) -> list[str] | None:
    """`--key-formats digits,uuid,words` -> those formats in the order given (distinct); None or `task`:
    the task's own format (its `--task-set` option or its default), as before key formats were a dimension."""
    if text is None or str(text).strip().lower() == "task":
        return None
    picked = list(dict.fromkeys(p.strip().lower() for p in str(text).split(",") if p.strip()))
    if not picked:
        raise KvpotError("--key-formats is empty; give formats such as digits,uuid,words (or 'task').")
    return picked


def literal(value: str) -> Any:
    """A `--task-set` value: `none` -> None, integers and floats as numbers, else the string."""
    if value.lower() == "none":
        return None
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            continue
    return value


@dataclass
class EvalConfig:
    """The resolved `kvpot eval` request; saved next to every result (`config.json`)."""

    task: str
    methods: list[str]
    out: Path
    lengths: list[int] = field(default_factory=lambda: parse_lengths(DEFAULT_LENGTHS))
    depths: list[float] = field(default_factory=lambda: parse_depths(DEFAULT_DEPTHS))
    samples: int | None = 5  # benchmark suites: items per task (None: all)
    budget: int | None = None
    settings: dict[str, str] = field(default_factory=dict)
    task_options: dict[str, Any] = field(default_factory=dict)
    haystack: str = "repeat"
    seed: int = 0
    max_new_tokens: int | None = None
    window: int = 4096
    prompt_tokens: int | None = None
    model: str | None = None
    device: str | None = None
    dtype: str = "auto"
    data_dir: str | None = None  # benchmark suites: the folder of their data files
    subtasks: list[str] | None = None  # benchmark suites: --tasks (None: every task whose data is there)
    device_map: str | None = None  # split the model over GPUs (accelerate), instead of `device`
    max_memory: str | None = None  # with device_map: "0=70GiB,1=70GiB"
    gguf: str | None = None  # a GGUF file (`--gguf`), alone or inside `model`
    batch_size: int = 1  # samples decoded together per method (kvpot.engine.scheduler); 1: one at a time
    mix: str = "auto"  # with --batch-size: Scheduler(mix=...), prompt chunks with the decoding rows (auto: on a GPU)
    batch_invariant: bool = False  # Engine(batch_invariant=...): each sample's numbers the same at any batch
    templates: list[int] | None = None  # prompt wordings of passkey/niah/vt/ruler (None: all); resolved to a list
    key_formats: list[str] | None = None  # passkey's key / niah's value formats to spread over (None: the task's)
    chat: str | None = None  # tasks and ruler: both/plain/chat (None: both); kvpot.eval.prompting
    compression_ratios: list[float] | None = None  # each budgeted method (and press) per ratio; kvpot.eval.ratios
    baselines: list[str] = field(default_factory=list)  # "kvpress": its presses on the same cases (kvpot.eval.kvpress)
    presses: list[str] | None = None  # kvpress presses (None: kvpot.eval.kvpress.DEFAULT_PRESSES)
    kvpress_path: str | None = None  # the folder holding kvpress and its transformers (benchmarks/kvpress-env/)
    time_limit: float | None = None  # seconds: start no sample (or kvpress answer) that would end later (eval.limits)
    resume: bool = False  # continue the run in `out`: skip samples with rows there (kvpot.eval.resume)

    def __post_init__(self):
        from kvpot.tasks import HAYSTACKS, TASKS, task_options
        from kvpot.tasks.suites import SUITES, is_suite

        self.out = Path(self.out)
        if self.task != PERPLEXITY and self.task not in TASKS and not is_suite(self.task):
            raise KvpotError(f"unknown task {self.task!r}; choose one of: {', '.join([*TASKS, *SUITES, PERPLEXITY])}.")
        if not is_suite(self.task) and (self.data_dir is not None or self.subtasks is not None):
            raise KvpotError(f"--data-dir and --tasks are for the benchmarks ({', '.join(SUITES)}), not {self.task}.")
        if is_suite(self.task):
            if self.task_options:
                raise KvpotError(f"{self.task} takes no --task-set options; choose tasks with --tasks.")
            if self.subtasks is not None and not self.subtasks:
                raise KvpotError("--tasks is empty; name tasks such as narrativeqa,hotpotqa.")
        elif self.task == PERPLEXITY:
            if len(self.lengths) != 1:
                raise KvpotError("perplexity reads one text: give one --length, e.g. --length 128k.")
            if self.task_options:
                raise KvpotError("perplexity takes no --task-set options.")
        else:
            allowed = task_options(self.task)
            for key in self.task_options:
                if key not in allowed:
                    raise KvpotError(f"task {self.task!r} has no option {key!r}; its options are: "
                                     f"{', '.join(allowed) or 'none'}.")
        self.templates = _resolve_templates(self.task, self.templates)
        _check_key_formats(self.task, self.key_formats, self.task_options)
        self.chat = _resolve_chat(self.task, self.chat)
        self._check_baselines()
        if not self.lengths or any(n < 1 for n in self.lengths):
            raise KvpotError("lengths must be positive numbers of tokens.")
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise KvpotError("depths must lie in [0, 1].")
        if (self.samples is None and not is_suite(self.task)) or (self.samples is not None and self.samples <= 0):
            raise KvpotError(f"--samples must be at least 1, got {self.samples}.")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise KvpotError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}.")
        if self.window < 1:
            raise KvpotError(f"--window must be at least 1 token, got {self.window}.")
        if self.mix not in MIXES:
            raise KvpotError(f"--mix must be auto, on or off, got {self.mix!r}.")
        if self.batch_invariant and self.mix == "on":
            raise KvpotError("--batch-invariant reads prompts as one sample alone does: it does not run with --mix on.")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise KvpotError(f"--batch-size must be a positive integer, got {self.batch_size!r}.")
        if self.batch_size > 1 and (self.task == PERPLEXITY or self.device_map is not None):
            raise KvpotError("--batch-size applies to answering tasks on one device (perplexity reads one text; a "
                             "model split by --device-map decodes one sequence at a time).")
        if self.prompt_tokens is not None and self.prompt_tokens < 1:
            raise KvpotError(f"--prompt-tokens must be at least 1, got {self.prompt_tokens}.")
        if self.budget is not None and self.budget <= 0:
            raise KvpotError(f"the budget must be a positive number of KV entries, got {self.budget}.")
        if self.haystack not in HAYSTACKS:
            raise KvpotError(f"unknown haystack {self.haystack!r}; choose one of: {', '.join(HAYSTACKS)}.")
        if not self.out.parent.is_dir():
            raise KvpotError(f"--out {self.out}: the folder {self.out.parent} does not exist; create it first.")
        if self.out.exists() and not self.out.is_dir():
            raise KvpotError(f"--out {self.out} is a file; give a folder to write results into.")
        self._check_stopping()

    def _check_stopping(self) -> None:
        """--time-limit and --resume: answering tasks (perplexity reads one text in one go)."""
        if self.time_limit is not None:
            if isinstance(self.time_limit, bool) or not isinstance(self.time_limit, (int, float)) \
                    or not self.time_limit > 0 or self.time_limit == float("inf"):
                raise KvpotError(f"--time-limit must be a positive number of seconds, got {self.time_limit!r}.")
        if not isinstance(self.resume, bool):
            raise KvpotError(f"resume must be True or False, got {self.resume!r}.")
        if self.task == PERPLEXITY and (self.time_limit is not None or self.resume):
            raise KvpotError("--time-limit and --resume apply to answering tasks, not perplexity (one text).")

    def _check_baselines(self) -> None:
        """--compression-ratios and --baseline kvpress: answering tasks, one device, a kvpress folder."""
        if self.compression_ratios is not None:
            if self.task == PERPLEXITY:
                raise KvpotError("--compression-ratios applies to answering tasks, not perplexity.")
            if not self.compression_ratios or any(not 0.0 < r < 1.0 for r in self.compression_ratios):
                raise KvpotError("--compression-ratios must be fractions in (0, 1), e.g. 0.25,0.5,0.75.")
        if not self.methods and "kvpress" not in self.baselines:
            raise KvpotError("give at least one --method (or --baseline kvpress with its presses).")
        unknown = [b for b in self.baselines if b != "kvpress"]
        if unknown:
            raise KvpotError(f"unknown baseline {unknown[0]!r}; kvpot eval compares with: kvpress.")
        if self.presses is not None and "kvpress" not in self.baselines:
            raise KvpotError("--press names kvpress presses; add --baseline kvpress.")
        if "kvpress" not in self.baselines:
            return
        from kvpot.eval.kvpress import DEFAULT_PRESSES, press_runs

        self.presses = list(dict.fromkeys(self.presses or DEFAULT_PRESSES))
        if self.compression_ratios is None:
            raise KvpotError("--baseline kvpress runs presses at compression ratios; give --compression-ratios, "
                             "e.g. 0.25,0.5,0.75 (kvpot's methods run at the same ratios).")
        press_runs(self.presses, self.compression_ratios)  # unknown presses fail here
        if self.device_map is not None:
            raise KvpotError("--baseline kvpress runs the presses on one device; drop --device-map.")
        if self.kvpress_path is None:
            from kvpot.bench.kvpress import KVPRESS_PATH_HINT

            raise KvpotError(f"--baseline kvpress needs kvpress' own environment: {KVPRESS_PATH_HINT}.")
        if not Path(self.kvpress_path).is_dir():
            raise KvpotError(f"--kvpress-path {self.kvpress_path} is not a folder; give the folder kvpress and "
                             "its transformers were installed into (benchmarks/kvpress-env/README.md).")

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["out"] = str(self.out)
        return data


def _resolve_chat(task: str, chat: str | None) -> str | None:
    """`both` by default for the synthetic tasks and RULER; the other benchmarks follow their own rule."""
    from kvpot.eval.prompting import CHAT_MODES

    if task in ("longbench", "infinitebench", PERPLEXITY):
        if chat is not None:
            raise KvpotError(f"--chat is for the synthetic tasks and ruler; {task} follows its own rule.")
        return None
    if chat is None:
        return "both"
    if chat not in CHAT_MODES:
        raise KvpotError(f"--chat must be one of {', '.join(CHAT_MODES)}, got {chat!r}.")
    return chat


def _resolve_templates(task: str, templates: list[int] | None) -> list[int]:
    """The template numbers to run: all of the task's for None; [0] for tasks with one wording. For
    ruler, the most any of its tasks has (each task reads those it has)."""
    from kvpot.tasks import template_count

    if task == "ruler":
        from kvpot.tasks.ruler import TASKS, template_count as ruler_count

        count = max(ruler_count(t) for t in TASKS)
    else:
        count = template_count(task) if task not in (PERPLEXITY, "longbench", "infinitebench") else 1
    if templates is None:
        return list(range(count))
    bad = [t for t in templates if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < count]
    if bad or not templates:
        raise KvpotError(f"--templates: {task} has templates 0 to {count - 1} (or 'all'), got "
                         f"{','.join(map(str, templates)) or 'none'}.")
    return sorted(set(templates))


def _check_key_formats(task: str, formats: list[str] | None, options: dict) -> None:
    """`--key-formats`: formats of kvpot.tasks.keys, for a task whose needle hides a key, not also set by
    `--task-set`. RULER is refused: its niah tasks are defined by their formats (RULER's synthetic.yaml)."""
    from kvpot.tasks.keys import FORMAT_OPTION, FORMATS

    if formats is None:
        return
    if task == "ruler":
        raise KvpotError("--key-formats is for passkey and niah; RULER's niah tasks fix their own formats "
                         "(niah_single_1/2: 7-digit values, niah_single_3: UUID values, niah_multikey_3: UUID keys "
                         "and values), so the suite already spans them; pick tasks with --tasks.")
    if task not in FORMAT_OPTION:
        raise KvpotError(f"--key-formats is for tasks whose needle hides a key: {', '.join(FORMAT_OPTION)} "
                         f"(not {task}).")
    if not isinstance(formats, list) or not formats or len(set(formats)) != len(formats):
        raise KvpotError(f"--key-formats: give distinct formats such as digits,uuid,words, got {formats!r}.")
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise KvpotError(f"--key-formats: {task} takes the key formats {', '.join(FORMATS)}, not {bad[0]!r}.")
    if FORMAT_OPTION[task] in options:
        raise KvpotError(f"--key-formats sets {task}'s {FORMAT_OPTION[task]}; drop --task-set "
                         f"{FORMAT_OPTION[task]}={options[FORMAT_OPTION[task]]} (or give that one format alone).")


def sample_seed(seed: int, index: int, length: int, depth: float, template: int = 0, chat: bool = False,
                key_format: str | None = None) -> int:
    """The seed of one sample: stable across processes (a hash, not Python's salted `hash`).

    Each template, chat flag and key format gets its own seeds (independent samples, so the interval
    over all of them is honest); template 0 without the chat template in the task's own key format
    (`key_format` None) keeps the seeds runs had before any of them existed.
    """
    tail = (f"/t{template}" if template else "") + ("/chat" if chat else "")
    tail += f"/k{key_format}" if key_format else ""
    digest = hashlib.sha256(f"kvpot-eval/{seed}/{index}/{length}/{depth:g}{tail}".encode()).hexdigest()
    return int(digest[:8], 16)
