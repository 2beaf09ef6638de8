"""`kvpot bench serve`: many users at once through an OpenAI-compatible HTTP server.

`--users` streaming chat requests (the official `openai` client) are sent together, per length;
each row reports what `kvpot bench throughput` reports (output tokens/s over the workload's wall
time, TTFT p50/p95 from the workload's start, inter-token latency p50/p99 between a stream's
content chunks), plus rejected (429) and failed requests. Two ways to run:

- `--url`: any running server (kvpot's, vLLM's, `transformers serve`), row `MODEL [http]`. With
  `--document`, a server with kvpot's `POST /v1/documents` gets the document once and every user
  names it (`document_id`); elsewhere the document goes in every prompt.
- without: kvpot's server is launched in this process (`kvpot.bench.serve_server`), once per
  `--method`, on a random-weight `--shape` (word-level tokenizer: exact lengths) or a `--model`.
  The same token ids then run through kvpot's engine directly (`bench throughput`'s `[batch]`
  row, after the server has stopped), so each length has `METHOD [http]` and `METHOD [engine]`
  rows and the http row a ratio `http_vs_engine` of their output tokens/s.

`--upload-during TOKENS` uploads another document once every user has its first token and
reports the inter-token gaps that overlap the upload (`itl_p99_ms_during_upload`).
"""

from __future__ import annotations

import sys

from kvpot.bench.common import checkpoint, free_memory, machine, mark_oom, peak_memory, reset_peak
from kvpot.bench.serve_client import Target, connect, drive, summarize
from kvpot.bench.serve_config import ServeBenchConfig
from kvpot.bench.serve_workload import Workload, exact_workload, text_workload, upload_text, word_tokenizer
from kvpot.errors import KvpotError

WARMUP_PROMPT = 256  # as `bench throughput`'s warm-up: one chunk of every method, costs nothing
WARMUP_TOKENS = 4


def run_serve_bench(config: ServeBenchConfig, progress: bool = True, show: bool = True) -> dict:
    """Run the workload; write results.json, summary.md and plots to `config.out`; return the results."""
    import torch

    from kvpot.bench.serve_client import require_openai
    from kvpot.bench.serve_report import plot_names, rich_table, write_reports

    require_openai()  # missing: say so before a model is built
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    config.out.mkdir(exist_ok=True)
    results = {"mode": "serve", "command": list(sys.argv), "config": config.to_dict(), "complete": False, "rows": []}
    if config.launched:
        _launched_rows(config, results, progress)
    else:
        results["machine"] = machine("cpu")  # the client's: the server's machine is not ours to see
        _url_rows(config, results, progress)
    results["complete"] = True
    write_reports(results, config.out)
    if show:
        from rich.console import Console

        Console(width=max(120, Console().width)).print(rich_table(results))
        for row in results["rows"]:
            if row.get("error"):
                print(f"kvpot bench serve: {row['method']} @ {row['length']:,} tokens: {row['error']}", file=sys.stderr)
        print(f"wrote {config.out}/: results.json, summary.md, " + ", ".join(plot_names()))
    return results


def _bar(total: int, progress: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="run", desc="bench serve", disable=not progress)


def _row(method: str, kind: str, length: int, config: ServeBenchConfig) -> dict:
    from kvpot.bench.load import load_config

    return {"method": method, "kind": kind, "length": length, "oom": False, "skipped": False, "users": config.users,
            "new_tokens": config.new_tokens, "document": config.document, **load_config(config)}


def _add(results: dict, row: dict, config: ServeBenchConfig, bar) -> None:
    results["rows"].append(row)
    checkpoint(results, config.out)
    bar.update()


# ---------------------------------------------------------------------------- --url


def _url_rows(config: ServeBenchConfig, results: dict, progress: bool) -> None:
    import uuid

    results["prefix"] = prefix = f"{uuid.uuid4().hex[:8]} "  # this run's own prompts (see text_workload)
    target, warm = None, None
    with _bar(len(config.lengths), progress) as bar:
        for length in config.lengths:
            row = _row(f"{config.served_model or 'server'} [http]", "http", length, config)
            bar.set_postfix_str(f"{config.url} @ {length} tokens")
            try:
                if target is None:
                    target = _url_target(config, results)
                    warm = _warm_up(config, target, None)
                row.update(method=f"{target.model} [http]", warmup_error=warm)
                upload = _upload(config, length, None, prefix)
                row.update(_http(config, target, text_workload(config, length, prefix), upload))
            except KvpotError as err:  # nothing listens, no model, ...: one line in the row
                row["error"] = str(err)
            _add(results, row, config, bar)


