"""kvpress rows of `kvpot bench decode|prefill` (`--baseline kvpress`).

`run_kvpress`: NVIDIA's kvpress presses, run in a second Python process (`kvpot.bench.kvpress_runner`)
because kvpress 0.5.x needs transformers < 5.3 while kvpot runs a newer one. The process gets
PYTHONPATH = `config.kvpress_path` (a folder holding transformers 5.2 + kvpress, see
`benchmarks/kvpress-env/make_wheels.sh`) followed by kvpot's own source folder, so it imports that
transformers and kvpress and kvpot's light modules (shapes, token ids) but nothing of kvpot's parent
environment. A missing environment is a skipped row with the reason, never an exception: the kvpot
rows of the same run are still worth having.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvpot.bench.kvpress_runner import IMPORT_ERROR_EXIT, MODES, PRESSES
from kvpot.errors import KvpotError

KVPRESS_PATH_HINT = ("give --kvpress-path DIR or set KVPOT_KVPRESS_PATH (wheels: benchmarks/kvpress-env/make_wheels.sh, "
                     "then pip install --no-index --no-deps --target DIR .whl-kvpress/*.whl)")


def kvpress_command(config, press: str, length: int, kept: int, mode: str) -> list[str]:
    """The runner's command line for one (press, length) of `config` (a `BenchConfig`)."""
    return [sys.executable, "-m", "kvpot.bench.kvpress_runner", "--shape", config.shape, "--device", config.device,
            "--dtype", config.dtype, "--length", str(length), "--question-tokens", str(config.question_tokens),
            "--decode-steps", str(config.decode_steps), "--warmup-steps", str(config.warmup_steps),
            "--press", press, "--kept", str(kept), "--seed", str(config.seed), "--mode", mode,
            "--sdpa", config.sdpa]


def run_kvpress(config, press: str, length: int, kept: int, mode: str) -> dict:
    """One kvpress row: press `press` keeping `kept` of `length` context entries per layer and head.

    Returns the runner's JSON (kvpot-style keys: `prefill_seconds`, `ms_per_token`, `peak_memory_bytes`,
    `max_kv_entries`, ...) plus `oom` and `skipped`. `skipped` is a one-line reason when no kvpress
    environment is configured or kvpress (or its transformers) cannot be imported there; `oom` is
    True when the runner ran out of memory; any other failure of the runner is an `error` row.
    """
    if press not in PRESSES:
        raise KvpotError(f"unknown kvpress press {press!r}; choose one of: {', '.join(PRESSES)}.")
    if mode not in MODES:
        raise KvpotError(f"kvpress rows exist for modes {', '.join(MODES)}, not {mode!r}.")
    row = {"method": f"kvpress:{press}", "length": length, "oom": False, "skipped": False}
    path = getattr(config, "kvpress_path", None)
    if path is None:
        return {**row, "skipped": f"no kvpress environment: {KVPRESS_PATH_HINT}"}
    src = Path(__file__).resolve().parents[2]  # the folder holding the `kvpot` package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(path).resolve()), str(src)])}
    if config.threads is not None:  # the same intra-op threads as the kvpot rows (torch reads it at start)
        env["OMP_NUM_THREADS"] = str(config.threads)
    out = subprocess.run(kvpress_command(config, press, length, kept, mode), capture_output=True, text=True, env=env)
    result = _last_json(out.stdout)
    if result is None:
        tail = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}, no output"])[-1][:300]
        return {**row, "error": f"kvpress runner failed: {tail}", "returncode": out.returncode}
    if out.returncode == IMPORT_ERROR_EXIT or result.get("import_error"):
        return {**row, "skipped": f"{result.get('error', 'cannot import kvpress')} (from {path})"}
    row.update(result)
    row["oom"] = bool(result.get("oom"))
    return row


def _last_json(stdout: str) -> dict | None:
    """The runner's last stdout line as JSON (transformers may print warnings before it)."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None
