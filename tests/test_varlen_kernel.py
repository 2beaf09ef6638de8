"""The varlen attention over pool slots (`kvpot.kernels.varlen`, issue 43's mixed step) against its PyTorch
reference (`kvpot.kernels.varlen_reference`), over named shapes: decoding rows alone, prompt chunks alone, both
in one launch, chunks on empty slots, GQA groups of 1 to 8, RoPE on load or keys stored rotated.

Runs on CUDA; on a CPU machine with Triton installed, `TRITON_INTERPRET=1` runs it in Triton's interpreter
(float32 there: the interpreter mishandles bf16 matrix products).
"""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE, interpreter_runtime_loops, needs_kernels, rope_table

from kvpot.errors import KvpotError
from kvpot.kernels.varlen_reference import varlen_attention_reference

DEVICE = KERNEL_DEVICE
pytestmark = needs_kernels()
interpreter_runtime_loops()

# (name, query heads, kv heads, head dim, capacity, rows as (slot, entries cached before, tokens), rope)
SHAPES = [
    ("decode-rows", 8, 2, 64, 96, [(0, 50, 1), (2, 95, 1), (1, 0, 1)], True),
    ("one-chunk", 8, 2, 64, 160, [(0, 37, 70)], True),
    ("decode-and-chunks", 8, 2, 64, 200, [(3, 120, 1), (0, 64, 1), (1, 0, 33), (2, 80, 100)], True),
    ("chunk-on-empty-slot-gqa1", 4, 4, 32, 64, [(0, 0, 64)], True),
    ("gqa8-rotated-keys", 16, 2, 128, 130, [(1, 3, 17), (0, 100, 1)], False),
    ("gqa-not-power-of-two", 6, 2, 64, 90, [(0, 10, 21), (1, 60, 1)], True),
    ("empty-row", 8, 2, 64, 64, [(0, 10, 5), (1, 20, 0), (2, 3, 9)], True),
    ("d256-wide-launch", 8, 2, 256, 96, [(0, 30, 40), (1, 60, 1)], True),  # WIDE_LAUNCH's tiles in half precision
]
if DEVICE == "cuda":  # the 8B shape's mixed step: 32 decoding rows and two 1,024-token chunks
    SHAPES.append(("llama3-8b-mixed", 32, 8, 128, 5200,
                   [(s, 4000 - 37 * s, 1) for s in range(32)] + [(32, 2048, 1024), (33, 0, 1024)], True))
