"""The shared-document decode attention alone at the 64-reader step's shape, over launch shapes (issue 48's
6,000 tok/s target: the attention was 3.3 ms of a 14.3 ms step on an H200, `records/shared-document-h200/`).

One CUDA graph replays `--layers` calls of `kvpot.kernels.shared.decode_attention_shared` (a step's worth, on one
layer's pool and region): `--batch` readers of one document of `--doc-entries` entries in a region of
`--documents` rows, each with a private tail of `--tail` entries, `llama3-8b`'s 32 query and 8 KV heads of 128
dims, bf16, InfiniPot's layout (the slots' keys rotated on load, the document's stored rotated). Each
configuration replaces `kvpot.kernels.shared.launch_shape` for one segment (`document` or `tail`; the other keeps
its default) and its output is checked against the default's. `--baseline FILE` also times another copy of the
module (the kernel as it was: `git show COMMIT:src/kvpot/kernels/shared.py > FILE`) on the same inputs, first and
last, so that the two sit side by side in one run. One JSON line per configuration: microseconds per call (the
median of `--repeats` replays) and the step's share (x layers).

    python benchmarks/shared-document-h100/shared_sweep.py [--baseline /tmp/shared_before.py] > sweep.jsonl

`--segments` times each launch of a layer alone instead (one graph of `--layers` launches of one segment): the
document's at each of `--doc-splits`, and the tail's (merging the document's partials, as a step runs it) at each
of `--block-n` and `--warps`, with its keys rotated on load (`keys` "positions", as InfiniPot's slots store them)
and not ("stored rotated": what a tail stored rotated would cost; its output is then not the attention, only its
time is).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernel-tuning-h100"))
from graphs import time_graph  # noqa: E402  (benchmarks/kernel-tuning-h100/graphs.py)

import kvpot.kernels.shared as shared  # noqa: E402


def inputs(args, seed: int = 0) -> dict:
    """One layer's step: the pool's slots (and its scratch slot), the region, the RoPE table, the queries."""
    device, kv, heads, d, capacity = args.device, args.kv_heads, args.heads, 128, args.capacity
    g = torch.Generator(device=device).manual_seed(seed)
    slots = args.batch + 1
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=g)

    length = args.doc_entries + args.tail
    freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=device).float() / d))
    angles = torch.outer(torch.arange(capacity + 1, device=device).float(), freq)
    angles = torch.cat([angles, angles], dim=-1)
    positions = torch.arange(capacity, device=device).view(1, 1, -1)
    doc_rows = torch.full((slots,), -1, dtype=torch.long, device=device)
    doc_rows[: args.batch] = 0
    doc_lengths = torch.zeros(args.documents, dtype=torch.long, device=device)
    doc_lengths[0] = args.doc_entries
    return dict(
        query=randn(args.batch, heads, d), keys=randn(slots, kv, capacity, d), values=randn(slots, kv, capacity, d),
        rows=torch.arange(args.batch, device=device),
        lengths=torch.full((slots,), length, dtype=torch.long, device=device),
        doc_keys=randn(args.documents, kv, capacity, d), doc_values=randn(args.documents, kv, capacity, d),
        doc_rows=doc_rows, doc_lengths=doc_lengths, scaling=d ** -0.5,
        cos=angles.cos().to(dtype), sin=angles.sin().to(dtype),
        key_positions=positions.expand(slots, kv, capacity).contiguous(),
        doc_key_positions=positions.expand(args.documents, kv, capacity).contiguous(),
        query_positions=torch.full((slots,), length, dtype=torch.long, device=device), doc_rotated=True,
    )


def timed(module, data: dict, args) -> float:
    if args.device != "cuda":  # a smoke run under Triton's interpreter: no timing
        module.decode_attention_shared(**data)
        return float("nan")
    groups = module.shared_groups(data["rows"], data["doc_rows"], args.documents)  # once a step, as the step does
    return time_graph([lambda: module.decode_attention_shared(**data, groups=groups)] * args.layers, args.repeats)


def load(path: str):
    spec = importlib.util.spec_from_file_location("shared_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def configs(args) -> list[tuple[str, tuple]]:
    out = []
    for block_m, block_n, warps, stages, splits in itertools.product(args.doc_block_m, args.block_n, args.warps,
                                                                     args.stages, args.doc_splits):
        out.append(("document", (block_m, block_n, warps, stages, splits)))
    for block_n, warps, stages, splits in itertools.product(args.block_n, args.warps, args.stages, args.tail_splits):
        out.append(("tail", (16, block_n, warps, stages, splits)))
    return out


def run(args) -> None:
    data = inputs(args)
    reference = shared.decode_attention_shared(**data).float()
    default_shape = shared.launch_shape
    common = dict(batch=args.batch, doc_entries=args.doc_entries, tail=args.tail, documents=args.documents)
    baseline = load(args.baseline) if args.baseline else None

    def emit(row):
        print(json.dumps({**common, **row}), flush=True)

    def baseline_row(when):
        if baseline is not None:
            error = (baseline.decode_attention_shared(**data).float() - reference).abs().max().item()
            us = timed(baseline, data, args)
            emit(dict(kernel="baseline", file=args.baseline, when=when, us=round(us, 2),
                      step_ms=round(us * args.layers / 1000, 3), max_abs_error=error))

    baseline_row("first")
    size = data["keys"].element_size()
    shapes = {s: default_shape(s, args.batch, args.kv_heads, args.heads // args.kv_heads, 128, args.capacity,
                               torch.device(args.device), size) for s in ("document", "tail")}
    us = timed(shared, data, args)
    emit(dict(kernel="default", shapes=shapes, us=round(us, 2), step_ms=round(us * args.layers / 1000, 3)))
    for segment, shape in configs(args):
        def patched(seg, *rest, _segment=segment, _shape=shape):
            return _shape if seg == _segment else default_shape(seg, *rest)

        shared.launch_shape = patched
        try:
            error = (shared.decode_attention_shared(**data).float() - reference).abs().max().item()
            us = timed(shared, data, args)
            emit(dict(kernel="sweep", segment=segment, shape=shape, us=round(us, 2),
                      step_ms=round(us * args.layers / 1000, 3), max_abs_error=error))
        except Exception as error:  # a shape that does not fit shared memory or registers
            emit(dict(kernel="sweep", segment=segment, shape=shape, error=f"{type(error).__name__}: {str(error)[:200]}"))
        finally:
            shared.launch_shape = default_shape
    baseline_row("last")


def segments(args) -> None:
    """Each segment's launch alone, microseconds a launch (`--segments`)."""
    data = inputs(args)
    kv, g, d = args.kv_heads, args.heads // args.kv_heads, 128
    batch, device, size = args.batch, torch.device(args.device), data["keys"].element_size()
    groups = shared.shared_groups(data["rows"], data["doc_rows"], args.documents)
    documents = (data["doc_rows"], data["doc_lengths"])
    doc_default = shared.launch_shape("document", batch, kv, g, d, args.capacity, device, size)
    tail_default = shared.launch_shape("tail", batch, kv, g, d, args.capacity, device, size)
    splits = max(args.doc_splits + [doc_default[-1]])
    part = torch.zeros(splits, batch * args.heads, d, dtype=torch.float32, device=device)
    lse = torch.zeros(splits, batch * args.heads, dtype=torch.float32, device=device)
    out = torch.empty(batch, args.heads, d, dtype=data["query"].dtype, device=device)
    common = dict(batch=batch, doc_entries=args.doc_entries, tail=args.tail, documents=args.documents)
    rope_doc = (data["cos"], data["sin"], data["doc_key_positions"], data["query_positions"])
    rope_tail = (data["cos"], data["sin"], data["key_positions"], data["query_positions"])

    def document(shape):
        return lambda: shared._launch("document", data["query"], data["doc_keys"], data["doc_values"], data["rows"],
                                      groups, documents, data["lengths"], rope_doc, part, lse, 0, shape, g, kv,
                                      data["scaling"], rotated=True)

    def tail(shape, rotated, base):
        return lambda: shared._launch("tail", data["query"], data["keys"], data["values"], data["rows"], groups,
                                      documents, data["lengths"], rope_tail, part, lse, base, shape, g, kv,
                                      data["scaling"], rotated=rotated, final=out)

    def emit(segment, shape, launch, **extra):
        us = float("nan") if args.device != "cuda" else time_graph([launch] * args.layers, args.repeats)
        if args.device != "cuda":
            launch()
        print(json.dumps({**common, "kernel": "segment", "segment": segment, "shape": shape, "us": round(us, 2),
                          "step_ms": round(us * args.layers / 1000, 3), **extra}), flush=True)

    pick = [v if v else [doc_default[i]] for i, v in enumerate(
        (args.doc_block_m if args.doc_shapes else None, args.doc_block_n, args.doc_warps, args.doc_stages))]
    for shape in itertools.product(*pick, sorted(set(args.doc_splits) | {doc_default[-1]})):
        try:
            emit("document", shape, document(shape), default=shape == doc_default)
        except Exception as error:  # a shape that does not fit shared memory or registers
            print(json.dumps({**common, "kernel": "segment", "segment": "document", "shape": shape,
                              "error": f"{type(error).__name__}: {str(error)[:200]}"}), flush=True)
    if args.yardstick and args.device == "cuda":
        yardstick(args, data, common)
    if args.no_tail:
        return
    base = doc_default[-1]
    document(doc_default)()
    for block_n, warps in itertools.product(args.block_n, args.warps):
        shape = (tail_default[0], block_n, warps, tail_default[3], 1)
        for keys in ("positions", "stored rotated"):
            emit("tail", shape, tail(shape, keys == "stored rotated", base), keys=keys, default=shape == tail_default)


