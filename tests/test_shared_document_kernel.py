"""The Triton shared-document decode kernel (`kvpot.kernels.shared`, cascade attention) against its PyTorch
reference (`kvpot.kernels.shared_reference`), over the named shapes of tests/test_shared_document.py and, on CUDA,
long ones. On CPU: `TRITON_INTERPRET=1` with Triton installed, as tests/test_decode_kernel.py runs. Entries the
kernel must not read (a shared row's own first entries, anything past a length) are NaN."""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE, interpreter_runtime_loops, needs_kernels
from test_shared_document import SHARED_SHAPES, shared_inputs

from kvpot.kernels.shared_reference import decode_attention_shared_reference

pytestmark = needs_kernels()
interpreter_runtime_loops()

LONG_SHAPES = [  # CUDA only: 64 readers of a llama3-8b-shaped 4,096-entry document, two documents, stragglers
    ("llama3-8b-64-readers-4k", 32, 8, 128, 4352, [4096], [(0, 4096 + 40 + i) for i in range(64)], list(range(64))),
    ("llama3-8b-two-docs-mixed", 32, 8, 128, 4352, [4096, 3000],
     [(i % 3 - 1, 4100 + i if i % 3 else 300 + i) for i in range(48)], list(range(48))),
]


def in_tails(buffer: torch.Tensor, doc_rows: torch.Tensor, lengths: torch.Tensor, doc_lengths: list[int], stride: int):
    """`buffer`'s slots as tail slots keep them (`kvpot.engine.pool.arena_view`): each reader's tail `[n_doc, n)` in an
    arena whose slots overlap by `stride`, every other lane NaN."""
    from kvpot.engine.pool import arena_view

    slots, kv, capacity, d = buffer.shape
    view = arena_view(slots, kv, capacity, d, stride, buffer.dtype, buffer.device)
    view.fill_(float("nan"))
    for slot, (doc, n) in enumerate(zip(doc_rows.tolist(), lengths.tolist())):
        assert doc >= 0  # (a row without a document holds its whole slot: not a tail)
        view[slot, :, doc_lengths[doc] : n] = buffer[slot, :, doc_lengths[doc] : n]
    return view


def run(shape, rope: bool, dtype=torch.float32, probs: bool = False, doc_rotated: bool = False,
        tails: int | None = None):
    """The kernel's output and the reference's; `doc_rotated`: the kernel reads the document's keys stored rotated
    at their positions (as the pool's region keeps them), the reference rotates them on load; `tails`: the kernel
    reads the slots' tails from tail slots of that stride (`in_tails`)."""
    from kvpot.kernels.decode_reference import _rotate_at
    from kvpot.kernels.shared import decode_attention_shared

    shared, _, rope_args, (key_positions, doc_positions, _) = shared_inputs(shape, rope)
    shared = tuple(t.to(KERNEL_DEVICE) for t in shared)
    shared = tuple(t.to(dtype) if t.is_floating_point() else t for t in shared)
    rope_args = {k: v.to(KERNEL_DEVICE) for k, v in rope_args.items()}
    extra = dict(key_positions=key_positions.to(KERNEL_DEVICE), doc_key_positions=doc_positions.to(KERNEL_DEVICE)) \
        if rope else {}
    batch, kv, capacity = len(shape[7]), shape[2], shape[4]
    kwargs = {}
    if probs:
        kwargs["probs"] = torch.zeros(batch, kv, capacity, device=KERNEL_DEVICE)
    mine = list(shared)
    if doc_rotated:
        cos, sin = rope_args["cos"].float(), rope_args["sin"].float()
        mine[5] = _rotate_at(shared[5].float(), cos, sin, extra["doc_key_positions"].long()).to(shared[5].dtype)
        kwargs["doc_rotated"] = True
    if tails is not None:
        mine[1], mine[2] = (in_tails(t, shared[7], shared[4], shape[5], tails) for t in shared[1:3])
    out = decode_attention_shared(*mine, 0.125, **rope_args, **extra, **kwargs)
    expected = decode_attention_shared_reference(*shared, 0.125, **rope_args, **extra)
    return out, expected


@pytest.mark.parametrize("rope", [True, False], ids=["rope-on-load", "pre-rotated"])
@pytest.mark.parametrize("shape", SHARED_SHAPES, ids=[s[0] for s in SHARED_SHAPES])
def test_shared_document_kernel_matches_the_reference(shape, rope):
    out, expected = run(shape, rope)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", LONG_SHAPES, ids=[s[0] for s in LONG_SHAPES])