IDS = [s[0] for s in SHAPES]
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def inputs(shape, dtype, seed=0):
    _, heads, kv, d, capacity, rows, rope = shape
    gen = torch.Generator().manual_seed(seed)
    slots = max(r[0] for r in rows) + 2  # one slot no row reads, poisoned
    keys = torch.randn(slots, kv, capacity, d, generator=gen).to(dtype)
    values = torch.randn(slots, kv, capacity, d, generator=gen).to(dtype)
    for slot, before, count in rows:  # entries past what a row reads are poisoned: a masked load only
        keys[slot, :, before + count:] = float("nan")
        values[slot, :, before + count:] = float("nan")
    keys[-1], values[-1] = float("nan"), float("nan")
    counts = [count for _, _, count in rows]
    starts = torch.tensor([0] + counts).cumsum(0)
    tokens = int(starts[-1])
    query = torch.randn(tokens, heads, d, generator=gen).to(dtype)
    table = 2 * capacity + 8
    key_positions = torch.randint(0, table - 8, (slots, kv, capacity), generator=gen)
    extra = {}
    if rope:
        cos, sin = rope_table(table, d, dtype, device="cpu")
        extra = dict(cos=cos, sin=sin, key_positions=key_positions)
    args = dict(query=query, keys=keys, values=values, slots=torch.tensor([r[0] for r in rows]), starts=starts,
                cached=torch.tensor([r[1] for r in rows]), scaling=d ** -0.5, **extra)
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}, max(counts)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_varlen_attention_matches_the_reference(shape, dtype):
    from kvpot.kernels.varlen import varlen_attention

    args, longest = inputs(shape, dtype)
    ref, ref_lse = varlen_attention_reference(**args)
    out, lse = varlen_attention(**args, max_tokens=max(longest, 1))
    covered = ref_lse[:, 0] > float("-inf")  # every token of a row
    assert covered.all() and not ref.isnan().any()
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    torch.testing.assert_close(lse, ref_lse, **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_an_unmasked_prefix_gives_what_masking_every_block_gives(shape, dtype, monkeypatch):
    """`UNMASKED_PREFIX`: the blocks every token of a tile sees, read without the causal mask, change no output (the
    mask was all true there), and the reference still holds."""
    from kvpot.kernels import varlen

    args, longest = inputs(shape, dtype)
    masked, masked_lse = varlen.varlen_attention(**args, max_tokens=max(longest, 1))
    monkeypatch.setattr(varlen, "UNMASKED_PREFIX", True)
    out, lse = varlen.varlen_attention(**args, max_tokens=max(longest, 1))
    torch.testing.assert_close(out, masked, atol=0, rtol=0)
    torch.testing.assert_close(lse, masked_lse, atol=0, rtol=0)
    ref, ref_lse = varlen_attention_reference(**args)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_packed_observation_matches_the_reference(shape, dtype):
    """`kvpot.kernels.observe.observe_varlen` (a packed mixed step's observations, `kvpot.engine.packed`) against
    its reference, with the varlen attention's log-sum-exp: each row asks for its own rows (its last few, all of
    them, one, none), summed or averaged."""
    from kvpot.kernels.observe import observe_varlen
    from kvpot.kernels.observe_reference import observe_varlen_reference

    args, _ = inputs(shape, dtype, seed=7)
    _, lse = varlen_attention_reference(**args)
    tokens = [count for _, _, count in shape[5]]
    asks = [(0, 0) if count == 0 else [(max(0, count - 5), min(count, 5)), (0, count), (count - 1, 1)][r % 3]
            for r, count in enumerate(tokens)]
    row0, count = (torch.tensor(column, device=DEVICE) for column in zip(*asks))
    mean = torch.tensor([r % 2 for r in range(len(tokens))], device=DEVICE)
    observed = {"slots": args["slots"], "starts": args["starts"], "cached": args["cached"], "row0": row0,
                "count": count, "mean": mean, "scaling": args["scaling"], "lse": lse,
                **{k: args[k] for k in ("cos", "sin", "key_positions") if k in args}}
    shape_out = (len(tokens), args["keys"].shape[1], args["keys"].shape[2])
    ref = torch.full(shape_out, -1.0, device=DEVICE)
    out = torch.full(shape_out, -1.0, device=DEVICE)
    observe_varlen_reference(args["query"], args["keys"], out=ref, **observed)
    observe_varlen(args["query"], args["keys"], out=out, **observed)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=1e-4)
    for r, (slot, before, n) in enumerate(shape[5]):
        if asks[r][1]:
            torch.testing.assert_close(out[r, :, : before + n], ref[r, :, : before + n], **tol)
        else:  # a row that asks for nothing is not written
            assert (out[r] == -1).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[6]], ids=[s[0] for s in SHAPES if s[6]])
