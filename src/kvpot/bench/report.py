"""Tables and plots of `kvpot bench` results, from the plain dict in results.json."""

from __future__ import annotations

import json
import math
from pathlib import Path

from kvpot.bench.shapes import format_params


def _rows_of(results: dict, label: str) -> list[dict]:
    return [r for r in results["rows"] if r["method"] == label]


def _labels(results: dict) -> list[str]:
    return list(dict.fromkeys(r["method"] for r in results["rows"]))


def _cell(row: dict, key, fmt) -> str:
    if row.get("oom"):
        return "OOM"
    if row.get("skipped"):
        return "skipped"
    value = key(row) if callable(key) else row.get(key)
    return "-" if value is None else fmt(value)


def _offload(name: str):
    """A figure of an offloading method's report (InfiniteHiP's GPU cache): None for the others."""
    def read(row: dict):
        return ((row.get("method_report") or {}).get("offload") or {}).get(name)
    return read


def decoded_by(row: dict) -> str | None:
    """Who decoded a kvpot row (`Result.stats.decode`): the core with how its steps ran, or the one-sequence runner
    with its mode; None for a baseline."""
    from kvpot.engine.one_slot import ROWS  # the core's step counts: batched, one-sequence, eager

    decode = row.get("decode") or {}
    if decode.get("runner") == "core":
        counts = [f"{decode[key]:,} {label}" for key, label in zip(ROWS, ("batched", "one-sequence", "eager"))
                  if decode.get(key)]
        return "core" + (f" ({', '.join(counts)})" if counts else "")
    return f"{decode['runner']} ({decode.get('mode')})" if decode.get("runner") else None


_COLUMNS = {
    "prefill": [("TTFT s", "prefill_seconds", lambda v: f"{v:.3f}"),
                ("compress share", "compress_share", lambda v: f"{100 * v:.1f}%"),
                ("tok/s", "tokens_per_second", lambda v: f"{v:,.0f}"),
                ("peak memory", "peak_memory_bytes", None),
                ("KV cache", "kv_cache_bytes", None),
                ("max KV entries", "max_kv_entries", lambda v: f"{v:,}")],
    "decode": [("ms/token", "ms_per_token", lambda v: f"{v:.2f}"),
               ("p90 ms", "ms_per_token_p90", lambda v: f"{v:.2f}"),
               # the mean counts the periodic steps the median leaves out (InfiniteHiP's refreshes,
               # InfiniPot's distillations)
               ("mean ms", "ms_per_token_mean", lambda v: f"{v:.2f}"),
               ("tok/s", "tokens_per_second", lambda v: f"{v:,.1f}"),
               ("peak memory", "peak_memory_bytes", None),
               ("KV cache", "kv_cache_bytes", None),
               ("max KV entries", "max_kv_entries", lambda v: f"{v:,}"),
               ("LRU hits", _offload("hit_rate"), lambda v: f"{100 * v:.1f}%"),
               ("host->GPU /token", _offload("host_bytes_per_token"), None),
               ("decoded by", decoded_by, str)],
    "throughput": [("users", "users", lambda v: f"{v:,}"),
                   ("done", "completed", lambda v: f"{v:,}"),
                   ("tok/s", "output_tokens_per_second", lambda v: f"{v:,.0f}"),
                   ("prompt tok/s", "prompt_tokens_per_second", lambda v: f"{v:,.0f}"),
                   ("TTFT p50 s", "ttft_p50_seconds", lambda v: f"{v:.2f}"),
                   ("TTFT p95 s", "ttft_p95_seconds", lambda v: f"{v:.2f}"),
                   ("TTFT p99 s", "ttft_p99_seconds", lambda v: f"{v:.2f}"),
                   ("ITL p50 ms", "itl_p50_ms", lambda v: f"{v:.1f}"),
                   ("ITL p95 ms", "itl_p95_ms", lambda v: f"{v:.1f}"),
                   ("ITL p99 ms", "itl_p99_ms", lambda v: f"{v:.1f}"),
                   ("ITL p50 reading ms", "itl_reading_p50_ms", lambda v: f"{v:.1f}"),
                   ("ITL p99 reading ms", "itl_reading_p99_ms", lambda v: f"{v:.1f}"),
                   ("E2E p50 s", "e2e_p50_seconds", lambda v: f"{v:.2f}"),
                   ("E2E p95 s", "e2e_p95_seconds", lambda v: f"{v:.2f}"),
                   ("E2E p99 s", "e2e_p99_seconds", lambda v: f"{v:.2f}"),
                   ("SLO met", "slo_met_share", lambda v: f"{100 * v:.0f}%"),
                   ("goodput tok/s", "goodput_tokens_per_second", lambda v: f"{v:,.0f}"),
                   ("peak memory", "peak_memory_bytes", None),
                   ("slots", "slots", lambda v: f"{v:,}")],
    "attention": [("cache entries", "cache_entries", lambda v: f"{v:,}"),
                  ("decode µs", "decode_us", lambda v: f"{v:,.1f}"),
                  ("decode µs (graph)", "decode_graph_us", lambda v: f"{v:,.1f}"),
                  ("prefill µs (block)", "prefill_us", lambda v: f"{v:,.1f}")],
}


