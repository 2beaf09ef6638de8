"""One line a row of a `kvpot bench throughput` results.json: the fields a device call's log should show.

    python benchmarks/engine-core-h100/rows.py RESULTS_JSON [--keys a,b,...] [--counts c,d,...]

`--keys` are the row's own fields, `--counts` the scheduler's counts (`row["scheduler"]`); a missing file prints
"no results" (a run stopped by its time limit).
"""

from __future__ import annotations

import argparse
import json

KEYS = "method,output_tokens_per_second,ttft_p50_seconds,itl_p50_ms,itl_p99_ms,error"
COUNTS = "steps"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results")
    p.add_argument("--keys", default=KEYS)
    p.add_argument("--counts", default=COUNTS)
    args = p.parse_args(argv)
    try:
        with open(args.results) as f:
            data = json.load(f)
    except OSError:
        print("no results")
        return
    keys, counts = args.keys.split(","), args.counts.split(",")
    for row in data["rows"]:
        print({k: row.get(k) for k in keys}, {k: (row.get("scheduler") or {}).get(k) for k in counts})


if __name__ == "__main__":
    main()