def test_keys_rotated_ahead_give_what_rotating_on_load_gives(shape, dtype):
    """`rotate_rows` (a packed step's keys of ranked positions, rotated once a layer) writes each row's live keys as
    the kernels rotate them on load; the varlen attention and the packed observation over them then give the same
    result as rotating on load (the same arithmetic: bit for bit under the interpreter; a compiler may contract
    products differently in two kernels, so within rounding here), and entries past a row's are not written."""
    from kvpot.kernels.decode_reference import _rotate_at
    from kvpot.kernels.observe import observe_varlen
    from kvpot.kernels.varlen import rotate_rows, varlen_attention

    args, longest = inputs(shape, dtype, seed=11)
    keys, positions = args["keys"], args["key_positions"]
    rows = args["slots"].shape[0]
    ahead = torch.full((rows + 1, *keys.shape[1:]), 7.0, dtype=dtype, device=DEVICE)
    rotate_rows(keys, positions, args["cos"], args["sin"], args["slots"], args["starts"], args["cached"], ahead)
    counts = (args["starts"][1:] - args["starts"][:-1]).tolist()
    for r, (slot, before) in enumerate(zip(args["slots"].tolist(), args["cached"].tolist())):
        n = before + counts[r]
        want = _rotate_at(keys[slot, :, :n].float(), args["cos"].float(), args["sin"].float(), positions[slot, :, :n])
        tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ahead[r, :, :n].float(), want, **tol)
        assert (ahead[r, :, n:] == 7).all()  # past the row's entries: untouched
    assert (ahead[rows] == 7).all()
    out, lse = varlen_attention(**args, max_tokens=max(longest, 1))
    out_ahead, lse_ahead = varlen_attention(**args, max_tokens=max(longest, 1), row_keys=ahead)
    covered = [t for r, c in enumerate(counts) for t in range(int(args["starts"][r]), int(args["starts"][r]) + c)]
    torch.testing.assert_close(out_ahead[covered], out[covered], **tol)
    torch.testing.assert_close(lse_ahead[covered], lse[covered], **tol)
    observed = dict(row0=torch.zeros(rows, dtype=torch.long, device=DEVICE), count=torch.tensor(counts, device=DEVICE),
                    mean=torch.ones(rows, dtype=torch.long, device=DEVICE), scaling=args["scaling"], lse=lse,
                    cos=args["cos"], sin=args["sin"], key_positions=positions)
    bounds = (args["slots"], args["starts"], args["cached"])
    one, two = (torch.zeros(rows, *keys.shape[1:3], device=DEVICE) for _ in range(2))
    observe_varlen(args["query"], keys, *bounds, out=one, **observed)
    observe_varlen(args["query"], keys, *bounds, out=two, row_keys=ahead, **observed)
    torch.testing.assert_close(two, one, **tol)
    if DEVICE == "cpu":  # Triton's interpreter: the same operations in the same order
        assert torch.equal(out[covered], out_ahead[covered]) and torch.equal(one, two)


def test_a_decoding_row_equals_the_decode_kernels_reference():
    """A row of one token is a decoding step: the same output as the batched decode attention's reference."""
    from kvpot.kernels.decode_reference import decode_attention_batch_reference
    from kvpot.kernels.varlen import varlen_attention

    args, _ = inputs(SHAPES[0], torch.float32, seed=3)
    out, _ = varlen_attention(**args, max_tokens=1)
    lengths = torch.zeros(args["keys"].shape[0], dtype=torch.long, device=DEVICE)
    lengths[args["slots"]] = args["cached"] + 1
    query_positions = torch.zeros(args["keys"].shape[0], args["keys"].shape[1], dtype=torch.long, device=DEVICE)
    query_positions[args["slots"]] = args["key_positions"][args["slots"], :, args["cached"]]  # its own entry's
    ref = decode_attention_batch_reference(args["query"], args["keys"], args["values"], args["slots"], lengths,
                                           args["scaling"], cos=args["cos"], sin=args["sin"],
                                           key_positions=args["key_positions"], query_positions=query_positions)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_tokens_past_the_bucket_are_not_written():
    """`max_tokens` sizes the grid (a captured step's bucket): a row's tokens beyond it are left as they were,
    the ones within it are right."""
    from kvpot.kernels.varlen import varlen_attention

    args, _ = inputs(SHAPES[1], torch.float32, seed=5)  # one chunk of 70 tokens
    ref, _ = varlen_attention_reference(**args)
    out, _ = varlen_attention(**args, max_tokens=32)
    torch.testing.assert_close(out[:32], ref[:32], atol=2e-5, rtol=1e-4)
    assert not torch.allclose(out[32:], ref[32:])  # left as `torch.empty` made them