# shown only where some row has them: the SLO columns need --slo-ttft or --slo-itl; the ITL while prompts are read
# needs each token's time (not the one-at-a-time rows, which time decoding steps alone)
OPTIONAL = {"slo_met_share", "goodput_tokens_per_second", "itl_reading_p50_ms", "itl_reading_p99_ms"}
# left out of the terminal's table (summary.md and results.json have them): it must fit a terminal
COMPACT_SKIP = {"ttft_p99_seconds", "itl_p95_ms", "e2e_p50_seconds", "e2e_p95_seconds", "itl_reading_p50_ms"}


def shown(columns: list, rows: list[dict]) -> list:
    return [c for c in columns if c[1] not in OPTIONAL or any(r.get(c[1]) is not None for r in rows)]


def length_cell(row: dict) -> str:
    """The row's length, or its mix (`--length-mix`: each request drew its own)."""
    from kvpot.reporting import format_length

    return f"mix {row['length_mix']}" if row.get("length_mix") else format_length(row["length"])


def load_line(config: dict) -> str:
    """The open-loop load of a throughput or serve run (kvpot.bench.load), one line of summary.md."""
    rate = config.get("arrival_rate")
    parts = [f"Poisson arrivals, {rate:g} requests/s" if rate else "all requests arrive at once"]
    if config.get("length_mix"):
        parts.append(f"context lengths drawn from `{config['length_mix']}`")
    if config.get("new_tokens_mix"):
        parts.append(f"new tokens drawn from `{config['new_tokens_mix']}`")
    slos = [f"TTFT <= {config['slo_ttft']:g} s" if config.get("slo_ttft") else "",
            f"p99 of each request's ITL <= {config['slo_itl']:g} s" if config.get("slo_itl") else ""]
    if any(slos):
        parts.append("SLO: " + " and ".join(x for x in slos if x))
    return f"- load: {', '.join(parts)}; seed {config.get('seed', 0)}"


def table_rows(results: dict, compact: bool = False) -> tuple[list[str], list[list[str]]]:
    """One row per method and length: the comparison table of a mode (`compact`: the terminal's)."""
    from kvpot.reporting import format_bytes

    columns = _COLUMNS[results["mode"]]
    if results["mode"] == "throughput":
        columns = [c for c in shown(columns, results["rows"]) if not (compact and c[1] in COMPACT_SKIP)]
    headers = ["method", "length"] + [c[0] for c in columns]
    rows = []
    for row in results["rows"]:
        cells = [row["method"], length_cell(row)]
        for _, key, fmt in columns:
            cells.append(_cell(row, key, fmt or format_bytes))
        rows.append(cells)
    return headers, rows


