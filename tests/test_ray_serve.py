"""`kvpot serve --replicas 2` through Ray Serve (kvpot.serve.cluster), against one plain `kvpot serve`.

The parts without Ray (which document a request names, what the front holds back, a store sharing its
directory, the `serve run` options) run everywhere; the served ones need Ray Serve (`kvpot[cluster]`).
Ray's head runs in this process, so that a test can kill a replica's actor; `kvpot serve --replicas`
joins it through $RAY_ADDRESS, as it would join a KubeRay cluster.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from serve_process import MODEL, PASSKEY, QUESTION, Server  # noqa: E402 - after the skips

from kvpot.errors import KvpotError  # noqa: E402
from kvpot.serve.cluster import ClusterConfig, app_builder  # noqa: E402
from kvpot.serve.cluster.bridge import REPLICA_HEADER, Holdback, document_of  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"
DOC = "doc-" + "0123456789abcdef" * 2


# ---------------------------------------------------------------------------- without Ray
def test_ray_serve_front_finds_the_document_a_request_names():
    ask = json.dumps({"model": MODEL, "document_id": DOC, "messages": []}).encode()
    assert document_of("POST", "/v1/chat/completions", ask) == DOC
    assert document_of("POST", "/v1/completions", ask) == DOC
    assert document_of("GET", f"/v1/documents/{DOC}", b"") == DOC
    assert document_of("DELETE", f"/v1/documents/{DOC}", b"") == DOC
    assert document_of("POST", "/v1/documents", ask) == ""  # an upload: its id is known once it is read
    assert document_of("POST", "/v1/chat/completions", json.dumps({"messages": []}).encode()) == ""
    for body in (b"{not json", b"[1, 2]", b"[" * 100000, json.dumps({"document_id": 7}).encode()):
        assert document_of("POST", "/v1/chat/completions", body) == ""  # the replica answers the 400


def _start(status: int, streamed: bool) -> dict:
    kind = b"text/event-stream; charset=utf-8" if streamed else b"application/json"
    return {"type": "http.response.start", "status": status, "headers": [(b"content-type", kind)]}


def _event(payload, more: bool = True) -> dict:
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return {"type": "http.response.body", "body": f"data: {text}\n\n".encode(), "more_body": more}


def test_ray_serve_front_holds_an_answer_back_until_it_carries_output():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    token = {"choices": [{"index": 0, "delta": {"content": " 12"}, "finish_reason": None}]}
    stream = Holdback()
    stream.add(_start(200, streamed=True))
    stream.add(_event(role))
    stream.add({"type": "http.response.body", "body": b": keep-alive\n\n", "more_body": True})
    assert not stream.committed and not stream.retryable  # nothing the client could not be given again
    stream.add(_event(token))
    assert stream.committed and len(stream.messages) == 4

    draining = Holdback()  # a replica shutting down answers a stream with its error: another replica may answer
    draining.add(_start(200, streamed=True))
    draining.add(_event({"error": {"message": "shutting down", "code": "shutting_down"}}))
    draining.add(_event("[DONE]", more=False))
    assert draining.retryable and not draining.committed

    for status, body, committed in ((200, b'{"id": "cmpl-1"}', True), (404, b'{"error": {}}', True),
                                    (503, b'{"error": {"code": "shutting_down"}}', False)):
        whole = Holdback()
        whole.add(_start(status, streamed=False))
        whole.add({"type": "http.response.body", "body": body, "more_body": False})
        assert (whole.committed, whole.retryable) == (committed, not committed), status


def test_replicas_share_documents_through_the_state_dir(tmp_path, one_thread):
    """Two stores on one directory: a document one stores the other finds; one deletes it, the other forgets it."""
    from kvpot import Engine, InfiniPot
    from kvpot.engine.state_io import model_fingerprint
    from kvpot.models.reference.tokenizer import build_tokenizer
    from kvpot.serve.store import StateStore, state_key
    from conftest import build_llama

    tokenizer = build_tokenizer()
    method = InfiniPot(pot_size=64, compress_size=32, catalyst=None)
    engine = Engine(build_llama(seed=0, vocab_size=len(tokenizer)), tokenizer, method=method)
    fingerprint = model_fingerprint(engine.model)
    stores = [StateStore(1 << 30, tmp_path, shared=True) for _ in range(2)]
    for store in stores:
        store.scan(fingerprint)
    ids = list(range(3, 203))
    key = state_key(fingerprint, engine.method.config(), ids)
    state = engine.prefill_ids(ids)
    stores[0].put(key, state, "document", "infinipot")
    assert stores[1].lookup(key) is not None and [d["id"] for d in stores[1].listing()] == [f"doc-{key}"]
    loaded = stores[1].get(key, engine)
    assert loaded.stats.context_tokens == state.stats.context_tokens
    assert stores[1].lookup("../" + key) is None  # a client's text never becomes a path
    assert stores[0].delete(key)
    assert stores[1].lookup(key) is None and stores[1].listing() == []
    unshared = StateStore(1 << 30, tmp_path)  # a single server's store keeps its own view
    unshared.scan(fingerprint)
    assert unshared.lookup(key) is None


def test_replicas_options_are_checked_before_ray_starts(monkeypatch):
    from kvpot.serve.cluster import require_ray

    monkeypatch.setitem(__import__("sys").modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(KvpotError, match=r"kvpot\[cluster\]"):
        require_ray()
    monkeypatch.undo()
    with pytest.raises(KvpotError, match="unknown option"):
        app_builder({"model": "x", "replica_count": "2"})
    with pytest.raises(KvpotError, match="replicas must be an integer >= 1"):
        ClusterConfig(replicas=0)
    with pytest.raises(KvpotError, match="fronts must be an integer >= 1"):
        ClusterConfig(fronts=0)
    assert app_builder_keys_include_fronts()
    with pytest.raises(KvpotError, match="not a"):
        app_builder({"replicas": "two"})
    with pytest.raises(KvpotError, match="--batch-invariant reads prompts"):  # before any replica starts
        app_builder({"batch-invariant": "true", "mix": "on"})


def app_builder_keys_include_fronts() -> bool:
    """`serve run ... fronts=2` reaches ClusterConfig as `kvpot serve --fronts 2` does."""
    import dataclasses

    return "fronts" in {f.name for f in dataclasses.fields(ClusterConfig)}


# ---------------------------------------------------------------------------- through Ray Serve
@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.serve")
    # Ray's workers inherit this environment: they import this checkout's kvpot, one thread each
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "RAY_ADDRESS", "OMP_NUM_THREADS")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), saved["PYTHONPATH"]) if p)
    os.environ["OMP_NUM_THREADS"] = "1"
    context = ray.init(num_cpus=4, include_dashboard=False, logging_level="warning")
    os.environ["RAY_ADDRESS"] = context.address_info["gcs_address"]
    yield ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    for name, value in saved.items():
        os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


@pytest.fixture(scope="module")
def servers(ray_head, tmp_path_factory):
    """(one plain `kvpot serve`, `kvpot serve --replicas 2`), the same flags otherwise."""
    root = tmp_path_factory.mktemp("ray-serve")
    for name in ("one", "two"):
        (root / name).mkdir()
    flags = ("--max-slots", "1", "--max-queue", "8")
    one = Server(root / "one" / "states", *flags)
    try:
        two = Server(root / "two" / "states", *flags, "--replicas", "2", "--retries", "2", "--affinity-slack", "8")
    except BaseException:
        one.stop()
        raise
    yield one, two
    two.stop()
    one.stop()


def _ask(server: Server, document: str, max_tokens: int = 8):
    return server.client().with_options(max_retries=0).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=max_tokens, temperature=0,
        extra_body={"document_id": document})


def _upload(server: Server, text: str) -> tuple[str, str]:
    created = server.http("POST", "/v1/documents", json={"text": text})
    assert created.status_code == 200, created.text
    return created.json()["id"], created.headers.get(REPLICA_HEADER, "")  # none from a plain kvpot serve


def test_ray_serve_replicas_answer_as_one_kvpot_serve(servers):
    one, two = servers
    prompt = PASSKEY + QUESTION
    answers = []
    for server in servers:
        client = server.client()
        done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        chat = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PASSKEY}, {"role": "user", "content": QUESTION}],
            max_tokens=8, temperature=0, stream=True) if c.choices)
        document, _ = _upload(server, PASSKEY * 30)
        asked = _ask(server, document).parse()
        answers.append((done.choices[0].text, done.usage.prompt_tokens, chat, document,
                        asked.choices[0].message.content, asked.usage.prompt_tokens_details.cached_tokens))
    assert answers[0] == answers[1]
    assert "12345" in answers[0][0] and "12345" in answers[0][2]
    assert [m.id for m in two.client().models.list()] == [MODEL]
    listed = two.http("GET", "/v1/documents").json()["data"]
    assert answers[1][3] in [d["id"] for d in listed]  # any replica lists what the shared directory holds


def _settle(server: Server, document: str, replica: str) -> None:
    """Wait until Ray Serve's routers know which replica holds `document` (its loader reports within ~0.1 s;
    the controller passes it on): three reads of it in a row answered there."""
    streak, deadline = 0, time.monotonic() + 30
    while streak < 3 and time.monotonic() < deadline:
        got = server.http("GET", f"/v1/documents/{document}").headers[REPLICA_HEADER]
        streak = streak + 1 if got == replica else 0
        time.sleep(0.2)
    assert streak == 3, "the replica holding the document was never preferred"


def test_ray_serve_affinity_sends_a_documents_readers_to_one_replica(servers):
    _, two = servers
    document, holder = _upload(two, PASSKEY * 31)
    _settle(two, document, holder)
    replicas, lock = [], threading.Lock()

    def ask() -> None:
        answer = _ask(two, document)
        with lock:
            replicas.append(answer.headers[REPLICA_HEADER])

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert replicas == [holder] * 6  # six readers within the slack (8): all where the state is


def test_replicas_killing_one_loses_no_request_that_had_not_started(servers, ray_head):
    _, two = servers
    document, holder = _upload(two, PASSKEY * 32)
    _settle(two, document, holder)
    expected = _ask(two, document).parse().choices[0].message.content
    retries = two.metric("cluster_retries_total")
    # one stream takes the holder's only slot; four questions wait behind it, none started
    stream = two.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=1500, temperature=0, stream=True,
        extra_body={"document_id": document, "ignore_eos": True})
    chunks = iter(stream)
    while not next(chunks).choices[0].delta.content:
        pass  # the role chunk; then the stream's first token
    answers, lock = [], threading.Lock()

    def ask() -> None:
        try:
            result = _ask(two, document)
            outcome = (result.parse().choices[0].message.content, result.headers[REPLICA_HEADER])
        except Exception as err:  # noqa: BLE001 - a lost request is what this test looks for
            outcome = (f"lost: {type(err).__name__}: {err}", "")
        with lock:
            answers.append(outcome)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(2)  # they reach the holder's queue (the test holds either way: all must be answered)
    ray_head.kill(ray_head.get_actor(holder, namespace="serve"), no_restart=True)
    with pytest.raises(openai.APIError, match="replica"):  # it had sent tokens: it ends with an error event
        for _ in chunks:
            pass
    for thread in threads:
        thread.join(timeout=180)
    assert [text for text, _ in answers] == [expected] * 4, answers
    assert all(replica != holder for _, replica in answers)  # answered by the other, from the shared directory
    assert two.metric("cluster_retries_total") - retries >= 1
    assert two.metric("cluster_broken_streams_total") >= 1
