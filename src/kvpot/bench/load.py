"""Open-loop load for `kvpot bench throughput` and `bench serve`: when requests arrive, what each one
asks (prompt length and new tokens drawn from mixes), and the figures a row reports from each
request's own clock (latencies from its arrival, SLOs, goodput).

- Arrivals (`--arrival-rate R`): the first request arrives at 0 s, each next one an exponential gap
  (mean 1/R s, `random.Random(f"{seed}:arrivals").expovariate(R)`) later: a Poisson process of R
  requests per second. `None` (`inf`): every request at 0 s, all at once.
- Mixes (`--length-mix`, `--new-tokens-mix`): `2k,8k,32k` draws each request's value uniformly from
  the list (a value listed twice is twice as likely), `2k-32k` uniformly from the whole numbers of
  the range, both ends included; with `random.Random(f"{seed}:{what}")`, one draw per request in order.
- Records: one dict per request, `arrival` (s from the workload's start), `ttft` and `e2e` (s from its
  arrival to its first and last token), `gaps` (s between its delivered tokens), `output_tokens`,
  `prompt_tokens`, `finished`, and `times` (s from the workload's start of its delivered tokens).
- While prompts are read: a gap counts when it overlaps some request's wait for its first token (from its
  arrival to its first token, queueing for a slot included). Issue 43 states its ITL target over these gaps
  (`itl_reading_p50_ms` / `itl_reading_p99_ms`): with a stream of fresh prompts the gaps between two reads are
  decoding steps alone, and a median over every gap depends on how many of those there were.
- SLOs: a request meets them when it finished, its TTFT <= `slo_ttft` and the p99 of its own gaps
  (`quantile(gaps, 0.99)`; its only gap for two tokens, none: met) <= `slo_itl`; goodput = output
  tokens of the requests that met them / the workload's wall time.
"""

from __future__ import annotations

import bisect
import math
import random
import statistics
import time
from collections import deque

from kvpot.errors import KvpotError

PERCENTILES = (50, 95, 99)


# ---------------------------------------------------------------------------- what arrives, and when


def parse_rate(text) -> float | None:
    """`--arrival-rate`: requests per second > 0, or `inf` (None: all at once)."""
    try:
        rate = float(text)
    except (TypeError, ValueError):
        raise KvpotError(f"--arrival-rate {text!r}: give requests per second (e.g. 1, 0.5) or inf.") from None
    if math.isnan(rate) or rate <= 0:
        raise KvpotError(f"--arrival-rate must be positive (or inf), got {text!r}.")
    return None if rate == float("inf") else rate


def arrival_times(count: int, rate: float | None, seed: int) -> list[float]:
    """Seconds from the workload's start at which each of `count` requests arrives (see the module)."""
    if rate is None:
        return [0.0] * count
    rng, times, now = random.Random(f"{seed}:arrivals"), [], 0.0
    for index in range(count):
        if index:
            now += rng.expovariate(rate)
        times.append(now)
    return times


def parse_mix(text: str, option: str) -> tuple[str, list[int]]:
    """(`"values"`, [a, b, ...]) from `a,b,...` or (`"range"`, [low, high]) from `low-high`; lengths
    may be written 2k, 32k (binary units)."""
    text = str(text).strip()
    ranged = "-" in text and "," not in text
    try:
        values = [_count(part) for part in (text.split("-", 1) if ranged else text.split(",")) if part.strip()]
    except KvpotError as err:
        raise KvpotError(f"{option} {text!r}: {err} Give a list (2k,8k,32k) or a range (2k-32k).") from None
    if ranged and len(values) == 2:
        if values[0] > values[1]:
            raise KvpotError(f"{option} {text!r}: the range's low end is above its high end.")
        return "range", values
    if ranged or not values:
        raise KvpotError(f"{option} {text!r}: give a list (2k,8k,32k) or a range (2k-32k).")
    return "values", values


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20}


def _count(text: str) -> int:
    """A whole positive count: 64, 2k (2048), 1.5k (1536), 1m (binary units, as --lengths)."""
    text = text.strip().lower()
    unit = text[-1:] if text[-1:] in ("k", "m") else ""
    try:
        value = float(text[: len(text) - len(unit)]) * _UNITS[unit]
    except ValueError:
        raise KvpotError(f"{text!r} is not a count such as 64, 2k or 1m.") from None
    if not value >= 1 or not value.is_integer():
        raise KvpotError(f"{text!r} is not a whole positive number.")
    return int(value)