def test_shared_document_kernel_matches_the_reference_on_long_documents(shape, dtype):
    out, expected = run(shape, rope=True, dtype=dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("shape", SHARED_SHAPES[:3], ids=[s[0] for s in SHARED_SHAPES[:3]])
def test_shared_document_kernel_reads_a_document_stored_rotated(shape):
    out, expected = run(shape, rope=True, doc_rotated=True)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", LONG_SHAPES, ids=[s[0] for s in LONG_SHAPES])
def test_shared_document_kernel_reads_a_long_document_stored_rotated(shape):
    out, expected = run(shape, rope=True, dtype=torch.bfloat16, doc_rotated=True)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tail_splits", [1, 3], ids=["merged-in-the-tail", "merged-apart"])
@pytest.mark.parametrize("shape", [SHARED_SHAPES[0], SHARED_SHAPES[2]], ids=[SHARED_SHAPES[0][0], SHARED_SHAPES[2][0]])
def test_shared_document_kernel_writes_every_partial_it_merges(shape, tail_splits, monkeypatch):
    """The partials are not filled before the launches: a tail in one split merges the document's partials in its
    own program, else a row reading no document has its document partials cleared by its tail's program. With
    every fresh float buffer NaN, the output is still the reference's either way."""
    from kvpot.kernels import shared

    empty, default = torch.empty, shared.launch_shape

    def poisoned(*size, **kwargs):
        out = empty(*size, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    def shape_of(segment, *rest):
        block_m, block_n, warps, stages, splits = default(segment, *rest)
        return block_m, block_n, warps, stages, tail_splits if segment == "tail" else splits

    monkeypatch.setattr(torch, "empty", poisoned)
    monkeypatch.setattr(shared, "launch_shape", shape_of)
    out, expected = run(shape, rope=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


def test_shared_document_kernel_with_an_observation_gives_the_reference():
    out, expected = run(SHARED_SHAPES[0], rope=True, probs=True)
    torch.testing.assert_close(out, expected)


# Triton's interpreter runs the whole step's kernels (~45 s a method on 2 cores): one method there
@pytest.mark.parametrize("name", ["full", "infinipot"] if KERNEL_DEVICE == "cuda" else ["infinipot"])
def test_shared_document_kernel_in_the_batched_step(name, monkeypatch):
    """Through the scheduler (CUDA graphs on a GPU; the interpreter on CPU): readers sharing a document get the
    copy-per-reader tokens with the Triton kernel in the step (a tiny Llama with head dim 32, which it supports)."""
    import kvpot
    from conftest import VOCAB, build
    from kvpot.engine.offline import run_all
    from kvpot.engine.scheduler import Request, Scheduler
    from kvpot.kernels import shared

    calls = []
    kernel = shared.decode_attention_shared
    monkeypatch.setattr(shared, "decode_attention_shared", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    model = build("llama3", hidden_size=128, head_dim=32).to(KERNEL_DEVICE)
    method = {"full": kvpot.Full(chunk_size=64), "infinipot": kvpot.InfiniPot(pot_size=64, catalyst=None)}[name]
    capacity = 192 if name == "full" else None
    g = torch.Generator().manual_seed(11)
    context = torch.randint(3, VOCAB, (100,), generator=g).to(KERNEL_DEVICE)
    questions = [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in (3, 5, 2)]
    state = kvpot.Engine(model, method=method, decode="eager").prefill_ids(context)
    decode = "graph" if KERNEL_DEVICE == "cuda" else "static"
    tokens = {}
    for share in (False, True):
        scheduler = Scheduler(kvpot.Engine(model, method=method), slots=3, capacity=capacity, decode=decode,
                              share_documents=share)
        requests = [Request(None, q, state=state, max_new_tokens=12, ignore_eos=True) for q in questions]
        run_all(scheduler, requests)
        tokens[share] = [r.tokens for r in requests]
    assert tokens[True] == tokens[False] and calls  # the shared kernel ran, and changed no token


def test_shared_sweep_segments_times_each_launch_form(capsys):
    """`benchmarks/shared-document-h100/shared_sweep.py --segments` (a smoke run, untimed off a GPU): one row per
    document split and per tail form (positions loaded, stored rotated), each launch run once."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "shared-document-h100" / "shared_sweep.py"
    spec = importlib.util.spec_from_file_location("shared_sweep_smoke", path)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    device = "cpu" if KERNEL_DEVICE == "cpu" else "cuda"
    sweep.main(["--segments", "--device", device, "--batch", "3", "--doc-entries", "40", "--tail", "9",
                "--capacity", "64", "--layers", "1", "--repeats", "1", "--block-n", "32", "--warps", "4",
                "--doc-splits", "2"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    documents = [r for r in rows if r["segment"] == "document"]
    default = [r["shape"][-1] for r in documents if r["default"]]
    assert len(default) == 1 and [r["shape"][-1] for r in documents] == sorted({2, *default})
    assert [r["keys"] for r in rows if r["segment"] == "tail"] == ["positions", "stored rotated"]
    assert len(rows) == len(documents) + 2


TAIL_SHAPES = [("gqa1-one-doc-many-readers", 16), ("llama3-8b-64-readers-4k", 128)]  # (shape, stride)


@pytest.mark.parametrize("name, stride", TAIL_SHAPES, ids=[n for n, _ in TAIL_SHAPES])
def test_shared_document_kernel_reads_tail_slots(name, stride):
    """Readers' tails in tail slots (`Scheduler(reader_room=...)`): the kernel reads each slot by its strides, so the
    overlapping views give the reference's output over the same entries."""
    shape = next(s for s in SHARED_SHAPES + LONG_SHAPES if s[0] == name)
    if shape in LONG_SHAPES and KERNEL_DEVICE != "cuda":
        pytest.skip("a long shape: CUDA only")
    out, expected = run(shape, rope=True, dtype=torch.float32, doc_rotated=True, tails=stride)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
