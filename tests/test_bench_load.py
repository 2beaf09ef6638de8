"""Open-loop load of `kvpot bench throughput` and `bench serve` (kvpot.bench.load): seeded Poisson
arrivals, mixes, percentiles, SLOs and goodput on hand-made records, the step-driven loop on a fake
clock (nothing submitted before its arrival), and the rows end to end on `tiny`. What depends on the
clock is asserted loosely (positivity, bounds far from the measured values)."""

from __future__ import annotations

import json
import random

import pytest

from conftest import run
from kvpot.bench.load import (arrival_times, busy_seconds, draw_mix, load_figures, meets_slo, parse_mix, parse_rate,
                              quantile, run_open_loop)
from kvpot.errors import KvpotError

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------- arrivals and mixes


def test_arrivals_are_seeded_exponential_gaps():
    times = arrival_times(6, 2.0, seed=7)
    rng = random.Random("7:arrivals")
    expected, now = [0.0], 0.0
    for _ in range(5):
        now += rng.expovariate(2.0)
        expected.append(now)
    assert times == expected and times == sorted(times)
    assert arrival_times(6, 2.0, seed=7) == times and arrival_times(6, 2.0, seed=8) != times
    many = arrival_times(4001, 4.0, seed=0)  # 4,000 gaps of mean 1/4 s
    assert abs(many[-1] / 4000 - 0.25) < 0.02


def test_infinite_rate_is_all_at_once():
    assert parse_rate("inf") is None and parse_rate("1.5") == 1.5
    assert arrival_times(4, None, seed=3) == [0.0] * 4
    for bad in ("0", "-1", "nan", "fast"):
        with pytest.raises(KvpotError, match="arrival-rate"):
            parse_rate(bad)


def test_mixes_draw_only_listed_or_ranged_values_reproducibly():
    assert parse_mix("2k,8k,32k", "--length-mix") == ("values", [2048, 8192, 32768])
    assert parse_mix("2k-32k", "--length-mix") == ("range", [2048, 32768])
    listed = draw_mix("2k,8k,32k", 300, seed=1, what="length")
    assert set(listed) == {2048, 8192, 32768}  # every listed value, nothing else
    ranged = draw_mix("64-256", 500, seed=1, what="new-tokens")
    assert all(64 <= n <= 256 for n in ranged) and {64, 256} & set(ranged) and len(set(ranged)) > 100
    assert draw_mix("64-256", 500, seed=1, what="new-tokens") == ranged
    assert draw_mix("64-256", 500, seed=2, what="new-tokens") != ranged
    assert draw_mix("64-256", 500, seed=1, what="length") != ranged  # streams of their own
    for bad in ("", "32k-2k", "0,64", "a-b", "64-"):
        with pytest.raises(KvpotError, match="--length-mix"):
            parse_mix(bad, "--length-mix")


# ---------------------------------------------------------------------------- figures


def test_percentiles_on_known_values():
    values = [float(v) for v in range(1, 102)]  # 1..101: the q-quantile is 1 + 100 q
    random.Random(0).shuffle(values)
    assert (quantile(values, 0.5), quantile(values, 0.95), quantile(values, 0.99)) == (51.0, 96.0, 100.0)
    assert quantile([], 0.5) is None and quantile([3.0], 0.99) == 3.0


def record(arrival, ttft, gaps, tokens, finished=True, prompt=100):
    e2e = None if ttft is None else ttft + sum(gaps)
    return {"arrival": arrival, "ttft": ttft, "gaps": gaps, "e2e": e2e, "output_tokens": tokens,
            "prompt_tokens": prompt, "finished": finished}


