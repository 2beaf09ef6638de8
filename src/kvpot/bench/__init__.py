"""Benchmarks (library; `kvpot bench` is the command): speed and memory of every method at real model shapes
(random weights).

Three modes, each writing `results.json` (raw samples, machine, versions, git commit, date, the
command line, resolved configs), `summary.md`, a rich table and PNG plots to `--out DIR`:

- `prefill`: time to first token (the engine's `prefill_seconds` over context + question),
  the method's share of it (`compress_seconds`), peak GPU memory and KV entries, per method and
  length. `floor` is the plain chunked forward of the same tokens with no KV cache at all
  (`decoder(input_ids=chunk, use_cache=False)`): what prefill costs with zero attention overhead.
- `decode`: milliseconds per token, the median of per-step times. Steps are timed between the
  engine's `on_token` callbacks (one forward plus the pick of the next token; on CUDA the callback
  synchronises), so per-step medians need no engine internals. The context is prefilled once,
  untimed; the first `--warmup-steps` steps are dropped. `floor` is a one-token forward without
  a cache (the weights' cost alone).
- `attention`: microseconds per call of one layer's attention over a cache of each length, at
  decode (1 query row) and at prefill (a block of `--block` rows), for dense SDPA
  (`enable_gqa=True`, lower-right causal mask) and `kvpot.attention.attend`; with `--method`,
  also kvpot's attention over the cache each method holds (`min(length, bound)` entries).

The methods come from `--method` specs parsed exactly as `kvpot eval` parses them
(`kvpot.methods.spec`): a new method in `kvpot.methods.METHODS` is
benchmarkable with no change here. A run that runs out of memory (`torch.cuda.OutOfMemoryError`,
or `MemoryError` on CPU) is recorded as `"oom": true` and that method's longer lengths are
skipped (`"skipped": true`). Model building and warm-up runs are never timed.

    from kvpot.bench import BenchConfig, run_bench
    results = run_bench(BenchConfig(mode="prefill", shape="tiny", methods=["full", "streaming"], budget=512,
                                    lengths=[1024, 4096], device="cpu", out="runs/smoke"))

`kvpot bench serve` (`run_serve_bench`, `ServeBenchConfig`; modules `serve*`) measures the same
figures as `throughput` through an OpenAI-compatible HTTP server: one at `--url`, or kvpot's own
launched in-process next to the engine on the same tokens (see `kvpot.bench.serve`).

One module per mode (`prefill`, `decode`, `attention`), plus `config` (BenchConfig), `common`
(machine record, memory, OOM, the run loop), `run` (run_bench), `report` (tables, plots),
`backends` (SDPA's backends for a run: `--sdpa`) and `shapes` (the table of shapes).
"""

from kvpot.bench.config import DEFAULT_LENGTHS, MODES, BenchConfig
from kvpot.bench.run import run_bench
from kvpot.bench.serve import run_serve_bench
from kvpot.bench.serve_config import ServeBenchConfig

__all__ = ["DEFAULT_LENGTHS", "MODES", "BenchConfig", "ServeBenchConfig", "run_bench", "run_serve_bench"]
