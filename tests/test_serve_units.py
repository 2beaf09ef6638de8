"""kvpot.serve's pieces in-process: prompts from messages, stop strings, the state store, config."""

from __future__ import annotations

import pytest
import torch
from conftest import build_llama

from kvpot import Engine, KvpotError, StreamingLLM

pytest.importorskip("pydantic")

from kvpot.serve.config import ServeConfig, parse_bytes
from kvpot.serve.prompt import TextStream, chat_prompt, completion_prompt
from kvpot.serve.protocol import ApiError, Message
from kvpot.serve.store import StateStore, state_key
from kvpot.engine.state_io import model_fingerprint

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def _engine(template: bool = False, window: int = 60) -> Engine:
    from kvpot.models.reference.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    if template:
        tokenizer.chat_template = TEMPLATE
    model = build_llama(vocab_size=320, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return Engine(model, tokenizer, method=StreamingLLM(sinks=4, window=window, chunk_size=32),
                  chat_template=template)


def _messages(*pairs) -> list[Message]:
    return [Message(role=role, content=content) for role, content in pairs]


def test_chat_prompts_with_a_template_match_engine_encode():
    engine = _engine(template=True)
    doc, question = "The pass key is 123. " * 3, "What is the pass key?"
    context_ids, question_ids = engine.encode(doc, question)
    # the first user message is the context: same ids as an uploaded document, so they share a state
    fresh = chat_prompt(engine, _messages(("user", doc), ("user", question)), document=False)
    assert fresh.context_ids == context_ids
    text = engine.tokenizer.decode(fresh.context_ids + fresh.question_ids)
    assert text == f"<user>{doc}</user><user>{question}</user><assistant>"
    # with a document, the question continues the user turn the document opened (Engine.generate's layout)
    stored = chat_prompt(engine, _messages(("user", question)), document=True)
    assert stored.context_ids is None and stored.question_ids == question_ids
    later = chat_prompt(engine, _messages(("user", question), ("assistant", "123"), ("user", "Sure?")), document=True)
    assert engine.tokenizer.decode(later.question_ids) == (
        f"{question}</user><assistant>123</assistant><user>Sure?</user><assistant>")
    with pytest.raises(ApiError, match="must start with a user message"):
        chat_prompt(engine, _messages(("system", "Be brief."), ("user", question)), document=True)
    with_system = chat_prompt(engine, _messages(("developer", "Be brief."), ("user", doc)), document=False)
    assert engine.tokenizer.decode(with_system.context_ids) == f"<system>Be brief.</system><user>{doc}"
    with pytest.raises(ApiError, match="no user message"):
        chat_prompt(engine, _messages(("system", "x")), document=False)


def test_chat_and_completion_prompts_without_a_template_are_verbatim():
    engine = _engine()
    tok = engine.tokenizer
    fresh = chat_prompt(engine, _messages(("system", "S. "), ("user", "Doc."), ("user", " Q1"), ("assistant", " A"),
                                          ("user", " Q2")), document=False)
    assert fresh.context_ids == tok.encode("S. Doc.", add_special_tokens=True)
    assert tok.decode(fresh.question_ids) == " Q1 A Q2"
    assert completion_prompt(engine, "abc", document=False).context_ids == tok.encode("abc", add_special_tokens=True)
    assert completion_prompt(engine, "abc", document=True).question_ids == tok.encode("abc", add_special_tokens=False)
    assert completion_prompt(engine, [5, 6, 319], document=False).context_ids == [5, 6, 319]
    with pytest.raises(ApiError, match="token ids"):
        completion_prompt(engine, [5, 320], document=False)


def test_text_stream_holds_back_possible_stops_and_cuts_at_them():
    engine = _engine()
    tok = engine.tokenizer

    def run(text: str, stops: list[str]) -> tuple[list[str], str, bool]:
        stream, pieces = TextStream(tok, stops), []
        for token in tok.encode(text, add_special_tokens=False):
            pieces.append(stream.push(token))
            if stream.stopped:
                break
        pieces.append(stream.finish())
        return pieces, "".join(pieces), stream.stopped

    pieces, text, stopped = run("The key is 12345.", ["345"])
    assert text == "The key is 12" and stopped
    prefix = len("The key is 12")
    assert pieces[:prefix] == list("The key is 12") and pieces[prefix] == ""  # "3" could start "345": held
    _, text, stopped = run("The key is 12345.", ["99", "xyz"])
    assert text == "The key is 12345." and not stopped
    pieces, text, stopped = run("ab ab abc", ["abc"])
    assert text == "ab ab " and stopped
    assert pieces[:2] == ["", ""]  # "a", "ab" could be the start of "abc": held back
    _, text, _ = run("héllo wörld", [])  # multi-byte characters come out whole
    assert text == "héllo wörld"
    # decoded a few tokens at a time, the pieces still make the whole text, for text of any bytes
    random_text = bytes(torch.randint(32, 256, (400,), generator=torch.Generator().manual_seed(0)).tolist())
    whole = random_text.decode("utf-8", errors="ignore")
    _, text, _ = run(whole, [])
    assert text == tok.decode(tok.encode(whole, add_special_tokens=False), skip_special_tokens=True)


def test_stop_matching_agrees_with_a_search_and_stays_linear_at_the_limit():
    """The stop matcher finds what `str.find` finds (the earliest start among the stops that ended, fed in
    pieces of any size) and holds back exactly the longest end that begins a stop."""
    import random
    import time

    from kvpot.serve.prompt import StopMatcher
    from kvpot.serve.protocol import MAX_STOP_CHARS

    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 4))]
        matcher, read, hit = StopMatcher(stops), 0, None
        while read < len(text) and hit is None:
            piece = text[read : read + rng.randint(1, 4)]
            hit = matcher.feed(piece)
            read += len(piece)
            seen = text[:read]
            ends = [seen.find(s) for s in stops if s in seen]
            expected = min(ends) if ends else None
            assert hit == expected, (text, stops, read)
            if hit is None:
                held = max((k for s in stops for k in range(1, len(s)) if seen.endswith(s[:k])), default=0)
                assert matcher.partial == held, (seen, stops)
    # the worst case for a search repeated at each token: a stop at the limit that almost matches everywhere
    stop = "z" * (MAX_STOP_CHARS - 1) + "y"
    matcher, began = StopMatcher([stop] * 4), time.perf_counter()
    for _ in range(2000):
        assert matcher.feed("zzzzzzzzzz") is None
    assert matcher.feed("y") == 20000 - (MAX_STOP_CHARS - 1)
    assert time.perf_counter() - began < 5  # linear: ~0.1 s; the quadratic search took minutes


