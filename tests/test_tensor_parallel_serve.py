"""`kvpot serve --tp 2` for real: `torchrun --nproc-per-node 2` on the CPU (gloo) with the bundled reference
model, rank 0 serving HTTP on a free loopback port and rank 1 running the same turns (`kvpot.serve.parallel`).
The official `openai` client's answers (chat and completions, streamed and not, two at once, a stored document,
a long context kept and asked again) equal a one-process `kvpot serve`'s, greedy; SIGTERM to rank 0 drains it
and every process exits 0. CPU runtime: ~40 s (two server starts). The fast tests below need no torchrun.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvpot.errors import KvpotError
from kvpot.serve.config import ServeConfig

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "kvpot"]
LONG = "The pass key is 12345. Remember it. 12345 is the pass key. " * 6  # past --cache-min-tokens 256: kept


def _servers():
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import serve_process

    return serve_process


def ask(server, model: str) -> dict:
    """What the test compares: every answer's text, finish reason and token counts."""
    serve_process = _servers()
    client = server.client()
    question = serve_process.QUESTION
    messages = [{"role": "user", "content": serve_process.PASSKEY}, {"role": "user", "content": question}]

    def completion(prompt, **extra):
        done = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, **extra)
        usage = done.usage
        return done.choices[0].text, done.choices[0].finish_reason, usage.completion_tokens, \
            usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0

    def streamed_chat():
        chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                                stream=True)
        pieces = [(c.choices[0].delta.content or "", c.choices[0].finish_reason) for c in chunks if c.choices]
        return "".join(p for p, _ in pieces), [f for _, f in pieces if f]

    def chat():
        done = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
        return done.choices[0].message.content, done.choices[0].finish_reason

    def streamed_completion():
        chunks = client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in chunks if c.choices)

    out = {"completion": completion(serve_process.PASSKEY + question), "streamed_chat": streamed_chat()}
    with ThreadPoolExecutor(2) as pool:  # two requests decoding in one batch
        together = [pool.submit(chat), pool.submit(streamed_completion)]
        out["together"] = [f.result() for f in together]
    document = server.http("POST", "/v1/documents", json={"text": LONG})
    assert document.status_code == 200, document.text
    out["document"] = completion(question, extra_body={"document_id": document.json()["id"]})
    out["long"] = [completion(LONG + question) for _ in range(2)]  # read and kept, then from the kept state
    return out


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    serve_process = _servers()
    server = serve_process.Server(tmp_path_factory.mktemp("alone") / "states")
    try:
        return ask(server, serve_process.MODEL)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory):
    serve_process = _servers()
    env = {"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}
    server = serve_process.Server(tmp_path_factory.mktemp("tp") / "states", "--tp", "2", launcher=TORCHRUN,
                                  extra_env=env)
    yield server
    server.stop()


@pytest.mark.slow
def test_tensor_parallel_serve_answers_as_one_process(tp_server, alone):
    got = ask(tp_server, _servers().MODEL)
    assert got == alone
    assert "12345" in got["completion"][0] and got["long"][1][3] > 0  # the second long question: from the state


@pytest.mark.slow
def test_tensor_parallel_serve_stops_every_rank_on_sigterm(tp_server):
    psutil = pytest.importorskip("psutil")
    ranks = {int(p.environ()["RANK"]): p for p in psutil.Process(tp_server.process.pid).children()}
    assert sorted(ranks) == [0, 1]
    document = tp_server.http("POST", "/v1/documents", json={"text": LONG})  # a state of its own: it runs alone too
    assert document.status_code == 200, document.text
    ranks[0].send_signal(signal.SIGTERM)  # rank 0 drains, then tells rank 1 to stop
    assert tp_server.process.wait(timeout=60) == 0, tp_server.log.read_text()[-4000:]  # torchrun: every rank 0
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks.values())
    folders = sorted(p.name for p in (tp_server.log.parent / "states").iterdir())
    assert folders == ["tp2-rank0", "tp2-rank1"]  # each rank's own heads of every state, under the same names
    files = [sorted(f.name for f in (tp_server.log.parent / "states" / d).iterdir()) for d in folders]
    assert files[0] == files[1] and files[0]