def yardstick(args, data: dict, common: dict) -> None:
    """PyTorch's flash attention over the same document, its readers' query rows as one sequence a KV head
    ([1, KV, batch x G, d] against the document's [1, KV, n_doc, d]): what a fused library kernel takes for the
    document segment's arithmetic and reading, without RoPE, gathering or partials."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kv, g, n = args.kv_heads, args.heads // args.kv_heads, args.doc_entries
    q = data["query"].view(args.batch, kv, g, 128).permute(1, 0, 2, 3).reshape(1, kv, args.batch * g, 128).contiguous()
    k = data["doc_keys"][0:1, :, :n].contiguous()
    v = data["doc_values"][0:1, :, :n].contiguous()
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                us = time_graph([lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)] * args.layers,
                                args.repeats)
            row = {"us": round(us, 2), "step_ms": round(us * args.layers / 1000, 3)}
        except Exception as error:
            row = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
        print(json.dumps({**common, "kernel": "yardstick", "segment": "document", "backend": backend.name, **row}),
              flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64, help="readers of the document")
    p.add_argument("--doc-entries", type=int, default=2993, help="the stored 128K document's entries per layer "
                   "(InfiniPot, pot 4,096: records/shared-document-h200/)")
    p.add_argument("--tail", type=int, default=160, help="each reader's private entries (32-token question, half "
                   "of 256 new tokens)")
    p.add_argument("--capacity", type=int, default=4384, help="entries a slot (and a document row) holds")
    p.add_argument("--documents", type=int, default=4, help="rows of the document region (Scheduler's default)")
    p.add_argument("--doc-block-m", type=int, nargs="+", default=[64, 128])
    p.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--doc-splits", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--tail-splits", type=int, nargs="+", default=[1, 2])
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--baseline", help="another copy of kvpot/kernels/shared.py to time on the same inputs")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1, untimed")
    p.add_argument("--segments", action="store_true", help="time each segment's launch alone (see above)")
    p.add_argument("--doc-shapes", action="store_true", help="--segments: sweep the document's BLOCK_M too "
                   "(--doc-block-m), not only its splits")
    p.add_argument("--doc-block-n", type=int, nargs="+", help="--segments: the document's entries a loop step "
                   "(default: launch_shape's)")
    p.add_argument("--doc-warps", type=int, nargs="+", help="--segments: the document's warps (default: launch_shape's)")
    p.add_argument("--doc-stages", type=int, nargs="+", help="--segments: the document's stages (default: "
                   "launch_shape's)")
    p.add_argument("--no-tail", action="store_true", help="--segments: time the document's launch only")
    p.add_argument("--yardstick", action="store_true", help="--segments: also time PyTorch's fused attention over "
                   "the document (no RoPE, no partials), as a yardstick")
    p.add_argument("--variant", help="another copy of kvpot/kernels/shared.py to time instead (--segments)")
    args = p.parse_args(argv)
    if args.variant:
        global shared
        shared = load(args.variant)
    segments(args) if args.segments else run(args)


if __name__ == "__main__":
    main()