def test_slo_share_and_goodput_on_a_hand_made_example():
    records = [record(0.0, 0.5, [0.05] * 9, 10),  # meets both
               record(1.0, 3.0, [0.05] * 9, 10),  # TTFT over 2 s
               record(2.0, 0.2, [0.05] * 8 + [0.9], 10),  # its p99 gap (0.8225 s) over 0.1 s
               record(3.0, 1.0, [], 1),  # one token: no gap to judge, meets both
               record(4.0, None, [], 0, finished=False)]  # never answered
    assert [meets_slo(r, 2.0, 0.1) for r in records] == [True, False, False, True, False]
    row = load_figures(records, wall=10.0, slo_ttft=2.0, slo_itl=0.1)
    assert row["slo_met"] == 2 and row["slo_met_share"] == 2 / 5
    assert row["goodput_tokens_per_second"] == pytest.approx((10 + 1) / 10.0)
    assert meets_slo(records[1], None, 0.1) and not meets_slo(records[2], None, 0.1)  # one SLO alone
    assert load_figures(records, 10.0)["slo_met"] is None  # no SLO: no goodput
    assert row["prompt_tokens"] == 400 and row["prompt_tokens_per_second"] == 40.0  # the four answered
    # prompts waiting or read: [0, .5] + [1, 4] + [2, 2.2] + [3, 4] -> 0.5 + 3 s
    assert row["prompt_busy_seconds"] == pytest.approx(3.5)
    assert row["ttft_p50_seconds"] == pytest.approx(0.75) and row["itl_max_ms"] == pytest.approx(900)
    # end to end: 0.95, 3.45, 1.5 and 1 s
    assert row["e2e_p99_seconds"] is not None and row["e2e_p50_seconds"] == pytest.approx((1.0 + 1.5) / 2)


def test_itl_while_prompts_are_read_counts_the_gaps_that_overlap_a_wait_for_a_first_token():
    # request 0 decodes from 0.5 s with a gap every 0.1 s, slower (0.3 s) while request 1 waits (1.0-1.6 s); request
    # 2 arrives at 2.05 and waits to 2.1 s: its own gap overlaps nothing of another's wait but its own
    times = [0.5 + 0.1 * i for i in range(5)] + [1.1, 1.4, 1.7] + [1.8, 1.9, 2.0, 2.1, 2.2]
    first = {"arrival": 0.0, "ttft": 0.5, "gaps": [b - a for a, b in zip(times, times[1:])], "times": times,
             "e2e": 2.2, "output_tokens": len(times), "prompt_tokens": 10, "finished": True}
    second = {"arrival": 1.0, "ttft": 0.6, "gaps": [0.1], "times": [1.6, 1.7], "e2e": 0.7, "output_tokens": 2,
              "prompt_tokens": 10, "finished": True}
    third = {"arrival": 2.05, "ttft": 0.05, "gaps": [], "times": [2.1], "e2e": 0.05, "output_tokens": 1,
             "prompt_tokens": 10, "finished": True}
    row = load_figures([first, second, third], wall=2.2)
    # overlapping [1.0, 1.6]: 0.9-1.1, 1.1-1.4, 1.4-1.7 of the first; 1.6-1.7 of the second touches its end only;
    # overlapping [2.05, 2.1]: 2.0-2.1 of the first
    assert row["itl_reading_gaps"] == 4
    assert row["itl_reading_p50_ms"] == pytest.approx(250.0) and row["itl_reading_p99_ms"] == pytest.approx(300.0)
    assert row["itl_p50_ms"] == pytest.approx(100.0)  # every gap: mostly decoding alone
    # records without token times (one-at-a-time rows): no such figures
    assert "itl_reading_p99_ms" not in load_figures([record(0.0, 0.5, [0.05] * 9, 10)], wall=1.0)


def test_busy_seconds_is_the_union_of_intervals():
    assert busy_seconds([(0, 1), (0.5, 2), (3, 4), (3.5, 3.6)]) == pytest.approx(3.0)
    assert busy_seconds([]) == 0.0


# ---------------------------------------------------------------------------- the loop, on a fake clock


class FakeClock:
    def __init__(self):
        self.now, self.sleeps = 100.0, []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