def shared_document_inputs(shape, dtype):
    """`inputs` with every other row's slot reading the first half of its cached entries from a document region
    (one region row each, plus an unread one): the region holds them (keys rotated at their positions, as
    `kvpot.engine.documents` stores them), the slot holds NaN there. Returns (those arguments, the same rows with
    the entries in their slots instead, the longest row)."""
    from kvpot.kernels.decode_reference import _rotate_at

    args, longest = inputs(shape, dtype)
    keys, values = args["keys"].clone(), args["values"].clone()
    slots, kv, capacity, d = keys.shape
    readers = [(slot, before // 2) for i, (slot, before, _) in enumerate(shape[5]) if i % 2 == 0 and before >= 2]
    doc_keys = torch.full((len(readers) + 1, kv, capacity, d), float("nan"), dtype=dtype, device=DEVICE)
    doc_values = doc_keys.clone()
    doc_rows = torch.full((slots,), -1, dtype=torch.long, device=DEVICE)
    doc_lengths = torch.zeros(len(readers) + 1, dtype=torch.long, device=DEVICE)
    for row, (slot, n_doc) in enumerate(readers):
        k = keys[slot, :, :n_doc]
        if "cos" in args:  # the region's keys stored rotated (in float32, then the keys' dtype)
            k = _rotate_at(k.float(), args["cos"].float(), args["sin"].float(),
                           args["key_positions"][slot, :, :n_doc]).to(dtype)
        doc_keys[row, :, :n_doc], doc_values[row, :, :n_doc] = k, values[slot, :, :n_doc]
        doc_rows[slot], doc_lengths[row] = row, n_doc
        keys[slot, :, :n_doc], values[slot, :, :n_doc] = float("nan"), float("nan")  # never read from the slot
    assert readers, "a shape with a reader"
    shared = dict(args, keys=keys, values=values, document=(doc_keys, doc_values, doc_rows, doc_lengths))
    return shared, args, longest


SHARED_SHAPES = [s for s in SHAPES if any(i % 2 == 0 and r[1] >= 2 for i, r in enumerate(s[5]))]


@pytest.mark.parametrize("prefix", [False, True], ids=["masked", "unmasked-prefix"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("shape", SHARED_SHAPES, ids=[s[0] for s in SHARED_SHAPES])
def test_shared_document_rows_read_their_document_from_the_region(shape, dtype, prefix, monkeypatch):
    """A chunk of a shared document's reader (`document=`): its slot's first entries come from the region row, the
    rest from its slot, which gives what the slot holding them all gives (the copy-per-reader path); the kernel
    matches the reference, with keys rotated on load or rotated ahead (`row_keys`)."""
    from kvpot.kernels import varlen

    monkeypatch.setattr(varlen, "UNMASKED_PREFIX", prefix)
    shared, copied, longest = shared_document_inputs(shape, dtype)
    full, full_lse = varlen_attention_reference(**copied)
    ref, ref_lse = varlen_attention_reference(**shared)
    assert not ref.isnan().any()
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(ref.float(), full.float(), **tol)
    torch.testing.assert_close(ref_lse, full_lse, **tol)
    out, lse = varlen.varlen_attention(**shared, max_tokens=max(longest, 1))
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    torch.testing.assert_close(lse, ref_lse, **tol)
    if "cos" in shared:  # keys rotated ahead: a reader's entries past its document only (the region has the rest)
        bounds = (shared["keys"], shared["key_positions"], shared["cos"], shared["sin"], shared["slots"],
                  shared["starts"], shared["cached"])
        rows, every = (torch.full((shared["slots"].shape[0], *shared["keys"].shape[1:]), 7.0, dtype=dtype,
                                  device=DEVICE) for _ in range(2))
        varlen.rotate_rows(*bounds, rows, document=shared["document"])
        varlen.rotate_rows(*bounds, every)
        _, _, doc_rows, doc_lengths = shared["document"]
        for r, slot in enumerate(shared["slots"].tolist()):
            n_doc = int(doc_lengths[doc_rows[slot]]) if int(doc_rows[slot]) >= 0 else 0
            assert (rows[r, :, :n_doc] == 7).all()  # the slot's empty lanes: neither read nor written
            assert torch.equal(rows[r, :, n_doc:], every[r, :, n_doc:])
        ahead, ahead_lse = varlen.varlen_attention(**shared, max_tokens=max(longest, 1), row_keys=rows)
        torch.testing.assert_close(ahead.float(), ref.float(), **tol)
        torch.testing.assert_close(ahead_lse, ref_lse, **tol)


def test_a_bad_document_is_refused_in_one_sentence():
    shared, _, _ = shared_document_inputs(SHAPES[2], torch.float32)
    doc_keys, doc_values, doc_rows, doc_lengths = shared["document"]
    for bad in ((doc_keys[:, :1], doc_values[:, :1], doc_rows, doc_lengths), (doc_keys, doc_values, doc_rows[:1],
                                                                              doc_lengths), (doc_keys,)):
        with pytest.raises(KvpotError) as err:
            varlen_attention_reference(**dict(shared, document=bad))
        assert "\n" not in str(err.value)


def test_bad_inputs_are_refused_in_one_sentence():
    from kvpot.kernels.varlen import varlen_attention

    args, _ = inputs(SHAPES[0], torch.float32)
    with pytest.raises(KvpotError, match="starts"):
        varlen_attention(**{**args, "starts": args["starts"][:-1]}, max_tokens=1)
    with pytest.raises(KvpotError, match="max_tokens"):
        varlen_attention(**args, max_tokens=0)
    with pytest.raises(KvpotError, match="key_positions"):
        varlen_attention(**{**args, "key_positions": None}, max_tokens=1)
    with pytest.raises(KvpotError, match="capacity"):
        varlen_attention_reference(**{**args, "cached": args["cached"] + 1000})


@pytest.mark.parametrize("packed", [False, True, "rotated-ahead"], ids=["eager", "packed", "packed-rotated-ahead"])
@pytest.mark.parametrize("name", ["streaming", "h2o", "infinipot-question", "snapkv"])
def test_mixed_steps_on_the_kernel_give_each_request_its_tokens_alone(name, packed, monkeypatch):
    """The kernel inside the engine (a head dim it takes, 32): a mixed step's chunks attended by it, observing
    ones included (H2O's every chunk, InfiniPot's catalyst, SnapKV's window), give the greedy tokens each request
    gets alone (float32), in the eager mixed step and in the fixed-shape one (`kvpot.engine.packed`: the varlen
    and observation kernels over the packed rows), with ranked positions' keys rotated on load or ahead."""
    from kvpot.engine import packed as packed_module

    monkeypatch.setattr(packed_module, "ROTATE_AHEAD", packed == "rotated-ahead")
    import kvpot
    from conftest import VOCAB, build_llama
    from kvpot.engine import mixed
    from kvpot.engine.offline import run_all
    from kvpot.engine.scheduler import Request, Scheduler
    from kvpot.kernels.varlen import varlen_attention

    method = {"streaming": kvpot.StreamingLLM(sinks=4, window=44, chunk_size=16),
              "h2o": kvpot.H2O(heavy=24, recent=24, chunk_size=16),
              "infinipot-question": kvpot.InfiniPot(pot_size=64, catalyst="question"),
              "snapkv": kvpot.SnapKV(budget=48, window=8, chunk_size=64)}[name]
    model = build_llama(head_dim=32, hidden_size=128, num_attention_heads=4, num_key_value_heads=2).to(DEVICE)
    gen = torch.Generator().manual_seed(1)
    prompts = [(torch.randint(3, VOCAB, (n,), generator=gen).tolist(), torch.randint(3, VOCAB, (5,), generator=gen)
                .tolist()) for n in (160, 90, 200, 33)]
    engine = kvpot.Engine(model, method=method, decode="eager")
    alone = [engine.generate_ids(c, q, max_new_tokens=12, ignore_eos=True).token_ids for c, q in prompts]
    capacity = 256 if name == "snapkv" else None  # its cache grows with the prompt until its end
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=3, capacity=capacity, decode="static", mix=True)
    scheduler.decoder.fixed_mix = bool(packed)
    requests = [Request(c, q, max_new_tokens=12, ignore_eos=True) for c, q in prompts]
    assert mixed.varlen_kernel(torch.device(DEVICE), 32) is varlen_attention
    run_all(scheduler, requests)
    assert scheduler.report["mixed_forwards"] > 0
    assert [r.tokens for r in requests] == alone
    steps = scheduler.decoder.packed
    assert (steps is not None and steps.steps > 0) is bool(packed)
    if packed == "rotated-ahead":  # StreamingLLM, H2O and InfiniPot number their entries: keys rotated ahead
        assert (steps.rotated_keys is not None) is (name != "snapkv")
