"""Which prompt order, and which patience, to measure next: issue 43's open-loop workload (`open_loop.sh`'s) replayed
through the scheduler's own policy code with a step time in place of a model. A prediction, not a measurement.

The workload is the benchmark's: `--users` prompts of 2K-32K tokens and 64-256 new tokens drawn with the bench's seeds
(`kvpot.bench.load.draw_mix`), Poisson arrivals (`arrival_times`). Each step the requests reading their prompt are
ordered by `kvpot.engine.plan.reading_order` (the policy under test) and their chunks chosen by `plan_chunks`
within `--budget` tokens, as `Scheduler._chunks` does; a step that reads costs `--step-ms`, one that only decodes
`--decode-ms`. A prompt's first token comes one decoding step after its last chunk. Slots are not limited.

What it leaves out: InfiniPot's pot boundaries (its chunks stop at a pot's fill, so a step may read fewer tokens),
the steps' spread (compressing steps take ~9 ms more), forwards read apart when nothing decodes. `--step-ms 50` folds
them in: at seed 0 it gives arrival order a TTFT p50 / p95 of 2.13 / 9.50 s and shortest first (patience 10 s)
1.22 / 11.47 s, where an H200 measured 2.04 / 9.27 and 1.19 / 11.23 s
(records/engine-core-h200/packed-4/). Unchanged, it gave 2.13 / 9.50 s for arrival order and 1.36 / 9.50 s for
shortest first with a 4 s patience, where an H100 then measured 2.09 / 9.54 and 1.35-1.38 / 9.36-9.37 s
(records/engine-core-h100/prompt-order/). Use it to choose the runs, then measure them (`compiled_gpu.sh`,
`ORDERS="shortest@5 ..."`).

    python benchmarks/engine-core-h100/order_model.py --out DIR [--rates 0.8,1,1.2] [--seeds 20]
        [--policies arrival,shortest@3,shortest@5,shortest@10,shortest@inf] [--step-ms 50]
    python benchmarks/engine-core-h100/order_model.py --out DIR --measured RESULTS_JSON [--measured ...]
        (each measured run's TTFT beside the model's for its workload and policy: whether the model still holds)

Writes DIR/order_model.json (per rate and policy: each seed's TTFT p50 / p95 / max / mean, and their median and range
over the seeds), DIR/summary.md and DIR/order_model.png (p50 against p95, a point per policy), and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from types import SimpleNamespace

BEFORE_THE_OPTION = 10.0  # s: the fixed patience of runs recorded before `--prompt-patience` existed


def parse_policy(text: str) -> tuple[str, float]:
    """"arrival", "shortest" or "shortest@SECONDS" (`inf` allowed) -> (order, patience)."""
    from kvpot.defaults import PROMPT_ORDERS, PROMPT_PATIENCE

    order, _, patience = text.partition("@")
    if order not in PROMPT_ORDERS:
        raise SystemExit(f"order_model: a policy is one of {PROMPT_ORDERS}, optionally @SECONDS; got {text!r}")
    return order, float(patience) if patience else PROMPT_PATIENCE


def simulate(order: str, patience: float, seed: int, users: int, rate: float, budget: int, step_ms: float,
             decode_ms: float, lengths: str = "2k-32k", new_tokens: str = "64-256") -> dict:
    """TTFT (seconds from arrival) of every request of one workload under one policy."""
    from kvpot.bench.load import arrival_times, draw_mix
    from kvpot.engine.plan import Candidate, plan_chunks, reading_order

    arrivals = arrival_times(users, rate, seed)
    prompt = draw_mix(lengths, users, seed=seed, what="length")
    new = draw_mix(new_tokens, users, seed=seed, what="new-tokens")
    now, waiting, reading, decoding, ttft = 0.0, list(range(users)), {}, {}, {}
    while len(ttft) < users:
        while waiting and arrivals[waiting[0]] <= now:
            index = waiting.pop(0)
            reading[index] = SimpleNamespace(request=SimpleNamespace(status="prefilling"), started=now, feeding=None,
                                             reader=SimpleNamespace(remaining=prompt[index]))
        order_now = reading_order(reading, order, now, patience)
        if not order_now:  # nothing to read: decode until the next arrival
            now = now + decode_ms / 1000 if decoding else arrivals[waiting[0]]
            decoding = {i: n - 1 for i, n in decoding.items() if n > 1}
            continue
        plan = plan_chunks([Candidate(i, min(a.reader.remaining, budget), True, True) for i, a in order_now], budget,
                           decoding=max(1, len(decoding)))
        now += step_ms / 1000
        for index in plan.slots:
            left = reading[index].reader
            cut = plan.cut_to if index == plan.slots[-1] and plan.cut_to is not None else None
            left.remaining -= cut if cut is not None else min(left.remaining, budget)
            if left.remaining <= 0:
                ttft[index] = now + decode_ms / 1000 - arrivals[index]
                del reading[index]
                decoding[index] = new[index]
        decoding = {i: n - 1 for i, n in decoding.items() if n > 1}
    values = sorted(ttft.values())
    return {"p50": statistics.median(values), "p95": statistics.quantiles(values, n=20)[18], "max": values[-1],
            "mean": statistics.fmean(values)}


def summarize(runs: list[dict]) -> dict:
    return {key: {"median": statistics.median(r[key] for r in runs), "min": min(r[key] for r in runs),
                  "max": max(r[key] for r in runs)} for key in ("p50", "p95", "max", "mean")}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rates", default="0.8,1,1.2", help="arrival rates, requests/s (default 0.8,1,1.2)")
    p.add_argument("--seeds", type=int, default=20, help="workloads per rate, seeds 0..N-1 (default 20)")
    p.add_argument("--policies", default="arrival,shortest@3,shortest@5,shortest@10,shortest@inf")
    p.add_argument("--users", type=int, default=48)
    p.add_argument("--budget", type=int, default=1024, help="prompt tokens a step (default 1,024)")
    p.add_argument("--step-ms", type=float, default=50.0, help="a step that reads (default 50: see the docstring)")
    p.add_argument("--decode-ms", type=float, default=6.9, help="a step that only decodes (default 6.9, an H200's)")
    p.add_argument("--measured", type=Path, action="append", default=[], metavar="RESULTS_JSON",
                   help="a `kvpot bench throughput` open-loop results.json (plain or packed in records/): its batch "
                        "row's TTFT p50 / p95 beside the model's for the same workload and policy (repeatable)")
    args = p.parse_args(argv)
    if args.measured:
        compare(args)
        return
    policies = [parse_policy(text.strip()) for text in args.policies.split(",")]
    rates = [float(r) for r in args.rates.split(",")]
    results = []
    for rate in rates:
        for order, patience in policies:
            runs = [simulate(order, patience, seed, args.users, rate, args.budget, args.step_ms, args.decode_ms)
                    for seed in range(args.seeds)]
            results.append({"rate": rate, "order": order, "patience": patience if patience != float("inf") else "inf",
                            "seeds": runs,
                            "over_seeds": summarize(runs)})
    lines = ["| rate | policy | TTFT p50 s (median [range] over seeds) | p95 s | max s | seed 0 p50 / p95 s |",
             "| ---: | --- | --- | --- | --- | --- |"]
    for row in results:
        s = row["over_seeds"]
        name = row["order"] if row["order"] == "arrival" else f"shortest, patience {float(row['patience']):g} s"
        cell = lambda k: f"{s[k]['median']:.2f} [{s[k]['min']:.2f}-{s[k]['max']:.2f}]"  # noqa: E731
        first = row["seeds"][0]
        lines.append(f"| {row['rate']:g} | {name} | {cell('p50')} | {cell('p95')} | {s['max']['median']:.2f} | "
                     f"{first['p50']:.2f} / {first['p95']:.2f} |")
    table = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (args.out / "order_model.json").write_text(json.dumps({"config": config, "results": results}, indent=1))
    (args.out / "summary.md").write_text(f"# Prompt order, modelled (not measured)\n\n{table}\n")
    plot(results, args.out / "order_model.png")
    print(table)


def compare(args) -> None:
    """Measured against modelled: each results.json's `[batch]` row and the model on its workload and policy."""
    from kvpot.eval.recorded import read_json

    lines = ["| run | policy | measured TTFT p50 / p95 s | modelled p50 / p95 s |", "| --- | --- | --- | --- |"]
    for path in args.measured:
        results = read_json(path)
        config = results["config"]
        for row in results["rows"]:
            if not row["method"].endswith("[batch]") or row.get("arrival_rate") is None:
                continue
            order = row.get("prompt_order") or "arrival"
            # not today's default for a row without the field; "inf" parses as float
            patience = float(row.get("prompt_patience", BEFORE_THE_OPTION))
            model = simulate(order, patience, config["seed"], row["requests"], row["arrival_rate"],
                             row["prefill_tokens_per_step"], args.step_ms, args.decode_ms, config["length_mix"],
                             config["new_tokens_mix"])
            name = order if order == "arrival" else f"shortest, {patience:g} s"
            lines.append(f"| {path} | {name} | {row['ttft_p50_seconds']:.2f} / {row['ttft_p95_seconds']:.2f} | "
                         f"{model['p50']:.2f} / {model['p95']:.2f} |")
    print("\n".join(lines))


def plot(results: list[dict], path: Path) -> None:
    """TTFT p50 against p95 (medians over the seeds), a point per policy and a panel per rate: the trade to choose."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # (matplotlib is the bench extra's)
        return
    rates = sorted({row["rate"] for row in results})
    fig, axes = plt.subplots(1, len(rates), figsize=(4.2 * len(rates), 3.8), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for row in (r for r in results if r["rate"] == rate):
            s = row["over_seeds"]
            label = "arrival" if row["order"] == "arrival" else f"{float(row['patience']):g} s"
            ax.scatter(s["p95"]["median"], s["p50"]["median"], color="C3" if label == "arrival" else "C0")
            ax.annotate(label, (s["p95"]["median"], s["p50"]["median"]), fontsize=8, xytext=(3, 3),
                        textcoords="offset points")
        ax.axhline(1.5, color="grey", lw=0.8, ls="--")
        ax.set(title=f"{rate:g} requests/s", xlabel="TTFT p95 (s)", ylabel="TTFT p50 (s)")
    fig.suptitle("Prompt order: arrival, or shortest first with a patience (modelled; medians over seeds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