class FakeRequest:
    status, error = "waiting", None


class FakeScheduler:
    """Each step takes 0.1 s; a request is done 3 steps after its submission."""

    def __init__(self, clock):
        self.clock, self.left, self.submitted = clock, {}, []

    @property
    def idle(self):
        return not self.left

    def submit(self, request):
        self.submitted.append((self.clock.now, request))
        self.left[id(request)] = (request, 3)

    def step(self):
        self.clock.now += 0.1
        for key, (request, steps) in list(self.left.items()):
            if steps == 1:
                request.status = "finished"
                del self.left[key]
            else:
                self.left[key] = (request, steps - 1)


def test_open_loop_submits_each_request_at_the_first_step_boundary_after_its_arrival():
    clock = FakeClock()
    scheduler, requests = FakeScheduler(clock), [FakeRequest() for _ in range(4)]
    arrivals = [0.0, 0.05, 0.25, 2.0]
    begun = run_open_loop(scheduler, requests, arrivals, clock=clock, sleep=clock.sleep)
    assert begun == 100.0 and all(r.status == "finished" for r in requests)
    assert [r for _, r in scheduler.submitted] == requests  # in arrival order, each once
    for (at, _), arrival in zip(scheduler.submitted, arrivals):
        assert arrival <= at - begun < arrival + 0.1 + 1e-9  # never early, at most one step late
    # idle after the third request ended (0.6 s): it slept until the fourth arrived, not longer
    assert clock.sleeps == [pytest.approx(2.0 - 0.6)]


def test_open_loop_with_all_at_once_arrivals_submits_everything_before_the_first_step():
    clock = FakeClock()
    scheduler, requests = FakeScheduler(clock), [FakeRequest() for _ in range(5)]
    run_open_loop(scheduler, requests, arrival_times(5, None, seed=0), clock=clock, sleep=clock.sleep)
    assert [at for at, _ in scheduler.submitted] == [100.0] * 5 and clock.sleeps == []


# ---------------------------------------------------------------------------- end to end on tiny


def test_open_loop_on_the_real_scheduler_counts_latency_from_arrival():
    """kvpot's scheduler on `tiny`: nothing submitted before its arrival, and a request's TTFT from its
    arrival does not hold the 1 s it waited to arrive."""
    import torch

    from kvpot.bench.load import request_record
    from kvpot.engine import Engine
    from kvpot.engine.requests import Request
    from kvpot.engine.scheduler import Scheduler
    from kvpot.models import shapes
    from kvpot.bench.common import IdTokenizer
    from kvpot.methods.spec import build_method

    model = shapes.build("tiny", "cpu", torch.float32, seed=0)
    engine = Engine(model, IdTokenizer(model.config.vocab_size), method=build_method("full"), chat_template=False)
    scheduler = Scheduler(engine, slots=3, capacity=256)
    requests = [Request(torch.randint(3, 500, (64,)), torch.randint(3, 500, (4,)), max_new_tokens=3,
                        ignore_eos=True) for _ in range(3)]
    arrivals = [0.0, 0.5, 1.0]
    begun = run_open_loop(scheduler, requests, arrivals)
    records = [request_record(r, a, begun, 68) for r, a in zip(requests, arrivals)]
    for request, arrival, rec in zip(requests, arrivals, records):
        assert request.submitted - begun >= arrival and len(request.tokens) == 3
        assert rec["ttft"] == pytest.approx(request.first_token_time - begun - arrival)
        assert 0 < rec["ttft"] <= rec["e2e"] and len(rec["gaps"]) == 2
    assert records[2]["ttft"] < 0.9  # the wait for its arrival is not counted