def mix_bounds(text: str, option: str) -> tuple[int, int]:
    _, values = parse_mix(text, option)
    return min(values), max(values)


def draw_mix(text: str, count: int, seed: int, what: str) -> list[int]:
    """`count` values drawn from the mix `text` (list: uniform choice; range: uniform integer)."""
    kind, values = parse_mix(text, f"--{what}-mix")
    rng = random.Random(f"{seed}:{what}")
    if kind == "range":
        return [rng.randint(values[0], values[1]) for _ in range(count)]
    return [rng.choice(values) for _ in range(count)]


# ---------------------------------------------------------------------------- the step-driven loop


def run_open_loop(scheduler, requests: list, arrivals: list[float], clock=time.perf_counter,
                  sleep=time.sleep) -> float:
    """Submit each request once its arrival time has come (between steps), step until every one is done.
    When the engine is idle and the next arrival is ahead, sleep until it. Returns the start (clock)."""
    from kvpot.engine.requests import QueueFull

    pending = deque(sorted(zip(arrivals, range(len(requests))), key=lambda pair: pair))
    begun = clock()
    while pending or not scheduler.idle:
        now = clock() - begun
        while pending and pending[0][0] <= now:
            try:
                scheduler.submit(requests[pending[0][1]])
            except QueueFull:
                break  # every slot and the queue are full: the next step frees one
            pending.popleft()
        if scheduler.idle:
            if pending:
                sleep(max(0.0, pending[0][0] - (clock() - begun)))
            continue
        scheduler.step()
    failed = [r for r in requests if r.status == "failed"]
    if failed:
        raise KvpotError(f"{len(failed)} of {len(requests)} requests failed; the first: {failed[0].error}")
    return begun


def request_record(request, arrival: float, begun: float, prompt_tokens: int) -> dict:
    """A scheduler's finished `Request` as a record; `arrival` in s from `begun` (the loop's start)."""
    at = begun + arrival
    times = request.token_times
    end = request.finished_time or (times[-1] if times else None)
    return {"arrival": arrival, "ttft": None if request.first_token_time is None else request.first_token_time - at,
            "gaps": [b - a for a, b in zip(times, times[1:])], "times": [t - begun for t in times],
            "e2e": None if end is None else end - at,
            "output_tokens": len(request.tokens), "prompt_tokens": prompt_tokens,
            "finished": request.status == "finished",
            # from its slot to its first token: the rest of its TTFT it waited for a slot
            "read": request.stats.prefill_seconds if request.stats is not None else None}


def request_row(record: dict) -> dict:
    """One request's figures as a row's `per_request` keeps them: its arrival, tokens, TTFT (and, through kvpot's
    scheduler, `read`: the part from its slot to its first token), end to end, and the p50 / p99 of its own token
    gaps. The row's percentiles pool every request; these tell a TTFT by prompt length and arrival."""
    gaps = [1000 * g for g in record["gaps"]]

    def rounded(value):
        return None if value is None else round(value, 4)

    return {"arrival": rounded(record["arrival"]), "prompt_tokens": record["prompt_tokens"],
            "output_tokens": record["output_tokens"], "ttft": rounded(record["ttft"]), "read": rounded(record.get("read")),
            "e2e": rounded(record["e2e"]), "itl_p50_ms": rounded(quantile(gaps, 0.5)),
            "itl_p99_ms": rounded(quantile(gaps, 0.99)), "finished": record["finished"]}


# ---------------------------------------------------------------------------- figures