def test_store_spills_to_disk_reloads_and_finds_states_after_a_restart(tmp_path, one_thread):
    engine = _engine()
    ids = [torch.randint(3, 250, (150,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(3)]
    states = [engine.prefill_ids(x) for x in ids]
    fingerprint = model_fingerprint(engine.model)
    keys = [state_key(fingerprint, engine.method.config(), x) for x in ids]
    assert len(set(keys)) == 3 and keys[0] == state_key(fingerprint, engine.method.config(), list(ids[0]))
    size = states[0].nbytes
    question = [40, 41, 42]
    expected = [engine.generate_ids(question_ids=question, state=s, max_new_tokens=6, ignore_eos=True).token_ids
                for s in states]

    store = StateStore(memory=int(size * 2.5), directory=tmp_path)
    store.put(keys[0], states[0], "document", "streaming")  # written through at once
    store.put(keys[1], states[1], "context", "streaming")
    assert (tmp_path / f"{keys[0]}.safetensors").exists() and not (tmp_path / f"{keys[1]}.safetensors").exists()
    store.put(keys[2], states[2], "context", "streaming")  # memory holds two: the oldest spills
    totals = store.totals()
    assert totals["memory_states"] == 2 and totals["memory_bytes"] <= store.memory and totals["states"] == 3
    assert store.lookup(keys[0]).state is None and store.lookup(keys[0]).disk_bytes > 0
    loaded = store.get(keys[0], engine)  # read back from disk, spilling keys[1] to make room
    assert (tmp_path / f"{keys[1]}.safetensors").exists() and store.lookup(keys[1]).state is None
    assert engine.generate_ids(question_ids=question, state=loaded, max_new_tokens=6,
                               ignore_eos=True).token_ids == expected[0]

    restarted = StateStore(memory=size * 10, directory=tmp_path)
    assert restarted.scan(model_fingerprint(engine.model)) == 2  # keys[2] never left memory
    assert restarted.lookup(keys[0]).kind == "document" and restarted.lookup(keys[1]).kind == "context"
    assert restarted.lookup(keys[1]).context_tokens == 150
    again = restarted.get(keys[1], engine)
    assert engine.generate_ids(question_ids=question, state=again, max_new_tokens=6,
                               ignore_eos=True).token_ids == expected[1]
    assert StateStore(memory=1, directory=tmp_path).scan({"another": "model"}) == 0  # other models' files
    assert restarted.delete(keys[1]) and not (tmp_path / f"{keys[1]}.safetensors").exists()
    assert restarted.lookup(keys[1]) is None and not restarted.delete(keys[1])


def test_store_without_a_directory_forgets_and_refuses_what_does_not_fit(one_thread):
    engine = _engine()
    state = engine.prefill_ids(list(range(3, 150)))
    store = StateStore(memory=state.nbytes)
    store.put("a", state, "context", "streaming")
    store.put("b", engine.prefill_ids(list(range(4, 150))), "context", "streaming")
    assert store.lookup("a") is None and store.lookup("b").state is not None  # nowhere to spill: forgotten
    small = StateStore(memory=state.nbytes - 1)
    with pytest.raises(KvpotError, match="--state-memory"):
        small.put("a", state, "document", "streaming")
    small.put("c", state, "context", "streaming")  # a conversation's context is just not kept
    assert small.lookup("c") is None


def test_store_disk_budget_drops_the_least_recently_used_files(tmp_path, one_thread):
    engine = _engine()
    states = [engine.prefill_ids(list(range(3 + i, 150))) for i in range(3)]
    store = StateStore(memory=1 << 30, directory=tmp_path)
    store.put("a", states[0], "document", "streaming")
    file_size = store.lookup("a").disk_bytes
    store.disk = int(file_size * 2.5)
    store.put("b", states[1], "document", "streaming")
    store.put("c", states[2], "document", "streaming")
    assert sorted(p.stem for p in tmp_path.glob("*.safetensors")) == ["b", "c"]
    assert store.lookup("a").state is not None and store.lookup("a").disk_bytes == 0  # still in memory


def test_config_validation_and_sizes(tmp_path):
    assert parse_bytes("4GiB", "x") == 4 * 1024**3 and parse_bytes("512MB", "x") == 512 * 10**6
    assert parse_bytes("1000", "x") == 1000
    with pytest.raises(KvpotError, match="not a size"):
        parse_bytes("lots", "--state-memory")
    with pytest.raises(KvpotError, match="--max-queue"):
        ServeConfig(max_queue=-1)
    with pytest.raises(KvpotError, match="--state-disk needs --state-dir"):
        ServeConfig(state_disk=100)
    with pytest.raises(KvpotError, match="--max-context-tokens"):
        ServeConfig(max_context_tokens=0)
    for field, value in (("max_slots", 0), ("slot_capacity", -5), ("method_slots", 0), ("prefill_tokens", 0),
                         ("feed_tokens", 0)):
        with pytest.raises(KvpotError, match=f"--{field.replace('_', '-')} must be a positive integer"):
            ServeConfig(**{field: value})
    with pytest.raises(KvpotError, match="--kv-memory-fraction"):
        ServeConfig(kv_memory_fraction=1.5)
    with pytest.raises(KvpotError, match="--feed-questions must be auto, always or never"):
        ServeConfig(feed_questions="sometimes")
    with pytest.raises(KvpotError, match="--mix must be one of auto, on, off, eager"):
        ServeConfig(mix=True)
    with pytest.raises(KvpotError, match="--prompt-order must be arrival or shortest, got 'longest'"):
        ServeConfig(prompt_order="longest")
    with pytest.raises(KvpotError, match="--prompt-patience must be a number of seconds >= 0, got -1"):
        ServeConfig(prompt_patience=-1)
    assert ServeConfig(mix="on", share_documents=True).mix == "on"  # shared documents' readers mix when asked
    from kvpot.serve.config import EngineRecipe

    for recipe, options in ((EngineRecipe(batch_invariant=True), dict(mix="on")),
                            (EngineRecipe(batch_invariant=True, tp=2), {})):
        with pytest.raises(KvpotError, match="--batch-invariant"):
            recipe.check(ServeConfig(**options))
    EngineRecipe(batch_invariant=True).check(ServeConfig())  # mix auto: resolved off by the scheduler
    EngineRecipe(batch_invariant=True).check(ServeConfig(share_documents=True))  # readers join the document region
    config = ServeConfig(state_dir=tmp_path / "new" / "dir")
    assert config.state_dir.is_dir() and config.host == "127.0.0.1"


@pytest.mark.parametrize("argv, fragment", [
    (["--method", "nope"], "unknown method 'nope'"),
    (["--method", "streaming:window=lots"], "not a valid int"),
    (["--state-memory", "lots"], "--state-memory: 'lots' is not a size"),
    (["--state-disk", "1GiB"], "--state-disk needs --state-dir"),
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--max-slots", "0"], "--max-slots must be a positive integer"),
    (["--prefill-tokens", "0"], "--prefill-tokens must be a positive integer"),
    (["--feed-tokens", "0"], "--feed-tokens must be a positive integer"),
    (["--prompt-patience", "-2"], "--prompt-patience must be a number of seconds >= 0"),
    (["--batch-invariant", "--mix", "on"], "--batch-invariant reads prompts and questions as one request alone"),
    (["--batch-invariant", "--feed-questions", "always"], "it does not run with --mix on or --feed-questions always"),
    (["--batch-invariant", "--linear", "torch"], "--batch-invariant chooses the linear layers' kernel itself"),
])
def test_serve_command_refuses_bad_flags_in_one_line(argv, fragment, capsys):
    from kvpot.cli import main

    assert main(["serve", *argv]) == 2  # before any model is loaded
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


def test_the_pool_feeds_questions_as_configured(one_thread):
    """`--feed-questions`, `--feed-tokens`, `--mix`, `--prompt-order` and `--prompt-patience` reach the server's
    scheduler."""
    from kvpot.serve.service import Service

    engine = _engine(window=60)
    config = ServeConfig(method="streaming:sinks=4,window=60,chunk_size=32", feed_questions="never", feed_tokens=8,
                         mix="on", prompt_order="shortest", prompt_patience=2.5)
    service = Service(engine, config)
    try:
        scheduler = service._make_scheduler(engine, config.method, 2)
        assert (scheduler.feed_questions, scheduler.feed_tokens, scheduler.mix) == ("never", 8, True)
        assert (scheduler.prompt_order, scheduler.prompt_patience) == ("shortest", 2.5)
    finally:
        service.worker.shutdown()


def test_the_app_refuses_a_configuration_naming_another_method():
    pytest.importorskip("fastapi")
    from kvpot.serve import create_app

    with pytest.raises(KvpotError, match="names the method 'streaming:window=30'"):
        create_app(_engine(window=60), ServeConfig(method="streaming:window=30"))


def test_histogram_buckets_are_cumulative_with_sum_and_count():
    from kvpot.serve.metrics import Histogram

    h = Histogram((1, 2, 4))
    for value in (0.5, 1, 3, 3, 10):
        h.observe(value)
    h.observe(2, times=2)
    lines = h.lines("x", "help")
    assert lines[2:] == ['kvpot_x_bucket{le="1"} 2', 'kvpot_x_bucket{le="2"} 4', 'kvpot_x_bucket{le="4"} 6',
                         'kvpot_x_bucket{le="+Inf"} 7', "kvpot_x_sum 21.5", "kvpot_x_count 7"]


def test_a_method_without_memory_for_its_pool_gets_a_429_and_admission_counts_places():
    """Another method's pool is made while memory allows; when it does not, a 429 says so. A pool admits
    its slots plus --max-queue, then refuses with Retry-After; leaving gives the place back."""
    import asyncio

    from kvpot.serve.metrics import Metrics
    from kvpot.serve.protocol import ApiError
    from kvpot.serve.worker import Worker

    class FakeScheduler:
        def __init__(self, slots):
            from kvpot.engine.admission import Admission

            self.pool = type("P", (), {"slots": slots, "free": list(range(slots))})()
            self.admission = Admission(slots, 1)  # as the service builds it: max_waiting=--max-queue
            self.capacity, self.idle, self.waiting, self.active = 64, True, [], {}

        def slot_bytes(self):
            return 1

        def abort(self, error=None):
            return []

    made = []

    def make_pool(engine, spec, slots):
        if spec != "default":
            raise KvpotError("one slot of 64 entries takes 9.00 GiB and only 1.00 GiB of GPU memory is free")
        made.append(spec)
        return FakeScheduler(2)

    engine = _engine(window=60)
    worker = Worker(ServeConfig(method="streaming:window=60", max_queue=1), Metrics(), make_pool)
    try:
        pool = asyncio.run(worker.pool(engine, "default", default=True))
        other = _engine(window=30)
        with pytest.raises(ApiError) as refused:
            asyncio.run(worker.pool(other, "streaming:window=30"))
        assert refused.value.status == 429 and "no GPU memory for a pool" in refused.value.message
        tickets = [worker.admit(pool) for _ in range(3)]  # 2 slots + 1 in the queue
        with pytest.raises(ApiError) as busy:
            worker.admit(pool)
        assert busy.value.status == 429 and int(busy.value.headers["Retry-After"]) >= 1
        assert (worker.running, worker.waiting, worker.rejected) == (2, 1, 2)
        tickets[0].release()
        tickets[0].release()  # twice: counted once
        assert (worker.running, worker.waiting) == (2, 0)
        worker.admit(pool)
    finally:
        worker.shutdown()


def test_one_at_a_time_pool_for_split_models_answers_cancels_and_fails_alone(one_thread):
    """The pool of a model split over GPUs (the batched engine refuses one) runs requests whole, in order,
    with the tokens `generate_ids` gives, the scheduler's endings and callbacks."""
    from kvpot.engine.requests import Request
    from kvpot.serve.solo import SoloScheduler

    engine = _engine(window=60)
    solo = SoloScheduler(engine)
    prompt = list(range(5, 90))
    seen, ended = [], []
    ok = solo.submit(Request(context_ids=prompt, question_ids=[7, 8], max_new_tokens=6, ignore_eos=True,
                             on_token=lambda r, t: seen.append(t), on_finish=ended.append))
    gone = solo.submit(Request(context_ids=prompt, max_new_tokens=6))
    gone.cancel_requested = True
    bad = solo.submit(Request(context_ids=prompt, max_new_tokens=6, temperature=1.0, top_p=0.5, seed=1))
    bad.max_new_tokens = -1  # slips past the request's own check: the engine refuses it
    assert not solo.idle
    while not solo.idle:
        solo.step()
    expected = engine.generate_ids(prompt, [7, 8], 6, ignore_eos=True).token_ids
    assert ok.tokens == seen == expected and ok.status == "finished" and ok.finish_reason == "length"
    assert len(ok.token_times) == 6 and ok.first_token_time is not None and ended == [ok]
    assert gone.status == "cancelled" and not gone.tokens
    assert bad.status == "failed" and "max_new_tokens" in bad.error
    assert solo.pool.free == [0] and not solo.active


def test_retry_after_follows_the_rate_requests_left_at_lately():
    import time

    from kvpot.serve.metrics import Metrics
    from kvpot.serve.worker import Worker

    worker = Worker(ServeConfig(method="streaming:window=60"), Metrics(), lambda *a: None)
    try:
        now = time.monotonic()
        worker.recent = 8.0
        assert worker._retry(6, 2) == 24  # nothing left lately: 6 requests, 2 at a time, 8 s each
        worker.departures.extend(now - 5 + 0.5 * i for i in range(10))  # 10 in the last 5 s: 2 a second
        assert worker._retry(5, 2) == 3  # 5 ahead at 2 a second
        worker.departures.clear()
        worker.departures.extend(now - 120 + i for i in range(10))  # too long ago to say anything
        assert worker._retry(6, 2) == 24
    finally:
        worker.shutdown()


def test_serve_help_states_every_default(capsys):
    from kvpot.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for fragment in ("(default 1048576)", "default 8192", "(default 1024)", "default 30)", "--allowed-hosts",
                     "--shutdown-grace", "loopback"):
        assert fragment in text, fragment


def test_the_servers_429_comes_from_its_pools_scheduler_admission(one_thread):
    """`Worker.admit` takes its places from the pool's own `Scheduler.admission` (slots + --max-queue); a
    submitted request keeps its place until it ends there, a ticket never submitted gives its place back."""
    import asyncio

    from kvpot.engine.requests import Request
    from kvpot.serve.service import Service

    engine = _engine(window=60)
    config = ServeConfig(method="streaming:sinks=4,window=60,chunk_size=32", max_slots=2, max_queue=1)
    service = Service(engine, config)
    try:
        asyncio.run(service.start())
        pool, worker = service.default_pool, service.worker
        admission = pool.scheduler.admission
        assert (admission.slots, admission.max_waiting) == (2, 1)
        tickets = [worker.admit(pool) for _ in range(3)]
        assert admission.view().taken == 3 and (worker.running, worker.waiting) == (2, 1)
        with pytest.raises(ApiError) as busy:
            worker.admit(pool)
        assert busy.value.status == 429 and int(busy.value.headers["Retry-After"]) >= 1
        assert "2 slots taken, 1 requests waiting, --max-queue 1" in busy.value.message and worker.rejected == 1
        request = Request(list(range(5, 60)), [7, 8], max_new_tokens=3, ignore_eos=True)
        tickets[0].request = request
        asyncio.run(worker.call(lambda: pool.scheduler.submit(request, place=tickets[0].place)))
        assert admission.view().taken == 3  # the ticket's place went with it: not taken twice
        tickets[1].release()  # never submitted (its client left): its place comes back at once
        assert admission.view().taken <= 2
        for _ in range(200):
            if request.done:
                break
            asyncio.run(worker.call(lambda: None))  # a turn; the worker steps the pool meanwhile
        assert request.status == "finished" and admission.view().taken == 1  # ended: its place is back
        tickets[0].release()
        assert admission.view().taken == 1 and pool.admitted == 1
    finally:
        service.worker.shutdown()


def test_counters_of_a_dropped_pool_stay_counted():
    """`kvpot_forwards_total`, `kvpot_mixed_forwards_total`, `kvpot_ahead_steps_total` and `kvpot_copy_on_write_total`
    sum over the pools; a pool dropped for another method's memory keeps its counts in them (Prometheus counters never
    go down)."""
    from types import SimpleNamespace

    from kvpot.serve.worker import Worker

    def pool(forwards, mixed, copies, ahead, idle=True):
        region = SimpleNamespace(documents=1, readers=0, copies={"h2o": copies})
        scheduler = SimpleNamespace(idle=idle, report={"forwards": forwards, "mixed_forwards": mixed, "ahead_steps": ahead},
                                    pool=SimpleNamespace(documents=region))
        return SimpleNamespace(scheduler=scheduler)

    worker = Worker.__new__(Worker)
    worker.pools, worker.dropped = {"first": pool(10, 4, 1, 5), "other": pool(7, 2, 3, 2)}, [0, 0, 0, 0]
    before = worker.forwards(), worker.shared()[2]
    worker._drop_idle_pools(("other",))
    assert list(worker.pools) == ["first"]
    assert (worker.forwards(), worker.shared()[2]) == before == ((17, 6, 7), 4)
