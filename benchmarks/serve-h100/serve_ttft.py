"""Time to first token through `kvpot serve`: a stored document versus reading it fresh.

Builds a random-weight model of a kvpot bench shape (default `llama3-8b`) on the GPU, serves it
with `kvpot.serve.create_app` (uvicorn in a thread, a free loopback port) and, for each length:

1. uploads a document (POST /v1/documents): the server reads and compresses it once;
2. asks it `--reps` questions by `document_id` (the stored state: no prefill);
3. asks the same kind of question with the document as the first user message of a fresh text
   (a different document each time, so nothing is stored: the whole prefill is paid);

each with `max_tokens=1`, so the request's wall time is its time to first token (HTTP included);
the server's own measure (`kvpot.time_to_first_token`) is recorded next to it. Weights are random
and the tokenizer is kvpot's byte tokenizer (one token per byte; the model's vocabulary stays the
shape's), so the numbers are about time, not answers. Writes `results.json` and `results.md`.

    python benchmarks/serve-h100/serve_ttft.py --shape llama3-8b --lengths 32k,128k --method infinipot:pot_size=4096
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import sys
import threading
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def document(tokens: int, seed: int) -> str:
    """`tokens` bytes of varied ASCII sentences (the byte tokenizer: one token per byte)."""
    rng = random.Random(seed)
    words = ["river", "ledger", "orbit", "copper", "signal", "harbor", "velvet", "summit", "quartz", "meadow"]
    parts, size = [], 0
    while size < tokens:
        sentence = " ".join(rng.choice(words) for _ in range(8)).capitalize() + f" {rng.randint(0, 99999)}. "
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts)[: tokens - 1]  # BOS makes it `tokens`


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--method", default="infinipot:pot_size=4096")
    parser.add_argument("--lengths", default="32k,128k")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "records" / "serve-h100" / "results")
    args = parser.parse_args()

    import httpx
    import openai
    import torch
    import uvicorn

    from kvpot.engine import Engine
    from kvpot.eval.config import parse_lengths
    from kvpot.models.reference.tokenizer import build_tokenizer
    from kvpot.serve import ServeConfig, create_app
    from kvpot.methods.spec import build_method
    from kvpot.models.shapes import build

    model = build(args.shape, device=args.device, dtype=torch.bfloat16 if args.device != "cpu" else None)
    engine = Engine(model, build_tokenizer(), method=build_method(args.method), chat_template=False)
    lengths = parse_lengths(args.lengths)
    config = ServeConfig(method=args.method, served_model_name=args.shape, max_context_tokens=max(lengths) + 1024,
                         max_body_bytes=max(lengths) * 2 + (1 << 20), state_memory=64 * 1024**3,
                         cache_min_tokens=1 << 30)  # fresh reads are never stored: each pays its prefill
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, config), host="127.0.0.1", port=port,
                                           log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600)
    question = "\nWhich number follows the word summit first? It is"

    def ask(**kwargs) -> tuple[float, float]:
        started = time.perf_counter()
        out = client.chat.completions.create(model=args.shape, max_tokens=1, temperature=0, **kwargs)
        return time.perf_counter() - started, out.model_extra["kvpot"]["time_to_first_token"]

    ask(messages=[{"role": "user", "content": document(4096, 0)}, {"role": "user", "content": question}])  # warm-up
    rows = []
    for length in lengths:
        text = document(length, length)
        started = time.perf_counter()
        doc = httpx.post(f"{url}/v1/documents", json={"text": text}, timeout=3600).json()
        upload = time.perf_counter() - started
        stored = [ask(messages=[{"role": "user", "content": question}], extra_body={"document_id": doc["id"]})
                  for _ in range(args.reps)]
        fresh = [ask(messages=[{"role": "user", "content": document(length, length * 1000 + rep)},
                               {"role": "user", "content": question}]) for rep in range(args.reps)]
        row = {"length": length, "context_tokens": doc["context_tokens"], "kept_kv_entries": doc["kept_kv_entries"],
               "state_bytes": doc["bytes"], "upload_seconds": upload, "document_prefill_seconds": doc["seconds"],
               "ttft_stored_s": statistics.median(s[0] for s in stored),
               "ttft_stored_server_s": statistics.median(s[1] for s in stored),
               "ttft_fresh_s": statistics.median(f[0] for f in fresh),
               "ttft_fresh_server_s": statistics.median(f[1] for f in fresh)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    server.should_exit = True
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"shape": args.shape, "method": args.method, "device": gpu, "reps": args.reps, "torch": torch.__version__}
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [f"# kvpot serve: time to first token, {args.shape} (random weights), {args.method}, {gpu}", "",
             "| context tokens | kept KV entries | state | read once (s) | TTFT stored (s) | TTFT fresh (s) | speed-up |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['context_tokens']:,} | {r['kept_kv_entries']:,} | {r['state_bytes'] / 2**20:,.0f} MiB | "
                     f"{r['document_prefill_seconds']:.2f} | {r['ttft_stored_s']:.3f} | {r['ttft_fresh_s']:.2f} | "
                     f"{r['ttft_fresh_s'] / r['ttft_stored_s']:.0f}x |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
