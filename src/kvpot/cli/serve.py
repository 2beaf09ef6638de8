"""`kvpot serve`: run the OpenAI-compatible server (library code in `kvpot.serve`).

A command module: `register(subparsers)` adds the parser, `run(args)` serves until interrupted.
"""

from __future__ import annotations

import argparse
import os

DEFAULT_METHOD = "infinipot:pot_size=4096"  # bounded, as `kvpot generate`'s default


def register(subparsers) -> None:
    from kvpot.cli.args import METHOD_METAVAR, QUESTIONS_HELP, add_decode_argument, add_model_arguments, add_tp_argument
    from kvpot.defaults import (FEED_QUESTIONS, FEED_QUESTIONS_CHOICES, LAUNCH_AHEAD, LAUNCH_AHEADS, MIX, MIXES,
                                PREFILL_TOKENS, PROMPT_ORDER, PROMPT_ORDERS, PROMPT_PATIENCE)

    p = subparsers.add_parser(
        "serve",
        help="serve an OpenAI-compatible API where a long document is read once and asked many times",
        description=(
            "Serve /v1/chat/completions, /v1/completions and /v1/models (OpenAI's API, streaming included) "
            "plus /v1/documents: upload a long text once, then ask about it with document_id; its compressed "
            "KV state is kept (in memory, spilled to --state-dir) instead of being read again. Many users are "
            "served at once: their requests decode together over bounded KV caches (continuous batching). Binds "
            "127.0.0.1 unless --host says otherwise. Needs the serve extra: pip install 'kvpot[serve]'."
        ),
        epilog=(
            "examples:\n"
            "  kvpot serve --method infinipot               # bundled reference model (2,048-token window), port 8000\n"
            "  kvpot serve --model meta-llama/Llama-3.1-8B-Instruct --method infinipot:pot_size=4096 \\\n"
            "      --state-dir ~/.cache/kvpot/states --api-key $KEY\n"
            "  kvpot serve --model smollm2-135m --device cuda --replicas 2 --state-dir /shared/states   # 2 GPUs\n"
            "  torchrun --nproc-per-node 2 -m kvpot serve --tp 2 --model meta-llama/Llama-3.1-8B-Instruct \\\n"
            "      --method infinipot:pot_size=4096   # one server, every layer split over 2 GPUs (rank 0 serves HTTP)"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(p)
    add_decode_argument(p)
    p.add_argument("--method", default=DEFAULT_METHOD, metavar=METHOD_METAVAR,
                   help=f"method for reading contexts; documents may name their own (default: {DEFAULT_METHOD})")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $KVPOT_API_KEY, else no key). Without a key, "
                        "only requests whose Host header names a loopback address (or --allowed-hosts) and whose "
                        "bodies are application/json are answered, so a web page cannot reach the server")
    p.add_argument("--allowed-hosts", default="", metavar="HOST[,HOST...]",
                   help="without --api-key, Host names answered beside loopback ones, e.g. my-box.lan ('*': any; "
                        "default: none)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model's name)")
    p.add_argument("--chat-template", default="auto", choices=["auto", "on", "off"],
                   help="use the tokenizer's chat template for chat requests (auto: if it has one)")
    b = p.add_argument_group(
        "many users at once",
        "Requests decode together in a pool of slots (one bounded KV cache each, allocated at start); new ones "
        "are read between decode steps. Memory per slot: the startup log and GET /health ('pools') say it "
        "for the loaded model (e.g. llama3-8b shape, bf16, InfiniPot pot 4,096: 0.5 GiB).")
    b.add_argument("--max-slots", type=int, default=None,
                   help="requests decoding at once (default: as many as --kv-memory-fraction of the free GPU "
                        "memory holds, at most 256; 8 on a CPU)")
    b.add_argument("--kv-memory-fraction", type=float, default=0.7,
                   help="share of the GPU memory free after loading that the slots may take when --max-slots "
                        "is not given (default 0.7; the rest holds stored states and other methods' pools)")
    b.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for a slot; beyond, 429 with Retry-After (default 64)")
    b.add_argument("--prefill-tokens", type=int, default=PREFILL_TOKENS,
                   help="prompt tokens read per step between decode steps: lower keeps streams smoother while a "
                        f"long prompt or document is read, higher reads it sooner (default {PREFILL_TOKENS})")
    b.add_argument("--prompt-order", choices=PROMPT_ORDERS, default=PROMPT_ORDER,
                   help="which prompts a step reads first: shortest (the fewest prompt tokens left, until a prompt "
                        "has waited --prompt-patience: under load a lower median time to first token) or arrival (the "
                        f"oldest; no later request passes an earlier one; default {PROMPT_ORDER})")
    b.add_argument("--prompt-patience", type=float, default=PROMPT_PATIENCE, metavar="SECONDS",
                   help="with --prompt-order shortest: a prompt whose request has held its slot this long is read "
                        "before shorter ones, so none waits for good (0: arrival order; inf: never; default "
                        f"{PROMPT_PATIENCE:g})")
    b.add_argument("--launch-ahead", choices=LAUNCH_AHEADS, default=LAUNCH_AHEAD,
                   help="launch a step of users decoding before the previous step's tokens are sent, so the GPU does "
                        "not wait for the server between tokens (on), or after (off: a request that ends at a stop "
                        f"token is never stepped past it); auto: on a CUDA GPU (default {LAUNCH_AHEAD})")
    b.add_argument("--mix", choices=MIXES, default=MIX,
                   help="read prompt chunks in the same forward as the users decoding (one budgeted forward a "
                        "step, --prefill-tokens of prompt beside one token a user) instead of a forward of their "
                        f"own that every user waits for; auto: on a CUDA GPU, where its varlen kernel runs, with "
                        f"--share-documents too: a reader's question is then read whole over the shared document "
                        f"(default {MIX}); "
                        "eager: on, never in the captured fixed-shape step")
    b.add_argument("--feed-questions", choices=FEED_QUESTIONS_CHOICES, default=FEED_QUESTIONS,
                   help=QUESTIONS_HELP)
    b.add_argument("--feed-tokens", type=int, default=64,
                   help="the longest question fed that way, in tokens (default 64); longer ones take a forward")
    b.add_argument("--share-documents", action="store_true",
                   help="the readers of a stored document (POST /v1/documents) read its entries from one copy in "
                        "the pool, each slot holding only its own question and answer (cascade attention); a reader "
                        "whose method changes the document takes its own copy then (copy on write)")
    b.add_argument("--reader-room", type=int, default=None, metavar="N",
                   help="with --share-documents, tail slots: a reader that never copies its document holds N KV "
                        "entries of its own (question + answer) instead of a whole slot, so --max-slots readers fit in "
                        "the memory of a few whole slots (e.g. 288 for answers of 256 tokens)")
    b.add_argument("--method-slots", type=int, default=4,
                   help="slots of the pool made for a document read with another method (default 4)")
    b.add_argument("--slot-capacity", type=int, default=None,
                   help="KV entries per slot for methods whose cache grows with the input (full, snapkv, d2o, "
                        "infinitehip; default: the model's window); bounded methods use their bound")
    lim = p.add_argument_group("limits", "Checked before any expensive work; beyond them, OpenAI's error JSON.")
    lim.add_argument("--max-context-tokens", type=int, default=1 << 20,
                     help="largest prompt in tokens, 413 beyond (default 1048576); a text too long to fit is "
                          "refused before it is tokenized")
    lim.add_argument("--max-body-bytes", default="64MiB", help="largest request body (413 beyond; default 64MiB)")
    lim.add_argument("--max-tokens-limit", type=int, default=8192,
                     help="largest max_tokens a request may ask (400 beyond; default 8192)")
    lim.add_argument("--read-timeout", type=float, default=30.0,
                     help="seconds a client has to send a request's headers, and then its body (408 beyond; "
                          "default 30)")
    lim.add_argument("--shutdown-grace", type=float, default=30.0,
                     help="on SIGTERM or Ctrl-C, new requests get 503 and those in flight this many seconds to "
                          "finish; the rest end with an error in OpenAI's format (default 30; a second signal "
                          "stops at once)")
    p.add_argument("--state-memory", default="4GiB", help="bytes of KV states kept in memory, LRU out (default 4GiB)")
    p.add_argument("--state-dir", default=None, help="directory where states spill and persist across restarts")
    p.add_argument("--state-disk", default=None, help="bytes of states kept in --state-dir (default: no limit)")
    p.add_argument("--cache-min-tokens", type=int, default=1024,
                   help="a conversation's context is stored for later questions from this many tokens on "
                        "(default 1024)")
    t = p.add_argument_group(
        "tensor parallelism (torchrun)",
        "One server over the N processes of `torchrun --nproc-per-node N -m kvpot serve --tp N ...` (one GPU each; "
        "gloo on a CPU): rank 0 serves HTTP at --host/--port and plans every step, the other ranks run the same "
        "steps on their shard. Not with --replicas, --share-documents or --device-map. --state-dir gets a "
        "subfolder per rank. On SIGTERM or Ctrl-C rank 0 drains (--shutdown-grace: keep it under torchrun's 30 s "
        "before it kills the ranks), then every rank exits (docs/scaling.md, Tensor parallelism).")
    add_tp_argument(t)
    t.add_argument("--tp-timeout", type=float, default=600.0,
                   help="seconds a rank waits for the others at a step boundary before the server gives up on a "
                        "rank that died or hung (requests then fail with a 503 and the server exits; default 600)")
    r = p.add_argument_group(
        "replicas (Ray Serve; pip install 'kvpot[cluster]')",
        "N engines, one per GPU (or CPU replicas on a machine without one), behind Ray Serve's HTTP proxy at "
        "--host/--port with the same API. A question about a stored document goes to the replica that holds it, "
        "else to the least-loaded one, which reads it from the shared --state-dir; a request that got no token "
        "from a replica that failed is retried on another. Joins the Ray cluster at $RAY_ADDRESS, else starts one "
        "on this machine. The same application for `serve run`: kvpot.serve.cluster:app_builder (docs/scaling.md).")
    r.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="serve with N replicas through Ray Serve (default: one engine in this process, no Ray)")
    r.add_argument("--replica-cpus", type=float, default=1.0,
                   help="logical CPUs each CPU replica reserves in Ray (default 1; GPU replicas reserve one GPU)")
    r.add_argument("--retries", type=int, default=2,
                   help="times a request that got no token is sent to another replica after its replica failed "
                        "(default 2)")
    r.add_argument("--affinity-slack", type=int, default=4,
                   help="a document's questions leave the replicas holding it for the least-loaded one once those "
                        "have this many more requests in flight (default 4; 0: spread evenly; needs --state-dir)")
    r.add_argument("--fronts", type=int, default=1,
                   help="replicas of the front that relays every request and streamed token to the engines "
                        "(default 1; one relays ~2,500 tokens/s: raise it with the replicas; /metrics' cluster "
                        "counters are then per front)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's and kvpot's log lines from this level (default info: pools, stored states "
                        "found, shutdown)")
    p.set_defaults(func=run)