# ------------------------------------------------------------------------------------- no torchrun needed
@pytest.mark.parametrize("argv, fragment", [
    (["--tp", "2"], "torchrun --nproc-per-node 2"),
    (["--tp", "2", "--replicas", "2"], "give one of them"),
    (["--tp", "2", "--share-documents"], "--share-documents does not run under tensor parallelism"),
    (["--tp", "2", "--device-map", "auto"], "--device-map/--max-memory split the layers"),
])
def test_tensor_parallel_serve_refuses_what_cannot_run(argv, fragment, capsys, monkeypatch):
    from kvpot.cli import main

    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    if fragment.startswith("torchrun"):
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["serve", *argv]) == 2  # before any model is loaded
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


def test_tensor_parallel_serve_help_shows_torchrun(capsys):
    from kvpot.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--tp N" in text and "--tp-timeout" in text and "torchrun --nproc-per-node 2 -m kvpot serve --tp 2" in text


class _Exchange:
    """A stand-in for `TurnExchange`: rank 0's turns from a list (a follower), or a rank gone (raises)."""

    def __init__(self, rank: int, turns: list[dict] | None = None):
        self.rank, self.turns, self.sent = rank, list(turns or []), []

    def turn(self, sent):
        if self.turns:
            return self.turns.pop(0)
        raise RuntimeError("Connection closed by peer")


class _Scheduler:
    def __init__(self):
        from kvpot.engine.admission import Admission

        self.pool = type("P", (), {"slots": 2, "free": [0, 1]})()
        self.admission = Admission(2, 64)
        self.capacity, self.idle, self.waiting, self.active = 64, True, [], {}

    def slot_bytes(self):
        return 1

    def abort(self, error=None):
        return []


def test_tensor_parallel_serve_follower_runs_rank_zero_turns():
    """A follower's worker runs no thread: `follow` runs the turns it receives (here: make the default pool,
    an idle turn, stop) with the engine its spec names, then returns."""
    from kvpot.serve.metrics import Metrics
    from kvpot.serve.turns import Turn
    from kvpot.serve.worker import Worker

    made = []
    engine = type("E", (), {"method": type("M", (), {"config": lambda self: {"method": "streaming"}})()})()
    turns = [Turn.from_wire(t).wire() for t in ({"commands": [("pool", ("streaming", True, ()))], "steps": [],
                                                 "read": None, "stop": False},
                                                Turn().wire(), Turn(stop=True).wire())]
    worker = Worker(ServeConfig(method="streaming"), Metrics(), lambda e, spec, slots: made.append(spec) or _Scheduler(),
                    engine_for=lambda spec: engine, exchange=_Exchange(1, turns))
    assert not worker.thread.is_alive()
    worker.follow()
    assert made == ["streaming"] and list(worker.pools) == ['{"method": "streaming"}']


def test_tensor_parallel_serve_fails_requests_once_the_ranks_are_gone():
    """Rank 0 whose turn cannot reach the other ranks: every request gets a 503 saying so, and admission stops."""
    from kvpot.serve.metrics import Metrics
    from kvpot.serve.protocol import ApiError
    from kvpot.serve.worker import Worker

    worker = Worker(ServeConfig(method="streaming"), Metrics(), lambda *a: _Scheduler(), exchange=_Exchange(0))
    worker.thread.join(timeout=10)
    with pytest.raises(ApiError) as failed:
        asyncio.run(worker.command("persist"))
    assert failed.value.status == 503 and "stopped answering" in failed.value.message
    with pytest.raises(ApiError):
        worker.admit_read()
    with pytest.raises(KvpotError, match="named command|Worker.command"):
        asyncio.run(worker.call(lambda: None))