def summary_markdown(results: dict) -> str:
    from kvpot.bench.breakdown import breakdown_markdown
    from kvpot.reporting import markdown_table, method_params

    m, shape = results["machine"], results["shape"]
    notes = {
        "prefill": "TTFT = prefill of context + question (median of repeats); compress share = the method's "
                   "scoring and eviction time / TTFT; `floor` = chunked forward without any KV cache.",
        "decode": "ms/token = median of per-step times after warm-up steps (one forward + next-token pick); "
                  "`floor` = one-token forward without a cache. Offloading (InfiniteHiP): LRU hits = reads served "
                  "by the GPU cache; host->GPU /token = bytes the kernels read from host memory per step (misses "
                  "read by the attention and copied into the cache, stage-scan probes), over every decoding step.",
        "throughput": "Requests arrive all together or over time (`load` above); tok/s = generated tokens / the "
                      "workload's wall time (from its start to the last token); TTFT, ITL and E2E are measured from "
                      "each request's arrival (queueing counts); ITL = gaps between a request's delivered "
                      "tokens (one-at-a-time rows: per-step GPU times), ITL reading = those gaps that overlap some "
                      "request's wait for its first token (while prompts are read); prompt tok/s = prompt tokens "
                      "read (a stored document's once, apart) / the wall time; SLO met = requests that finished "
                      "within the SLOs (TTFT, and the p99 of their own gaps), goodput = their output tokens / the "
                      "wall time. "
                      "`[batch]` = kvpot's scheduler (each request submitted between steps once it has arrived), "
                      "`[one at a time]` = Engine.generate_ids per user in arrival order, each from its arrival or "
                      "the previous end, whichever is later, `hf [generate_batch]` = transformers' continuous "
                      "batching (each request added at its arrival), stopped at --hf-timeout (done < users: "
                      "unfinished).",
        "attention": "One layer's attention per call (median): decode = 1 query row, prefill = a block of query "
                     "rows, over a cache of `cache entries` per KV head. Methods: kvpot attention over the cache "
                     "each method holds; InfiniteHiP: its sparse attention over the whole cache, decode = mean "
                     "per step over one refresh period, `graph` = the period replayed as one CUDA graph "
                     "(device time, no launch overhead).",
    }[results["mode"]]
    parts = [
        f"# kvpot bench {results['mode']}: {shape['name']}",
        "",
        f"- shape: `{shape['name']}` ({shape['mirrors']}), {format_params(shape['parameters'])} parameters, "
        f"random weights, {results['dtype']}",
        f"- machine: {m['device']}; GPU {m['gpu'] or 'none'}; CPU {m['cpu']} ({m['cpu_count']} cores, "
        f"{m['torch_threads']} torch threads)",
        f"- kvpot {m['versions']['kvpot']}, torch {m['versions']['torch']}, transformers "
        f"{m['versions']['transformers']}; commit {m['git_commit'] or 'unknown'}"
        f"{' (modified)' if m.get('git_dirty') else ''}; {m['date']}",
        f"- command: `{' '.join(results['command'])}`",
        *_sdpa_line(m),
        *([load_line(results["config"])] if results["mode"] == "throughput" else []),
        "",
        notes,
        "",
        markdown_table(*table_rows(results)),
    ]
    breakdown = breakdown_markdown(results)
    if breakdown:
        parts += ["", breakdown]
    steps = steps_markdown(results)
    if steps:
        parts += ["", steps]
    by_length = ttft_by_length_markdown(results)
    if by_length:
        parts += ["", by_length]
    if results["methods"]:
        parts += ["", "## Methods", ""]
        parts += [f"- `{label}`: `{method_params(d['config']) or 'no parameters'}` (bound: {d['max_entries']})"
                  for label, d in results["methods"].items()]
    return "\n".join(parts) + "\n"


def steps_markdown(results: dict) -> str:
    """The batch rows' step traces (`kvpot.engine.trace`): per kind of step, how many and the gap the users saw."""
    from kvpot.reporting import markdown_table

    kinds = [(row, kind, s) for row in results["rows"] if isinstance(row.get("steps"), dict)  # decode rows: a count
             for kind, s in _kinds(row["steps"]["kinds"])]
    if not kinds:
        return ""
    device = any("device_p50_ms" in s for _, _, s in kinds)  # on a CUDA device (`StepTrace.for_device`)
    rows = [[row["method"], length_cell(row), kind, f"{s['steps']:,}", f"{s['gap_p50_ms']:.1f}", f"{s['gap_p99_ms']:.1f}",
             f"{s['gap_max_ms']:.1f}"] + ([_ms(s.get("device_p50_ms")), _ms(s.get("device_p99_ms"))] if device else [])
            for row, kind, s in kinds]
    header = ["method", "length", "step", "steps", "gap p50 ms", "gap p99 ms", "gap max ms"]
    return "\n".join(["## Steps", "", "What each batched step ran (`decode`: decoding rows alone; `mixed`: prompt "
                      "chunks in their forward; `apart`: prompt forwards of their own; `+eager`: rows stepped "
                      "alone; `, compressing`: the steps of that kind whose chunks' method compressed after the "
                      "forward) and the gap its users saw until the next tokens (`steps` in results.json keeps the "
                      "slowest steps)" + (("; on a GPU, device = the stream's time from the end of the previous "
                                           "step's work to the end of the step's own (the gap less it: the device "
                                           "idle between steps)") if device else "") + ".", "",
                      markdown_table(header + (["device p50 ms", "device p99 ms"] if device else []), rows)])


def _ms(value) -> str:
    return "" if value is None else f"{value:.1f}"


def _kinds(kinds: dict):
    """Each kind of step, then its steps that compressed (`kvpot.engine.trace`), as (name, figures)."""
    for kind, figures in kinds.items():
        yield kind, figures
        if "compressing" in figures:
            yield f"{kind}, compressing", figures["compressing"]


