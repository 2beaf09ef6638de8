"""GET /metrics in Prometheus' text format (no client library needed): counters, the batch's gauges
and histograms of time to first token, inter-token latency and batch size per step."""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter, deque

_RATE_WINDOW = 10.0  # seconds over which output tokens/s is measured


class Histogram:
    """Cumulative buckets, a sum and a count (a Prometheus histogram)."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times

    def lines(self, name: str, help_text: str) -> list[str]:
        out = [f"# HELP kvpot_{name} {help_text}", f"# TYPE kvpot_{name} histogram"]
        total = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            total += count
            out.append(f'kvpot_{name}_bucket{{le="{"+Inf" if bound == float("inf") else f"{bound:g}"}"}} {total}')
        return out + [f"kvpot_{name}_sum {self.sum:g}", f"kvpot_{name}_count {self.count}"]


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests: Counter[tuple[str, str, int]] = Counter()  # (method, route, status)
        self.prompt_tokens = 0
        self.prefill_tokens = 0  # tokens actually read (cached contexts are not re-read)
        self.prefill_seconds = 0.0
        self.cached_tokens = 0  # context tokens answered from a stored state
        self.generated_tokens = 0
        self.ttft = Histogram((0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.itl = Histogram((0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.08, 0.1, 0.2, 0.5, 1, 2.5))
        self.batch_size = Histogram((1, 2, 4, 8, 16, 32, 64, 128, 256))
        # delivery times of recent tokens (appended without the lock: a deque's append is atomic)
        self.ticks: deque[float] = deque(maxlen=200_000)

    def request(self, method: str, route: str, status: int) -> None:
        with self.lock:
            self.requests[(method, route, status)] += 1

    def add(self, **values) -> None:
        with self.lock:
            for name, value in values.items():
                setattr(self, name, getattr(self, name) + value)

    # ---------------------------------------------------------------- from the generation thread
    def tick(self) -> None:
        """A token was delivered."""
        self.ticks.append(time.monotonic())

    def batch(self, rows: int) -> None:
        with self.lock:
            self.batch_size.observe(rows)

    def finished(self, request) -> None:
        """An engine request ended: its inter-token latencies."""
        times = request.token_times
        with self.lock:
            for before, after in zip(times, times[1:]):
                self.itl.observe(after - before)

    # ---------------------------------------------------------------- from the event loop
    def answered(self, prompt_tokens: int, cached_tokens: int, generated: int, ttft: float | None) -> None:
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.cached_tokens += cached_tokens
            self.generated_tokens += generated
            if ttft is not None:
                self.ttft.observe(ttft)

    def render(self, worker, store) -> str:
        """The exposition text; gauges come from the worker and the state store at call time."""
        totals = store.totals()
        used, slots = worker.slots()
        documents, readers, copies = worker.shared()
        forwards, mixed, ahead = worker.forwards()
        waiting, running = worker.waiting, worker.running
        with self.lock:
            now = time.monotonic()
            recent = sum(1 for t in list(self.ticks) if t >= now - _RATE_WINDOW)
            lines = [
                "# HELP kvpot_requests_total HTTP requests by method, route and status.",
                "# TYPE kvpot_requests_total counter",
                *(f'kvpot_requests_total{{method="{m}",route="{r}",status="{s}"}} {n}'
                  for (m, r, s), n in sorted(self.requests.items())),
                *_metric("waiting_requests", "gauge", "Admitted requests waiting for a slot (or documents waiting "
                         "to be read).", waiting),
                *_metric("running_requests", "gauge", "Requests holding a slot (or a document being read).", running),
                *_metric("queue_depth", "gauge", "Same as kvpot_waiting_requests (earlier name).", waiting),
                *_metric("running", "gauge", "Same as kvpot_running_requests (earlier name).", running),
                *_metric("slots_used", "gauge", "KV slots taken, over every method's pool.", used),
                *_metric("slots_free", "gauge", "KV slots free, over every method's pool.", slots - used),
                *_metric("shared_documents", "gauge", "Stored documents loaded once for their readers "
                         "(--share-documents).", documents),
                *_metric("shared_document_readers", "gauge", "Requests reading a shared document now.", readers),
                *_metric("copy_on_write_total", "counter", "Readers of a shared document that took their own copy.",
                         copies),
                *_metric("forwards_total", "counter", "Model forwards of the batched steps: decoding, prompt chunks "
                         "read beside the decoding rows, prompt forwards of their own.", forwards),
                *_metric("mixed_forwards_total", "counter", "Forwards that read prompt chunks beside the decoding rows "
                         "(--mix).", mixed),
                *_metric("ahead_steps_total", "counter", "Decoding steps launched before the previous step's tokens "
                         "were handed over (--launch-ahead).", ahead),
                *_metric("rejected_total", "counter",
                         "Requests refused with 429 (slots and queue full, or no memory for a pool).", worker.rejected),
                *_metric("cancelled_total", "counter", "Requests stopped because the client went away.",
                         worker.cancelled),
                *_metric("prompt_tokens_total", "counter", "Prompt tokens of answered requests.", self.prompt_tokens),
                *_metric("prefill_tokens_total", "counter", "Tokens read by prefill (stored contexts excluded).",
                         self.prefill_tokens),
                *_metric("prefill_seconds_total", "counter", "Seconds spent reading contexts (wall time, reads "
                         "interleaved with decoding).", self.prefill_seconds),
                *_metric("cached_tokens_total", "counter", "Context tokens answered from stored states.",
                         self.cached_tokens),
                *_metric("generated_tokens_total", "counter", "Tokens generated for answered requests.",
                         self.generated_tokens),
                *_metric("output_tokens_per_second", "gauge", f"Tokens delivered per second over the last "
                         f"{_RATE_WINDOW:g} s, every request together.", recent / _RATE_WINDOW),
                *self.ttft.lines("time_to_first_token_seconds", "Time from a request's arrival to its first token."),
                *self.itl.lines("inter_token_latency_seconds", "Gaps between a request's consecutive tokens."),
                *self.batch_size.lines("batch_size", "Sequences decoded per step of a pool."),
                *_metric("kv_state_bytes", "gauge", "Bytes of KV states held in memory.", totals["memory_bytes"]),
                *_metric("kv_state_disk_bytes", "gauge", "Bytes of KV states in --state-dir.", totals["disk_bytes"]),
                *_metric("kv_states", "gauge", "Stored states (documents and contexts).", totals["states"]),
            ]
        return "\n".join(lines) + "\n"


def _metric(name: str, kind: str, help_text: str, value) -> list[str]:
    return [f"# HELP kvpot_{name} {help_text}", f"# TYPE kvpot_{name} {kind}", f"kvpot_{name} {value:g}"
            if isinstance(value, float) else f"kvpot_{name} {value}"]