def run(args) -> int:
    from kvpot.errors import KvpotError
    from kvpot.serve.config import ServeConfig, parse_bytes

    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise KvpotError("kvpot serve needs FastAPI and uvicorn: pip install 'kvpot[serve]'.") from None
    config = ServeConfig(
        model=args.model, method=args.method, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
        chat_template=args.chat_template, served_model_name=args.served_model_name,
        api_key=args.api_key or os.environ.get("KVPOT_API_KEY") or None, max_queue=args.max_queue,
        max_context_tokens=args.max_context_tokens, max_body_bytes=parse_bytes(args.max_body_bytes, "--max-body-bytes"),
        max_tokens_limit=args.max_tokens_limit, state_memory=parse_bytes(args.state_memory, "--state-memory"),
        state_dir=args.state_dir,
        state_disk=None if args.state_disk is None else parse_bytes(args.state_disk, "--state-disk"),
        cache_min_tokens=args.cache_min_tokens, max_slots=args.max_slots,
        kv_memory_fraction=args.kv_memory_fraction, method_slots=args.method_slots,
        prefill_tokens=args.prefill_tokens, mix=args.mix, prompt_order=args.prompt_order,
        prompt_patience=args.prompt_patience, launch_ahead=args.launch_ahead, slot_capacity=args.slot_capacity,
        feed_questions=args.feed_questions, feed_tokens=args.feed_tokens, share_documents=args.share_documents,
        reader_room=args.reader_room,
        read_timeout=args.read_timeout, tp_timeout=args.tp_timeout,
        shutdown_grace=args.shutdown_grace, allowed_hosts=tuple(args.allowed_hosts.split(",")),
    )
    from kvpot.serve.config import EngineRecipe
    from kvpot.serve.service import build_method

    build_method(config.method)  # a bad spec fails before the model loads
    recipe = EngineRecipe(model=config.model, method=config.method, device=config.device, dtype=config.dtype,
                          chat_template=config.chat_template, decode=args.decode, compile_step=args.compile_step,
                          linear=args.linear, tp=args.tp, batch_invariant=args.batch_invariant)
    recipe.check(config)
    if args.tp != 1:
        _check_tensor_parallel(args)
    from kvpot.serve.server import setup_logging

    setup_logging(args.log_level)  # the model's loading and the pool's sizes are logged too
    if args.replicas is not None:
        from kvpot.serve.cluster import ClusterConfig, run_cluster

        cluster = ClusterConfig(replicas=args.replicas, replica_cpus=args.replica_cpus, retries=args.retries,
                                affinity_slack=args.affinity_slack, fronts=args.fronts)
        run_cluster(recipe, config, cluster, args.log_level)
        return 0
    if args.tp != 1:
        from kvpot.serve.parallel import serve_tensor_parallel

        serve_tensor_parallel(recipe, config, args.log_level)
        return 0
    from kvpot.serve.server import run_server

    run_server(recipe.build(), config, args.log_level)
    return 0


def _check_tensor_parallel(args) -> None:
    """What cannot run under --tp, refused before any weight is read."""
    from kvpot.errors import KvpotError
    from kvpot.models.parallel import check_world

    if args.replicas is not None:
        raise KvpotError("--tp runs one server over the processes of a torchrun; --replicas runs engines through "
                         "Ray Serve: give one of them (replicas of tensor-parallel servers are not built).")
    if args.share_documents:
        raise KvpotError("--share-documents does not run under tensor parallelism yet: drop it (each reader of a "
                         "document then reads it from its own slot).")
    if args.device_map is not None or args.max_memory is not None:
        raise KvpotError("--tp splits every layer over the GPUs; --device-map/--max-memory split the layers: "
                         "give one of them.")
    check_world(args.tp)
