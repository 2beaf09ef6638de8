"""`kvpot bench serve`: its word-level tokenizer, the launched mode end to end through the CLI (kvpot's
server on `tiny` next to the engine on the same tokens), `--url` against a server started here (the
bundled reference model; with and without kvpot's document route), and one-line errors. Timings are
never compared with the clock: keys, counts and positivity only."""

from __future__ import annotations

import gc
import json
import socket
import weakref

import pytest

from conftest import assert_png, run

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.usefixtures("one_thread")


def bench_serve(capsys, out, *argv: str) -> tuple[dict, str, str]:
    code, stdout, err = run(capsys, "bench", "serve", "--out", str(out), "--users", "3", "--new-tokens", "6",
                            "--question-tokens", "4", "--threads", "1", *argv)
    assert code == 0, err
    assert "Traceback" not in err
    return json.loads((out / "results.json").read_text()), stdout, err


def rows_by_method(results: dict) -> dict:
    return {row["method"]: row for row in results["rows"]}


def check_tokens(row: dict, users: int, new_tokens: int, eos_off: bool) -> None:
    """All requests answered; every token made where EOS cannot end a request early."""
    assert row["completed"] == row["requests"] == users, row.get("error")
    if eos_off:
        assert row["output_tokens"] == users * new_tokens
    else:
        assert 0 < row["output_tokens"] <= users * new_tokens


# ---------------------------------------------------------------------------- tokenizer


def test_word_tokenizer_maps_words_to_ids_and_back():
    from kvpot.bench.serve_workload import ids_text, word_tokenizer

    tok = word_tokenizer(2048, 1, 2)
    assert tok.encode("t5 t7") == [5, 7]
    assert tok.encode("t10 t1 t2 t100", add_special_tokens=True) == [10, 1, 2, 100]  # `t1` does not eat `t10`
    assert (tok.bos_token_id, tok.eos_token_id, tok.chat_template) == (1, 2, None)
    every = list(range(2048))
    assert tok.encode(ids_text(every)) == every
    assert all(tok.decode([i]) == f"t{i}" for i in every)
    assert tok.decode([5, 7, 2047]) == "t5 t7 t2047"


# ---------------------------------------------------------------------------- launched


def test_launched_server_and_engine_on_the_same_tokens(capsys, tmp_path):
    """kvpot's server on `tiny`, one stored document three users ask about, another uploaded while they
    decode; then the engine on the same ids: both rows, their ratio, the files."""
    from kvpot.bench.serve_server import accepts

    out = tmp_path / "out"
    results, stdout, _ = bench_serve(capsys, out, "--shape", "tiny", "--device", "cpu", "--method",
                                     "infinipot:pot_size=128", "--lengths", "96", "--document", "--upload-during", "200",
                                     "--mix", "on")
    rows = rows_by_method(results)
    assert set(rows) == {"infinipot [http]", "infinipot [engine]"}
    http, engine = rows["infinipot [http]"], rows["infinipot [engine]"]
    assert http["server_options"]["mix"] == "on" and engine["mix"] is True  # --mix reaches the server and the engine
    eos_off = accepts("ignore_eos")
    assert http["ignore_eos"] == eos_off
    check_tokens(http, 3, 6, eos_off)
    check_tokens(engine, 3, 6, True)
    # the word-level tokenizer: the server counts exactly the tokens the engine row reads
    assert http["prompt_tokens_mean"] == http["prompt_tokens_sent_mean"] == 96 + 4
    assert http["document_route"] and http["document_context_tokens"] == 96 and http["document_upload_seconds"] > 0
    assert http["upload_during_seconds"] > 0 and http["upload_during_error"] is None
    assert http["upload_during_context_tokens"] == 200 and "itl_p99_ms_during_upload" in http
    assert http["http_vs_engine"] > 0 and engine["document_prefill_seconds"] > 0
    for row in (http, engine):
        assert row["output_tokens_per_second"] > 0 and row["ttft_p50_seconds"] > 0 and row["itl_p99_ms"] >= 0
    records = http["records"]
    assert len(records) == 3 and all(r["error"] is None and r["chunk_seconds"] for r in records)
    assert results["complete"] and results["machine"]["git_commit"] is not None
    summary = (out / "summary.md").read_text()
    assert "| infinipot [http] | 96 | 3 | 3 |" in summary and "| infinipot [engine] | 96 | 3 | 3 |" in summary
    assert "a chunk may hold more than one token" in summary and "kvpot bench serve" in stdout
    assert_png(out / "throughput.png")
    assert_png(out / "itl.png")


def test_launched_mode_refuses_what_it_cannot_do(capsys, tmp_path):
    code, _, err = run(capsys, "bench", "serve", "--shape", "tiny", "--out", str(tmp_path / "a"))
    assert code == 2 and "--method" in err and err.count("\n") == 1
    code, _, err = run(capsys, "bench", "serve", "--url", "http://127.0.0.1:9", "--method", "infinipot",
                       "--out", str(tmp_path / "b"))
    assert code == 2 and "a --url server runs its own" in err and err.count("\n") == 1