def test_throughput_open_loop_rows(capsys, tmp_path):
    """`--arrival-rate` with mixes and SLOs: every row (batch, one at a time, transformers) has the new
    figures; the drawn new tokens are what was generated; generous SLOs are met by every request."""
    out = tmp_path / "out"
    code, _, err = run(capsys, "bench", "throughput", "--shape", "tiny", "--device", "cpu", "--out", str(out),
                            "--method", "infinipot:pot_size=128", "--users", "3", "--length-mix", "64,96",
                            "--new-tokens-mix", "2-5", "--question-tokens", "4", "--arrival-rate", "20",
                            "--seed", "3", "--slo-ttft", "300", "--slo-itl", "300", "--baseline", "hf",
                            "--prompt-order", "shortest", "--prompt-patience", "0.5")
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    config = results["config"]
    assert (config["arrival_rate"], config["length_mix"], config["new_tokens_mix"]) == (20.0, "64,96", "2-5")
    assert config["lengths"] == [96] and config["slo_ttft"] == 300
    drawn = draw_mix("2-5", 3, seed=3, what="new-tokens")
    rows = {row["method"]: row for row in results["rows"]}
    assert set(rows) == {"infinipot [batch]", "infinipot [one at a time]", "hf [generate_batch]"}
    for name, row in rows.items():
        assert row["completed"] == row["requests"] == 3 and row["output_tokens"] == sum(drawn), name
        assert row["slo_met"] == 3 and row["slo_met_share"] == 1.0, name
        assert row["goodput_tokens_per_second"] == pytest.approx(row["output_tokens_per_second"]), name
        assert row["arrival_rate"] == 20.0 and row["length_mix"] == "64,96" and row["slo_itl_percentile"] == 99
        for key in ("ttft_p99_seconds", "itl_p95_ms", "e2e_p50_seconds", "e2e_p99_seconds", "prompt_tokens_per_second"):
            assert row[key] is not None and row[key] >= 0, (name, key)
        assert row["e2e_p99_seconds"] >= row["ttft_p50_seconds"] > 0
        # the arrivals' spread is part of the wall time
        assert row["wall_seconds"] >= arrival_times(3, 20.0, seed=3)[-1]
    lengths = draw_mix("64,96", 3, seed=3, what="length")
    assert rows["infinipot [batch]"]["prompt_tokens"] == sum(lengths) + 3 * 4
    # each request's own figures, in arrival order: its prompt, its tokens, a TTFT of which reading is a part
    assert (rows["infinipot [batch]"]["prompt_order"], rows["infinipot [batch]"]["prompt_patience"]) == ("shortest", 0.5)
    assert config["prompt_patience"] == 0.5
    mine = rows["infinipot [batch]"]["per_request"]
    assert [r["prompt_tokens"] for r in mine] == [n + 4 for n in lengths]
    assert [r["output_tokens"] for r in mine] == drawn
    assert [r["arrival"] for r in mine] == pytest.approx(arrival_times(3, 20.0, seed=3), abs=1e-4)
    assert all(0 < r["read"] <= r["ttft"] + 1e-4 <= r["e2e"] + 2e-4 and r["finished"] for r in mine)
    assert all(r["itl_p99_ms"] >= r["itl_p50_ms"] > 0 for r in mine if r["output_tokens"] > 2)
    assert all(r["read"] is None and r["ttft"] > 0 for r in rows["hf [generate_batch]"]["per_request"])
    from conftest import assert_png

    assert_png(out / "ttft.png")  # each request's TTFT and its read against its prompt tokens
    assert rows["infinipot [batch]"]["mixed_step"] is None  # `--mix auto` reads prompts apart on a CPU
    summary = (out / "summary.md").read_text()
    assert "Poisson arrivals, 20 requests/s" in summary and "drawn from `2-5`" in summary
    assert "| infinipot [batch] | mix 64,96 | 3 | 3 |" in summary and "goodput tok/s" in summary
    # TTFT by prompt length: three requests in groups of one, the shortest prompt's first
    shortest = min(lengths) + 4
    assert "## Time to first token by prompt length" in summary
    assert f"| infinipot [batch] | {shortest:,}-{shortest:,} | 1 |" in summary