def _upload(config: ServeBenchConfig, length: int, vocab: int | None, prefix: str = "") -> str | None:
    """The `--upload-during` document of one length: a text of its own (a server returns a document
    it has read already at once)."""
    if not config.upload_during:
        return None
    return prefix + upload_text(config.upload_during, config.seed + 31 + length, vocab)


def _url_target(config: ServeBenchConfig, results: dict) -> Target:
    model, kvpot = connect(config.url, config.api_key, config.served_model, config.timeout)
    results["server"] = {"url": config.url, "model": model, "kvpot": kvpot}
    return Target(config.url, config.api_key, model, kvpot, {"ignore_eos": True} if config.ignore_eos else {},
                  config.timeout)


def _http(config: ServeBenchConfig, target: Target, workload: Workload, upload: str | None) -> dict:
    # the clients run in processes of their own (`drive`): in the server's process they would take the
    # GIL from its generation thread and event loop (a real server's clients are elsewhere)
    plan = workload.plan or {}
    outcome = drive(target, workload.contexts, workload.questions, workload.document,
                    plan.get("new_tokens", config.new_tokens), upload, plan.get("arrivals"))
    return summarize(outcome, config.slo_ttft, config.slo_itl)


# ---------------------------------------------------------------------------- launched


def _launched_rows(config: ServeBenchConfig, results: dict, progress: bool) -> None:
    from kvpot.methods.spec import MethodSpec, build_methods

    runs = build_methods([MethodSpec.parse(m) for m in config.methods], config.budget, config.settings)
    model, tokenizer, word_level = _model(config, results)
    bench_config = config.engine_config(results["machine"]["device"], results["devices"])
    workloads = {n: exact_workload(bench_config, model, tokenizer, n, word_level) for n in config.lengths}
    vocab = model.config.vocab_size if word_level else None
    results["methods"] = {run.label: run.describe() for run in runs}
    with _bar(2 * len(runs) * len(config.lengths), progress) as bar:
        for run in runs:
            http = _served_rows(config, model, tokenizer, run, workloads, vocab, results, bar)
            free_memory(results["devices"])  # the server's slots go before the engine's are made
            for row in http:
                engine = _engine_row(config, bench_config, model, tokenizer, run, workloads[row["length"]],
                                     row["length"], bar)
                if row.get("output_tokens_per_second") and engine.get("output_tokens_per_second"):
                    row["http_vs_engine"] = row["output_tokens_per_second"] / engine["output_tokens_per_second"]
                free_memory(results["devices"])
                _add(results, engine, config, bar)
            checkpoint(results, config.out)


