"""What every benchmark mode shares: the machine record, memory and OOM handling, synthetic token
ids, the per-(method, length) loop with checkpoints, and the no-cache floor."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from kvpot.bench.config import FLOOR, BenchConfig


def machine(device: str) -> dict:
    """CPU model, GPU name, versions, git commit, date: recorded with every result."""
    import datetime
    import platform

    import torch
    import transformers

    import kvpot

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = None
    if _cuda(device) and torch.cuda.is_available():  # a split model: "cuda:0,cuda:1"
        gpu = ", ".join(f"{d}: {torch.cuda.get_device_name(d)}" if len(_cuda(device)) > 1 else
                        torch.cuda.get_device_name(d) for d in _cuda(device))
    return {
        "cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "gpu": gpu, "device": device, "platform": platform.platform(),
        "versions": {"kvpot": kvpot.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version(), "cuda": torch.version.cuda},
        # A copy of the tree made without its git metadata (the GPU machine's) is told its commit by
        # whoever copied it; its own .git, if any, may be stale.
        "git_commit": named_commit() or _git("rev-parse", "HEAD"),
        "git_dirty": None if (status := _git("status", "--porcelain", "--untracked-files=no")) is None else bool(status),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def named_commit() -> str | None:
    """The commit `KVPOT_GIT_COMMIT` names (None when unset). Anything but a hash is refused before a run starts: a
    record of a GPU call whose commit reads "REPLACE" (it happened) cannot be traced to its code."""
    import re

    from kvpot.errors import KvpotError

    named = os.environ.get("KVPOT_GIT_COMMIT")
    if named is None or not named.strip():
        return None
    if not re.fullmatch(r"[0-9a-fA-F]{7,40}", named.strip()):
        raise KvpotError(f"KVPOT_GIT_COMMIT={named!r} is not a commit hash (7-40 hex digits); set it to the commit "
                         "this tree holds (git rev-parse HEAD), or unset it to ask git.")
    return named.strip()


def _git(*argv: str) -> str | None:
    """Output of a git command in kvpot's source tree ('' when empty), None without git or a repository."""
    try:
        out = subprocess.run(["git", *argv], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def is_oom(err: BaseException) -> bool:
    import torch

    return isinstance(err, (torch.cuda.OutOfMemoryError, MemoryError))


def mark_oom(row: dict, err: BaseException) -> None:
    """Record an out-of-memory error in a result row; re-raise anything else."""
    if not is_oom(err):
        raise err
    row["oom"], row["error"] = True, (str(err).splitlines() or [type(err).__name__])[0][:300]


# `device` below may name several devices, comma-separated ("cuda:0,cuda:1": a model split over GPUs,
# `BenchConfig.devices`): timing waits for all of them, memory figures are their sums.


def _cuda(device: str) -> list:
    import torch

    return [torch.device(d) for d in device.split(",") if d.startswith("cuda")]


def free_memory(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if _cuda(device):
        torch.cuda.empty_cache()


def synchronize(device: str) -> None:
    import torch

    for d in _cuda(device):
        torch.cuda.synchronize(d)


def reset_peak(device: str) -> int | None:
    """Reset the CUDA peaks; returns the memory allocated now (weights and leftovers), None on CPU."""
    import torch

    for d in _cuda(device):
        torch.cuda.reset_peak_memory_stats(d)
    return sum(torch.cuda.memory_allocated(d) for d in _cuda(device)) if _cuda(device) else None


def peak_memory(device: str) -> int | None:
    import torch

    return sum(torch.cuda.max_memory_allocated(d) for d in _cuda(device)) if _cuda(device) else None


def peak_memory_by_device(device: str) -> dict[str, int]:
    """Peak allocated bytes of each CUDA device since the last reset ({} on CPU)."""
    import torch

    return {str(d): torch.cuda.max_memory_allocated(d) for d in _cuda(device)}


class IdTokenizer:
    """Stands in for a tokenizer where a method encodes a fixed prompt (InfiniPot's generic
    catalyst): one id per 4 characters, about a BPE tokenizer's count, so the probe costs what it
    would with the real tokenizer. Random weights make the ids' meaning irrelevant."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [(sum(map(ord, text[i : i + 4])) * 2654435761) % (self.vocab - 3) + 3 for i in range(0, len(text), 4)]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""  # generated text is not looked at


def random_tokens(vocab: int, n: int, seed: int, device: str):
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=generator).to(device)


def checkpoint(results: dict, out: Path) -> None:
    """results.json after every row (`"complete": false` until the end): a run killed by a time
    limit keeps what it measured."""
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


def labels_with_floor(config: BenchConfig, runs) -> list:
    from kvpot.bench.config import baseline_labels

    return ([FLOOR] if config.floor else []) + baseline_labels(config) + list(runs)


def iterate(config, runs, results, progress, measure, desc):
    """Every (method, length) in order; OOM recorded and that method's longer lengths skipped."""
    from tqdm.auto import tqdm

    entries = labels_with_floor(config, runs)
    with tqdm(total=len(entries) * len(config.lengths), unit="run", desc=f"bench {desc}",
              disable=not progress) as bar:
        for entry in entries:
            label = entry if isinstance(entry, str) else entry.label
            out_of_memory = False
            for length in config.lengths:
                bar.set_postfix_str(f"{label} @ {length} tokens")
                row = {"method": label, "length": length, "oom": False, "skipped": False}
                if out_of_memory:
                    row["skipped"] = True
                else:
                    try:
                        row.update(measure(entry, length))
                    except Exception as err:  # noqa: BLE001 - only out-of-memory errors are recorded
                        mark_oom(row, err)
                        out_of_memory = True
                    free_memory(config.devices)
                results["rows"].append(row)
                checkpoint(results, config.out)
                bar.update()


def model_kv_bytes(model) -> int:
    """Bytes of keys and values of one entry per layer and KV head, over all layers and KV heads."""
    from kvpot.models.shapes import kv_bytes_per_token

    return kv_bytes_per_token(model.config, next(model.parameters()).element_size())


def engine_for(model, run, vocab, decode: str = "auto", compile_step: bool = False, linear: str = "auto",
               batch_invariant: bool = False, runner: str = "sequence"):
    from kvpot.engine import Engine

    return Engine(model, IdTokenizer(vocab), method=run.method, chat_template=False, decode=decode, runner=runner,
                  compile_step=compile_step, linear=linear, batch_invariant=batch_invariant)


def floor_forward(model, ids, chunk: int) -> None:
    """The decoder over `ids` in chunks, each chunk on its own, no cache: zero attention overhead."""
    decoder = model.get_decoder()
    for start in range(0, ids.numel(), chunk):
        piece = ids[start : start + chunk].view(1, -1)
        decoder(input_ids=piece, use_cache=False)


class SdpaFloor:
    """Runs the model with transformers' own SDPA attention (the kvpot attention needs its cache)."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.previous = self.model.config._attn_implementation
        self.model.set_attn_implementation("sdpa")
        return self.model

    def __exit__(self, *exc):
        self.model.set_attn_implementation(self.previous)
        return False


PROFILE_ROWS = 12


def profile_ops(work, device: str, rows: int = PROFILE_ROWS) -> dict:
    """Run `work()` once under `torch.profiler`; the busiest operators by device and by host time.

    Returns wall seconds, summed device (kernel) seconds, host seconds spent in operators, the
    number of kernel launches, and the top `rows` operators each way. Comparing wall time with
    device time tells launch/Python-bound work (device mostly idle) from kernel-bound work.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if _cuda(device) else [])
    synchronize(device)
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        work()
        synchronize(device)
    wall = time.perf_counter() - started
    events = prof.key_averages()

    def device_us(e) -> float:
        return float(getattr(e, "self_device_time_total", 0.0) or 0.0)

    def top(key) -> list[dict]:
        chosen = sorted(events, key=key, reverse=True)[:rows]
        return [{"op": e.key, "calls": e.count, "device_ms": device_us(e) / 1000,
                 "host_self_ms": e.self_cpu_time_total / 1000} for e in chosen]

    kernels = [e for e in prof.events() if getattr(e, "device_type", None) is not None
               and str(e.device_type).endswith("CUDA")]
    return {
        "wall_seconds": wall,
        "device_seconds": sum(device_us(e) for e in events) / 1e6,
        "host_op_seconds": sum(e.self_cpu_time_total for e in events) / 1e6,
        "kernels": len(kernels),
        "top_device": top(device_us) if _cuda(device) else [],
        "top_host": top(lambda e: e.self_cpu_time_total),
    }