def test_throughput_records_how_mixed_steps_ran(capsys, tmp_path):
    """`--mix eager`: prompt chunks ride in the decoding rows' forward, never in the captured fixed-shape step; each
    row says which form ran (`mixed_step`), beside its `mix`."""
    out = tmp_path / "out"
    code, _, err = run(capsys, "bench", "throughput", "--shape", "tiny", "--device", "cpu", "--out", str(out),
                       "--method", "infinipot:pot_size=128", "--users", "2", "--lengths", "160", "--new-tokens", "3",
                       "--question-tokens", "4", "--prefill-tokens", "64", "--mix", "eager", "--mixed",
                       "--sequential-users", "1")
    assert code == 0, err
    rows = {row["method"]: row for row in json.loads((out / "results.json").read_text())["rows"]}
    for name in ("infinipot [batch]", "infinipot [batch, mixed]"):
        assert rows[name]["mix"] is True and rows[name]["scheduler"]["mixed_forwards"] > 0, name
        assert rows[name]["mixed_step"] == {"form": "eager", "packed_steps": 0}, name  # on a CPU both are eager


def test_readers_questions_are_fed_or_mixed_as_asked(capsys, tmp_path):
    """`--feed-questions`: readers of a stored document have their questions fed a token a step ("always"), or read
    as chunks of the mixed forward where prompts mix ("auto" with `--mix eager` on a CPU); recorded in each row."""
    fed = {}
    for feed in ("always", "auto"):
        out = tmp_path / feed
        code, _, err = run(capsys, "bench", "throughput", "--shape", "tiny", "--device", "cpu", "--out", str(out),
                           "--method", "infinipot:pot_size=128", "--users", "3", "--lengths", "160", "--new-tokens", "3",
                           "--question-tokens", "6", "--document", "--mix", "eager", "--feed-questions", feed,
                           "--sequential-users", "1")
        assert code == 0, err
        results = json.loads((out / "results.json").read_text())
        row = results["rows"][0]
        assert row["method"] == "infinipot [batch]" and row["feed_questions"] == feed
        assert results["config"]["feed_questions"] == feed and row["completed"] == 3
        fed[feed] = (row["scheduler"]["fed_tokens"], row["scheduler"]["mixed_forwards"])
    assert fed["always"][0] == 3 * 6 and fed["auto"][0] == 0 and fed["auto"][1] > 0, fed


def test_an_unbounded_patience_is_recorded_as_strict_json(capsys, tmp_path):
    """`--prompt-patience inf` (shortest first, never overtaken) runs, and results.json stays JSON that strict readers
    (jq) take: "inf", not Python's `Infinity`."""
    out = tmp_path / "out"
    code, _, err = run(capsys, "bench", "throughput", "--shape", "tiny", "--device", "cpu", "--out", str(out),
                       "--method", "infinipot:pot_size=128", "--users", "2", "--lengths", "64", "--new-tokens", "2",
                       "--prompt-order", "shortest", "--prompt-patience", "inf", "--sequential-users", "1")
    assert code == 0, err

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    results = json.loads((out / "results.json").read_text(), parse_constant=refuse)
    assert results["config"]["prompt_patience"] == "inf" and float(results["config"]["prompt_patience"]) == float("inf")
    assert results["rows"][0]["prompt_patience"] == "inf"


def test_load_options_errors(capsys, tmp_path):
    base = ["bench", "throughput", "--shape", "tiny", "--method", "full", "--out", str(tmp_path / "o")]
    for extra, message in ((["--lengths", "4k", "--length-mix", "2k-8k"], "not both"),
                           (["--length-mix", "2k-8k", "--document"], "--document"),
                           (["--arrival-rate", "0"], "--arrival-rate"),
                           (["--new-tokens-mix", "9-3"], "--new-tokens-mix"),
                           (["--slo-ttft", "-1"], "--slo-ttft")):
        code, _, err = run(capsys, *base, *extra)
        assert code == 2 and message in err and err.count("\n") == 1, (extra, err)
    code, _, err = run(capsys, "bench", "prefill", "--shape", "tiny", "--method", "full", "--out",
                       str(tmp_path / "p"), "--arrival-rate", "1")
    assert code == 2 and "apply to bench throughput" in err