def ttft_by_length_markdown(results: dict, groups: int = 4) -> str:
    """Each row's requests in `groups` of about equal size by prompt tokens (`per_request`): TTFT p50 / p95 and the
    read's p50 per group, so a policy that favours short prompts (`--prompt-order shortest`) shows its price."""
    from kvpot.bench.load import quantile
    from kvpot.reporting import markdown_table

    rows = []
    for row in results["rows"]:
        done = sorted((r for r in row.get("per_request") or [] if r["ttft"] is not None),
                      key=lambda r: r["prompt_tokens"])
        if len({r["prompt_tokens"] for r in done}) < 2:
            continue
        for g in range(groups):
            part = done[g * len(done) // groups : (g + 1) * len(done) // groups]
            if not part:
                continue
            ttft = [r["ttft"] for r in part]
            read = [r["read"] for r in part if r.get("read") is not None]
            rows.append([row["method"], f"{part[0]['prompt_tokens']:,}-{part[-1]['prompt_tokens']:,}", str(len(part)),
                         f"{quantile(ttft, 0.5):.2f}", f"{quantile(ttft, 0.95):.2f}",
                         f"{quantile(read, 0.5):.2f}" if read else "-"])
    if not rows:
        return ""
    return "\n".join(["## Time to first token by prompt length", "", "Each row's requests in groups of about equal "
                      "size by prompt tokens; `read` = from the request's slot to its first token (the rest of its "
                      "TTFT it waited for a slot; kvpot's scheduler only).", "",
                      markdown_table(["method", "prompt tokens", "requests", "TTFT p50 s", "TTFT p95 s", "read p50 s"],
                                     rows)])


def _sdpa_line(m: dict) -> list[str]:
    """The SDPA setting and the backends it left on (`kvpot.bench.backends`); none in older results."""
    if "sdpa" not in m:
        return []
    on = ", ".join(name for name, enabled in m["sdpa_backends"].items() if enabled) or "none"
    where = "" if str(m["device"]).startswith("cuda") else "; flags left as they were: they apply on CUDA only"
    return [f"- SDPA backends: `--sdpa {m['sdpa']}` (enabled: {on}{where})"]


def rich_table(results: dict):
    from kvpot.reporting import rich_table as table_of

    return table_of(f"kvpot bench {results['mode']}: {results['shape']['name']} ({results['dtype']}, "
                    f"{results['machine']['device']})", *table_rows(results, compact=True))


_PLOTS = {
    "prefill": [("ttft.png", "prefill_seconds", "time to first token (s)", 1.0),
                ("memory.png", "peak_memory_bytes", "peak GPU memory (GiB)", 1 / (1 << 30))],
    "decode": [("ms_per_token.png", "ms_per_token", "ms per token (median)", 1.0),
               ("memory.png", "peak_memory_bytes", "peak GPU memory (GiB)", 1 / (1 << 30))],
    "throughput": [("throughput.png", "output_tokens_per_second", "output tokens per second", 1.0),
                   ("itl.png", "itl_p99_ms", "inter-token latency p99 (ms)", 1.0)],
    "attention": [("attention_decode.png", "decode_us", "µs per call, 1 query row", 1.0),
                  ("attention_prefill.png", "prefill_us", "µs per call, one query block", 1.0)],
}


def plot_names(results: dict) -> list[str]:
    return [name for name, *_ in _PLOTS[results["mode"]]] + (["ttft.png"] if results["mode"] == "throughput" else [])


def ttft_png(path: Path, results: dict) -> Path:
    """Each request's TTFT against its prompt tokens, one marker style per row (throughput rows' `per_request`),
    and, where kvpot's scheduler read it, the part from its slot to its first token (hollow): what is left of a
    TTFT above its hollow twin it waited for a slot."""
    from kvpot.reporting import new_figure

    figure = new_figure(6.5, 4.2)
    axes = figure.add_subplot()
    plotted = 0
    for index, row in enumerate(r for r in results["rows"] if r.get("per_request")):
        done = [r for r in row["per_request"] if r["ttft"] is not None]
        if not done:
            continue
        color = f"C{index % 10}"
        axes.scatter([r["prompt_tokens"] for r in done], [r["ttft"] for r in done], s=14, color=color,
                     label=f"{row['method']}: TTFT")
        read = [r for r in done if r.get("read") is not None]
        if read:
            axes.scatter([r["prompt_tokens"] for r in read], [r["read"] for r in read], s=14, facecolors="none",
                         edgecolors=color, label=f"{row['method']}: its read")
        plotted += 1
    if plotted:
        axes.legend(fontsize=7)
    else:
        axes.text(0.5, 0.5, "no request reached its first token", ha="center", va="center", transform=axes.transAxes)
    axes.set_xlabel("prompt tokens")
    axes.set_ylabel("seconds from arrival (TTFT) / from its slot (read)")
    axes.set_title(f"kvpot bench throughput: {results['shape']['name']} ({results['dtype']}, "
                   f"{results['machine']['gpu'] or results['machine']['device']})", fontsize=9)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    return path


def line_png(path: Path, results: dict, key: str, ylabel: str, scale: float = 1.0) -> Path:
    """`key` against context length, one line per method (log-2 length axis; OOM marked x)."""
    from kvpot.reporting import LINE_STYLES, new_figure, length_axis

    lengths = results["config"]["lengths"]
    figure = new_figure(6.5, 4.2)
    axes = figure.add_subplot()
    plotted = 0
    for index, label in enumerate(_labels(results)):
        rows = {r["length"]: r for r in _rows_of(results, label)}
        values = [rows[n].get(key) if n in rows else None for n in lengths]
        ys = [math.nan if v is None else v * scale for v in values]
        style = LINE_STYLES[index % len(LINE_STYLES)]
        if not all(math.isnan(y) for y in ys):
            axes.plot(lengths, ys, label=label, **style)
            plotted += 1
        ooms = [n for n in lengths if n in rows and rows[n].get("oom")]
        if ooms:
            finite = [y for y in ys if not math.isnan(y)]
            axes.plot(ooms, [max(finite) if finite else 1.0] * len(ooms), "x", color="red", markersize=10,
                      label=f"{label}: OOM")
    if not plotted:
        axes.text(0.5, 0.5, f"no {ylabel} on this device", ha="center", va="center", transform=axes.transAxes)
    length_axis(axes, lengths)
    axes.set_ylabel(ylabel)
    if plotted and key not in ("peak_memory_bytes", "kv_cache_bytes"):
        axes.set_yscale("log")
    axes.set_title(f"kvpot bench {results['mode']}: {results['shape']['name']} ({results['dtype']}, "
                   f"{results['machine']['gpu'] or results['machine']['device']})", fontsize=9)
    axes.grid(alpha=0.3)
    if plotted:
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    return path


def profile_markdown(results: dict) -> str | None:
    """profile.md: per (method, length), wall vs device time and the busiest operators."""
    profiled = [r for r in results["rows"] if r.get("profile")]
    if not profiled:
        return None
    parts = [f"# Where the time goes: kvpot bench {results['mode']} --profile", "",
             "One extra untimed run per row under torch.profiler (profiling itself slows the host side). "
             "device = summed kernel time; when it is far below wall time the GPU waits on the host "
             "(Python and kernel launches).", ""]
    for row in profiled:
        prof = row["profile"]
        device = (f"device {prof['device_seconds']:.3f} s, {prof['kernels']:,} kernels" if prof["top_device"]
                  else "no device timeline (CPU run)")
        parts += [f"## {row['method']} @ {row['length']:,} tokens", "",
                  f"wall {prof['wall_seconds']:.3f} s, {device}, host in operators {prof['host_op_seconds']:.3f} s", ""]
        for title, key in (("by device time", "top_device"), ("by host time", "top_host")):
            if not prof[key]:
                continue
            parts += [f"{title}:", "", "| op | calls | device ms | host self ms |", "| --- | ---: | ---: | ---: |"]
            parts += [f"| `{e['op'][:70]}` | {e['calls']:,} | {e['device_ms']:.1f} | {e['host_self_ms']:.1f} |"
                      for e in prof[key]]
            parts.append("")
    return "\n".join(parts)


def write_reports(results: dict, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    (out / "summary.md").write_text(summary_markdown(results), encoding="utf-8")
    profile = profile_markdown(results)
    if profile:
        (out / "profile.md").write_text(profile, encoding="utf-8")
    write_plots(results, out)


def write_plots(results: dict, out: Path) -> list[Path]:
    """The run's figures (plot_names) from its results alone: `kvpot bench` and `kvpot report --plots`."""
    gpu_memory = any(r.get("peak_memory_bytes") is not None for r in results["rows"])
    written = []
    for name, key, ylabel, scale in _PLOTS[results["mode"]]:
        if key == "peak_memory_bytes" and not gpu_memory:  # CPU: the KV cache the method held
            key, ylabel, scale = "kv_cache_bytes", "KV cache memory (MiB; no GPU peak on CPU)", 1 / (1 << 20)
        written.append(line_png(out / name, results, key, ylabel, scale))
    if results["mode"] == "throughput":
        written.append(ttft_png(out / "ttft.png", results))
    return written