def quantile(values: list[float], q: float) -> float | None:
    """The q-quantile, linear between order statistics (`statistics.quantiles`, inclusive), at whole percents."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[max(0, min(98, round(100 * q) - 1))]


def meets_slo(record: dict, slo_ttft: float | None, slo_itl: float | None) -> bool:
    if not record["finished"] or record["ttft"] is None:
        return False
    if slo_ttft is not None and record["ttft"] > slo_ttft:
        return False
    return slo_itl is None or not record["gaps"] or quantile(record["gaps"], 0.99) <= slo_itl


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of intervals."""
    return sum(stop - start for start, stop in merged(intervals))


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals, as sorted disjoint intervals."""
    out: list[tuple[float, float]] = []
    for start, stop in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def load_figures(records: list[dict], wall: float, slo_ttft: float | None = None,
                 slo_itl: float | None = None) -> dict:
    """Percentiles (TTFT, ITL, end to end, from each request's arrival), prompt tokens/s, SLO share, goodput."""
    ttft = [r["ttft"] for r in records if r["ttft"] is not None]
    gaps = [1000 * g for r in records for g in r["gaps"]]
    e2e = [r["e2e"] for r in records if r["e2e"] is not None and r["finished"]]
    row = {}
    for p in PERCENTILES:
        row[f"ttft_p{p}_seconds"] = quantile(ttft, p / 100)
        row[f"itl_p{p}_ms"] = quantile(gaps, p / 100)
        row[f"e2e_p{p}_seconds"] = quantile(e2e, p / 100)
    row["itl_max_ms"] = max(gaps) if gaps else None
    row.update(reading_figures(records))
    read = [r for r in records if r["ttft"] is not None]
    prompt = sum(r["prompt_tokens"] or 0 for r in read)
    busy = busy_seconds([(r["arrival"], r["arrival"] + r["ttft"]) for r in read])
    row.update(prompt_tokens=prompt, prompt_tokens_per_second=prompt / wall if wall > 0 else None,
               prompt_busy_seconds=busy, prompt_tokens_per_busy_second=prompt / busy if busy > 0 else None)
    row.update(slo_figures(records, wall, slo_ttft, slo_itl))
    return row


def reading_figures(records: list[dict]) -> dict:
    """ITL p50 / p99 (ms) over the gaps that overlap some request's wait for its first token (see the module),
    and how many gaps those were; empty where the records carry no token times."""
    if not any("times" in r for r in records):
        return {}
    waits = merged([(r["arrival"], r["arrival"] + r["ttft"]) for r in records if r["ttft"] is not None])
    starts = [start for start, _ in waits]
    during = []
    for record in records:
        times = record.get("times") or []
        for a, b in zip(times, times[1:]):
            i = bisect.bisect_left(starts, b) - 1  # the last wait that starts before the gap ends
            if i >= 0 and waits[i][1] > a:
                during.append(1000 * (b - a))
    return {"itl_reading_p50_ms": quantile(during, 0.5), "itl_reading_p99_ms": quantile(during, 0.99),
            "itl_reading_gaps": len(during)}


def slo_figures(records: list[dict], wall: float, slo_ttft: float | None, slo_itl: float | None) -> dict:
    if slo_ttft is None and slo_itl is None:
        return {"slo_met": None, "slo_met_share": None, "goodput_tokens_per_second": None}
    met = [r for r in records if meets_slo(r, slo_ttft, slo_itl)]
    good = sum(r["output_tokens"] for r in met)
    return {"slo_met": len(met), "slo_met_share": len(met) / len(records) if records else None,
            "goodput_tokens_per_second": good / wall if wall > 0 else None}


def load_config(config) -> dict:
    """What a row records of its load: rate, mixes, seed, SLOs (ITL judged at each request's p99 gap)."""
    return {"arrival_rate": config.arrival_rate, "length_mix": config.length_mix,
            "new_tokens_mix": config.new_tokens_mix, "seed": config.seed, "slo_ttft_seconds": config.slo_ttft,
            "slo_itl_seconds": config.slo_itl, "slo_itl_percentile": 99}


def workload_plan(config, length: int) -> dict:
    """Per user: arrival (s), prompt length (the context's tokens; `length` without a length mix) and
    new tokens (`config.new_tokens` without a new-tokens mix)."""
    users = config.users
    lengths = draw_mix(config.length_mix, users, config.seed, "length") if config.length_mix else [length] * users
    new = (draw_mix(config.new_tokens_mix, users, config.seed, "new-tokens") if config.new_tokens_mix
           else [config.new_tokens] * users)
    return {"arrivals": arrival_times(users, config.arrival_rate, config.seed), "lengths": lengths, "new_tokens": new}