def test_help_teaches_the_load_options(capsys):
    with pytest.raises(SystemExit):
        from kvpot.cli import main

        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in ("--arrival-rate R", "--length-mix MIX", "--new-tokens-mix MIX", "--slo-ttft SECONDS",
                  "--slo-itl SECONDS", "exponential gap", "--length-mix 2k-32k --new-tokens-mix 64-256 "
                  "--arrival-rate 1", "p99 of its own gaps"):
        assert words in text, words


# ---------------------------------------------------------------------------- bench serve


def test_serve_summary_counts_from_each_request_s_arrival():
    """`bench serve`'s records (seconds from the workload's start) as figures from each arrival."""
    pytest.importorskip("openai")
    from kvpot.bench.serve_client import summarize

    def stream(user, arrival, first, chunks, tokens, prompt):
        return {"user": user, "arrival_seconds": arrival, "ttft_seconds": first, "chunk_seconds": chunks,
                "completion_tokens": tokens, "prompt_tokens": prompt, "finish_reason": "length",
                "end_seconds": chunks[-1], "error": None, "rejected": False}

    records = [stream(0, 0.0, 0.5, [0.5, 0.6, 0.7], 3, 100), stream(1, 2.0, 2.25, [2.25, 2.35, 3.35], 3, 50)]
    row = summarize({"records": records, "wall_seconds": 4.0}, slo_ttft=1.0, slo_itl=0.5)
    assert row["ttft_p50_seconds"] == pytest.approx(0.375)  # 0.5 and 0.25 from their arrivals
    # end to end 0.7 and 1.35 s: linear between them
    assert row["e2e_p50_seconds"] == pytest.approx(1.025) and row["e2e_p99_seconds"] == pytest.approx(0.7 + 0.99 * 0.65)
    assert row["slo_met"] == 1 and row["goodput_tokens_per_second"] == pytest.approx(3 / 4.0)  # user 1: a 1 s gap
    assert row["prompt_tokens_per_second"] == pytest.approx(150 / 4.0) and row["completed"] == 2


def test_serve_open_loop_with_mixes(capsys, tmp_path):
    """kvpot's server launched on `tiny`: requests sent at their Poisson arrivals, each with its drawn
    context length and new tokens; the http and engine rows carry the load's figures."""
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from kvpot.bench.serve_server import accepts

    out = tmp_path / "out"
    code, _, err = run(capsys, "bench", "serve", "--out", str(out), "--users", "3", "--question-tokens", "4",
                            "--threads", "1", "--shape", "tiny", "--device", "cpu", "--method",
                            "infinipot:pot_size=128", "--length-mix", "64-96", "--new-tokens-mix", "2,4",
                            "--arrival-rate", "10", "--seed", "5", "--slo-ttft", "300")
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    rows = {row["method"]: row for row in results["rows"]}
    http, engine = rows["infinipot [http]"], rows["infinipot [engine]"]
    arrivals = arrival_times(3, 10.0, seed=5)
    lengths, new = draw_mix("64-96", 3, 5, "length"), draw_mix("2,4", 3, 5, "new-tokens")
    assert [r["arrival_seconds"] for r in http["records"]] == arrivals
    assert all(r["ttft_seconds"] >= r["arrival_seconds"] for r in http["records"])
    assert http["prompt_tokens_sent_mean"] == pytest.approx(sum(lengths) / 3 + 4)
    assert engine["output_tokens"] == sum(new) and engine["completed"] == 3
    if accepts("ignore_eos"):
        assert http["output_tokens"] == sum(new)
    for row in (http, engine):
        assert row["slo_met_share"] == 1.0 and row["arrival_rate"] == 10.0 and row["e2e_p99_seconds"] > 0
    summary = (out / "summary.md").read_text()
    assert "Poisson arrivals, 10 requests/s" in summary and "| infinipot [http] | mix 64-96 | 3 | 3 |" in summary