# ---------------------------------------------------------------------------- --url


@pytest.fixture(scope="module")
def reference_engine():
    from kvpot.engine import Engine
    from kvpot.methods.spec import build_method
    from kvpot.models.support import resolve_model

    return Engine.from_pretrained(resolve_model(None), method=build_method("infinipot"), device="cpu")


def no_document_route(app):
    """kvpot's app without POST /v1/documents, as any other OpenAI-compatible server."""

    async def wrapped(scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/documents"):
            await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"not found"})
            return
        await app(scope, receive, send)

    return wrapped


def test_url_mode_drives_a_running_server(capsys, tmp_path, reference_engine, monkeypatch):
    """A server started here (the reference model): plain prompts, then one uploaded document, the
    users spread over two client processes (2 users a process here; 16 by default)."""
    from kvpot.bench import serve_client
    from kvpot.bench.serve_server import LaunchedServer, kvpot_app
    from kvpot.serve import ServeConfig

    monkeypatch.setattr(serve_client, "CLIENT_USERS", 2)

    with LaunchedServer(kvpot_app(reference_engine, ServeConfig(method="infinipot"))) as server:
        service = weakref.ref(server.app.state.service)
        plain, _, _ = bench_serve(capsys, tmp_path / "plain", "--url", server.url, "--lengths", "64")
        document, _, _ = bench_serve(capsys, tmp_path / "doc", "--url", server.url + "/v1", "--lengths", "64",
                                     "--document", "--upload-during", "64")
    gc.collect()
    assert service() is None  # a stopped server lets its slots go (the engine row needs the memory)
    for results in (plain, document):
        assert results["server"]["model"] == "kvpot-reference" and results["server"]["kvpot"]
        (row,) = results["rows"]
        assert row["method"] == "kvpot-reference [http]" and row["rejected"] == row["failed"] == 0
        check_tokens(row, 3, 6, eos_off=False)
        assert row["output_tokens_per_second"] > 0 and row["prompt_tokens_mean"] > 64
        assert results["machine"]["device"] == "cpu"
    assert plain["rows"][0]["client_processes"] == document["rows"][0]["client_processes"] == 2
    assert sorted(r["user"] for r in plain["rows"][0]["records"]) == [0, 1, 2]
    row = document["rows"][0]
    assert row["document_route"] and row["document_id"].startswith("doc-") and row["document_upload_seconds"] > 0
    assert not row["document_reused"] and row["upload_during_seconds"] > 0
    assert "| kvpot-reference [http] | 64 | 3 | 3 |" in (tmp_path / "doc" / "summary.md").read_text()


def test_url_mode_without_a_document_route_sends_the_document_in_every_prompt(capsys, tmp_path, reference_engine):
    from kvpot.bench.serve_server import LaunchedServer, kvpot_app
    from kvpot.serve import ServeConfig

    app = no_document_route(kvpot_app(reference_engine, ServeConfig(method="infinipot", served_model_name="ref")))
    with LaunchedServer(app) as server:
        results, _, _ = bench_serve(capsys, tmp_path / "out", "--url", server.url, "--lengths", "64", "--document",
                                    "--users", "2", "--question-tokens", "8")
    (row,) = results["rows"]
    assert row["method"] == "ref [http]" and row["document_route"] is False
    check_tokens(row, 2, 6, eos_off=False)
    assert row["prompt_tokens_mean"] > 64 + 8  # the document's words are in each prompt


def test_url_where_nothing_listens_is_a_one_line_row_error(capsys, tmp_path):
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "out"
    results, stdout, err = bench_serve(capsys, out, "--url", f"http://127.0.0.1:{port}", "--lengths", "64,128")
    assert [row["method"] for row in results["rows"]] == ["server [http]"] * 2
    for row in results["rows"]:
        assert row["error"].startswith(f"GET http://127.0.0.1:{port}/v1/models failed: ")
        assert "\n" not in row["error"] and "output_tokens" not in row
    assert "## Errors" in (out / "summary.md").read_text()
    assert_png(out / "throughput.png")


def test_launched_on_a_checkpoint_reads_words_as_the_engine_does(capsys, tmp_path):
    """`--model` (the bundled reference model): prompts are words; the server and the engine row count
    the same tokens."""
    from kvpot.models.support import resolve_model

    results, _, _ = bench_serve(capsys, tmp_path / "out", "--model", str(resolve_model(None)), "--device", "cpu",
                                "--method", "infinipot", "--lengths", "100")
    rows = rows_by_method(results)
    http, engine = rows["infinipot [http]"], rows["infinipot [engine]"]
    assert results["shape"] is None and http["prompt_tokens_mean"] == http["prompt_tokens_sent_mean"] > 100
    check_tokens(http, 3, 6, eos_off=http["ignore_eos"])
    check_tokens(engine, 3, 6, eos_off=True)
    assert http["http_vs_engine"] > 0