def _model(config: ServeBenchConfig, results: dict):
    """(model, tokenizer, word-level?) as `kvpot bench` builds a shape, or a checkpoint's."""
    import torch

    from kvpot.models import resolve_device, resolve_dtype, shapes
    from kvpot.models.devices import describe_devices, input_device

    device, dtype = resolve_device(config.device), resolve_dtype(config.dtype)
    torch.manual_seed(config.seed)
    if config.model is not None:
        model, tokenizer = _checkpoint(config, device, dtype)
        results["shape"] = None
    else:
        model = shapes.build(config.shape, device, dtype, seed=config.seed)
        tokenizer = word_tokenizer(model.config.vocab_size, model.config.bos_token_id, model.config.eos_token_id)
        results["shape"] = shapes.describe(shapes.get_shape(config.shape))
    results["devices"] = describe_devices(model)
    results["machine"] = machine(results["devices"])
    results["machine"]["device"] = str(input_device(model))
    results["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    results["model_config"] = model.config.to_dict()
    return model, tokenizer, config.model is None


def _checkpoint(config: ServeBenchConfig, device: str, dtype):
    from kvpot.engine import Engine
    from kvpot.models.support import resolve_model

    engine = Engine.from_pretrained(resolve_model(config.model), device=device, dtype=dtype, chat_template=False,
                                    decode=config.decode)
    if engine.tokenizer is None:
        raise KvpotError(f"{config.model} has no tokenizer; its server needs one to read text.")
    return engine.model, engine.tokenizer


def _served_rows(config, model, tokenizer, run, workloads, vocab, results, bar) -> list[dict]:
    """The `[http]` rows of one method: its server launched, warmed up, driven at each length."""
    from kvpot.bench.serve_server import LaunchedServer, accepts, kvpot_app
    from kvpot.engine import Engine

    rows, added = [_row(f"{run.label} [http]", "http", n, config) for n in config.lengths], 0
    try:
        engine = Engine(model, tokenizer, method=run.method, chat_template=False, decode=config.decode)
        serve_config, server_fields = _serve_config(config, run, max(map(_prompt_tokens, workloads.values())))
        with LaunchedServer(kvpot_app(engine, serve_config)) as server:
            model_id, _ = connect(server.url, None, None, config.timeout)
            target = Target(server.url, None, model_id, True, {"ignore_eos": True} if accepts("ignore_eos") else {},
                            config.timeout)
            server_fields.update(ignore_eos=bool(target.extra), warmup_error=_warm_up(config, target, vocab))
            for row in rows:
                bar.set_postfix_str(f"{row['method']} @ {row['length']} tokens")
                workload = workloads[row["length"]]
                upload = _upload(config, row["length"], vocab)
                row.update(_measured(config, target, workload, upload, results["devices"]))
                row.update(server_fields, prompt_tokens_sent_mean=_sent_tokens(workload))
                _add(results, row, config, bar)
                added += 1
    except KvpotError as err:  # the server could not start: every length left says why
        for row in rows[added:]:
            row["error"] = str(err)
            _add(results, row, config, bar)
    return rows


def _measured(config, target: Target, workload: Workload, upload: str | None, devices: str) -> dict:
    before = reset_peak(devices)
    try:
        row = _http(config, target, workload, upload)
    except KvpotError as err:
        return {"error": str(err)}
    return {**row, "peak_memory_bytes": peak_memory(devices), "memory_before_bytes": before}


def _prompt_tokens(workload: Workload) -> int:
    """The longest prompt a user of `workload` sends, in the server's tokens."""
    return max(c.numel() + q.numel() for c, q in zip(workload.ids["contexts"], workload.ids["questions"]))


def _sent_tokens(workload: Workload) -> float:
    """Prompt tokens per user as the server should count them (context or document, and question)."""
    ids = workload.ids
    return sum(c.numel() + q.numel() for c, q in zip(ids["contexts"], ids["questions"])) / len(ids["questions"])


def _serve_config(config: ServeBenchConfig, run, longest: int) -> tuple[object, dict]:
    """kvpot's server for `run`'s method, sized for prompts up to `longest` tokens, and what the rows
    record of it. Stored contexts are turned off: each user's context is read once, as in the engine row."""
    from kvpot.bench.serve_server import serve_options
    from kvpot.serve import ServeConfig

    defaults = ServeConfig()
    growing = run.method.max_entries() is None  # a full cache: a slot must hold the whole prompt
    wanted = dict(max_queue=max(defaults.max_queue, config.users), cache_min_tokens=1 << 40,
                  max_context_tokens=max(defaults.max_context_tokens, longest),
                  max_tokens_limit=max(defaults.max_tokens_limit, config.new_tokens),
                  max_slots=config.slots, prefill_tokens=config.prefill_tokens, mix=config.mix,
                  prompt_order=config.prompt_order, prompt_patience=config.prompt_patience,
                  launch_ahead=config.launch_ahead, feed_questions=config.feed_questions,
                  slot_capacity=longest + config.new_tokens if growing else None)
    options, missing = serve_options(**wanted)
    serve_config = ServeConfig(model=config.model, method=_spec(run), served_model_name=config.model or config.shape,
                               **options)
    return serve_config, {"server_options": options, "server_options_missing": missing}


def _spec(run) -> str:
    """A spec the server rebuilds `run.method` from (it checks that the engine runs its method)."""
    from kvpot.methods.spec import build_method

    try:
        if build_method(run.spec.text()).config() == run.method.config():
            return run.spec.text()
    except KvpotError:
        pass  # a global --budget or --set changed it: spell every parameter out
    config = run.method.config()
    return f"{config['method']}:" + ",".join(f"{k}={v}" for k, v in config.items() if k != "method")


def _warm_up(config: ServeBenchConfig, target: Target, vocab: int | None) -> str | None:
    """Short untimed requests, as many as users: kernels compile, batch sizes' graphs are captured.
    Returns the first error, if any."""
    contexts = [upload_text(WARMUP_PROMPT, config.seed + 17 * user, vocab) for user in range(config.users)]
    questions = [" " + upload_text(4, config.seed + 19 * user, vocab) for user in range(config.users)]
    outcome = drive(target, contexts, questions, None, WARMUP_TOKENS)
    return next((r["error"] for r in outcome["records"] if r["error"]), None)


def _engine_row(config, bench_config, model, tokenizer, run, workload: Workload, length: int, bar) -> dict:
    """`bench throughput`'s `[batch]` row on the same token ids."""
    from kvpot.bench.throughput import _kvpot_row

    row = _row(f"{run.label} [engine]", "engine", length, config)
    bar.set_postfix_str(f"{row['method']} @ {length} tokens")
    try:
        row.update(_kvpot_row(bench_config, model, run, workload.ids, "batch", tokenizer=tokenizer))
    except KvpotError as err:
        row["error"] = str(err)
    except Exception as err:  # noqa: BLE001 - only out-of-memory errors are recorded
        mark_oom(row, err)
    return row