def test_mixed_row_reads_prompt_chunks_in_the_decoding_forward(capsys, tmp_path):
    """`--mixed` and `--prompts-apart` add the batch with prompt chunks in the decoding rows' forward and in
    forwards of their own beside the default batch (`--mix auto`: apart on a CPU): the same tokens, fewer
    forwards in all when mixed; each row records its `mix`."""
    out = tmp_path / "out"
    code, _, err = run(capsys, "bench", "throughput", "--shape", "tiny", "--device", "cpu", "--out", str(out),
                       "--method", "streaming:window=60", "--users", "4", "--lengths", "128", "--new-tokens", "6",
                       "--question-tokens", "4", "--prefill-tokens", "32", "--mixed", "--prompts-apart",
                       "--sequential-users", "1")
    assert code == 0, err
    rows = {row["method"]: row for row in json.loads((out / "results.json").read_text())["rows"]}
    mixed, apart = rows["streaming [batch, mixed]"], rows["streaming [batch, prompts apart]"]
    assert (mixed["mix"], apart["mix"], rows["streaming [batch]"]["mix"]) == (True, False, False)
    # each batch row's step trace (kvpot.engine.trace): what its steps ran, the gaps its users saw
    assert "mixed" in mixed["steps"]["kinds"] and "mixed+apart" not in mixed["steps"]["kinds"]
    assert "apart" in apart["steps"]["kinds"] and not any("mixed" in kind for kind in apart["steps"]["kinds"])
    assert apart["steps"]["steps"] == apart["scheduler"]["steps"] - 1 and apart["steps"]["slowest"]
    summary = (out / "summary.md").read_text()
    assert "## Steps" in summary and "| streaming [batch, mixed] | 128 | mixed |" in summary
    # the window's evictions after mixed chunks, split out
    assert mixed["steps"]["kinds"]["mixed"]["compressing"]["steps"] > 0
    assert "| streaming [batch, mixed] | 128 | mixed, compressing |" in summary
    assert mixed["output_tokens"] == apart["output_tokens"] == rows["streaming [batch]"]["output_tokens"] == 24
    assert mixed["scheduler"]["mixed_forwards"] > 0 and apart["scheduler"]["mixed_forwards"] == 0
    assert mixed["scheduler"]["forwards"] < apart["scheduler"]["forwards"]


def test_the_first_warm_up_prompt_runs_a_whole_budget_and_a_bounded_method_s_first_compression():
    """`kvpot bench throughput`'s warm-up: its first prompt is long enough for two whole-budget forwards and, for a
    bounded method, to fill the cache once; a growing cache's stays within the slot; never under the short prompts'."""
    from types import SimpleNamespace

    import torch

    from kvpot.bench.throughput import WARMUP_PROMPT, _warm_length

    question = torch.zeros(10, dtype=torch.long)

    def engine(bound):
        return SimpleNamespace(method=SimpleNamespace(max_entries=lambda: bound))

    scheduler = SimpleNamespace(prefill_tokens=1024, capacity=4096 + 512)
    assert _warm_length(engine(4096), scheduler, question) == 4096 + 2048
    assert _warm_length(engine(None), SimpleNamespace(prefill_tokens=1024, capacity=40_000), question) == 2048
    assert _warm_length(engine(None), SimpleNamespace(prefill_tokens=1024, capacity=1500), question) == 1500 - 18
    assert _warm_length(engine(None), SimpleNamespace(prefill_tokens=64, capacity=200), question) == WARMUP_PROMPT
