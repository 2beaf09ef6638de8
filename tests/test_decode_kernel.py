"""The Triton decode attention kernel against its PyTorch references, over named lists of shapes:
one sequence (`decode_attention`) and B batch rows over a pool of slots (`decode_attention_batch`).

Runs on CUDA; on a CPU machine with Triton installed, `TRITON_INTERPRET=1 pytest tests/test_decode_kernel.py`
runs the same kernels in Triton's interpreter (small capacities; CUDA adds long ones). Elsewhere the
module is skipped with the reason. Inputs are fresh random draws; entries past `length` are poisoned
(NaN keys/values, positions far outside the table) so a kernel that reads them fails; the `probs`
output is poisoned with NaN before each call, so every entry it leaves unwritten shows.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    BATCH_SHAPES,
    KERNEL_DEVICE,
    interpreter_runtime_loops,
    make_batch_inputs,
    needs_kernels,
    rope_table,
    skip_interpreted_bf16,
)

from kvpot.errors import KvpotError
from kvpot.kernels.decode_reference import decode_attention_batch_reference, decode_attention_reference

DEVICE = KERNEL_DEVICE
pytestmark = needs_kernels()
interpreter_runtime_loops()

# (name, query heads, kv heads, head dim, capacity, live length): GQA ratios 1/3/4/8, ragged tails
SHAPES = [
    ("gqa1-d64-ragged", 8, 8, 64, 200, 173),  # length not a multiple of the 64-entry block
    ("gqa3-d128-full", 9, 3, 128, 192, 192),  # length == capacity
    ("gqa4-d128-one", 8, 2, 128, 160, 1),  # a single live entry: every other split is empty
    ("gqa8-d64-short", 16, 2, 64, 1000, 37),  # length << capacity
    ("gqa4-d64-32x8", 32, 8, 64, 130, 129),  # llama3-8b's head layout
]
if DEVICE == "cuda":  # long caches only where they run fast
    SHAPES += [
        ("llama3-8b-4k", 32, 8, 128, 4096, 3001),
        ("llama3-8b-32k-full", 32, 8, 128, 32768, 32768),
        ("gqa8-d128-32k-short", 32, 4, 128, 32768, 700),
        ("gqa1-d64-16k", 16, 16, 64, 16384, 9999),
    ]
IDS = [s[0] for s in SHAPES]
if DEVICE == "cuda":  # BATCH_SHAPES (conftest) plus long pools: 16 rows over 8 slots, lengths 0 to full
    BATCH_SHAPES = BATCH_SHAPES + [
        ("llama3-8b-b16-4k", 32, 8, 128, 4096, [4096, 1, 3001, 0, 64, 2047, 517, 4000],
         [0, 1, 2, 3, 4, 5, 6, 7, 7, 6, 5, 4, 2, 2, 3, 3]),
        ("gqa4-d64-b5-16k", 16, 4, 64, 16384, [9999, 16384, 130, 0, 1], [1, 0, 2, 4, 4]),
    ]
BATCH_IDS = [s[0] for s in BATCH_SHAPES]
# the parametrisation of the kernel-against-reference comparisons, one sequence and batched alike
WITH_PROBS = pytest.mark.parametrize("with_probs", [False, True], ids=["out", "probs"])
ROPE = pytest.mark.parametrize("rope", [True, False], ids=["rope-on-load", "pre-rotated"])
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def make_inputs(shape, dtype, seed, rope=True, positions_dtype=torch.int64):
    """Fresh inputs; keys/values are strided views of a wider buffer, like slices of the cache."""
    _, heads, kv, d, capacity, length = shape
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    query = torch.randn(heads, d, generator=gen, device=DEVICE).to(dtype)
    buffer = torch.randn(2, kv, capacity + 5, d, generator=gen, device=DEVICE).to(dtype)
    keys, values = buffer[0, :, :capacity], buffer[1, :, :capacity]
    keys[:, length:] = float("nan")  # poison: dead entries must never be read
    values[:, length:] = float("nan")
    table = 2 * capacity + 16
    # distinct positions per KV head with gaps, in random order (evictions leave the cache unsorted)
    positions = torch.stack([torch.randperm(table - 16, generator=gen, device=DEVICE)[:capacity] for _ in range(kv)])
    positions[:, length:] = 10**9  # far outside the table: a masked-off load only
    query_position = table - 1 - torch.randint(0, 16, (kv,), generator=gen, device=DEVICE)
    extra = {}
    if rope:
        cos, sin = rope_table(table, d, dtype)
        extra = dict(cos=cos, sin=sin, key_positions=positions.to(positions_dtype), query_position=query_position)
    return query, keys, values, torch.tensor(length, device=DEVICE), extra


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in the kernel's output"
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def check_probs(probs: torch.Tensor, ref: torch.Tensor, length: int, dtype: torch.dtype) -> None:
    assert probs.isfinite().all(), "probs left unwritten (NaN poison) or not finite"
    assert (probs[:, length:] == 0).all()
    # every KV row is a mean of softmaxes: it sums to 1 (the kernel normalises by its own log-sum-exp)
    torch.testing.assert_close(probs.sum(1), torch.ones(probs.shape[0], device=probs.device), atol=1e-4, rtol=0)
    l1 = (probs - ref).abs().sum(1) / ref.abs().sum(1)
    assert float(l1.max()) < (1e-5 if dtype == torch.float32 else 2e-2)


@WITH_PROBS
@ROPE
@DTYPES
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_decode_attention_matches_the_reference(shape, dtype, rope, with_probs):
    from kvpot.kernels.decode import decode_attention

    skip_interpreted_bf16(dtype)
    _, heads, kv, d, capacity, length = shape
    query, keys, values, n, extra = make_inputs(shape, dtype, seed=capacity + length + d, rope=rope)
    scaling = d**-0.5
    ref_probs = torch.empty(kv, capacity, device=DEVICE) if with_probs else None
    ref = decode_attention_reference(query, keys, values, n, scaling, probs=ref_probs, **extra)
    assert not ref.isnan().any()  # the reference must not read the poisoned entries either
    probs = torch.full((kv, capacity), float("nan"), device=DEVICE) if with_probs else None
    out = decode_attention(query, keys, values, n, scaling, probs=probs, **extra)
    assert out.shape == (heads, d) and out.dtype == dtype
    assert rel_error(out, ref) < TOLERANCE[dtype]
    if with_probs:
        check_probs(probs, ref_probs, length, dtype)


@pytest.mark.parametrize("num_splits", [1, 3, 10**6], ids=["one-split", "three-splits", "more-splits-than-blocks"])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[3]], ids=[IDS[0], IDS[3]])
def test_every_split_count_gives_the_same_attention(shape, num_splits):
    """Explicit split counts (one: no merge; more than the capacity has blocks: clamped, most empty),
    int32 positions/length and a scalar query position."""
    from kvpot.kernels.decode import decode_attention

    _, heads, kv, d, capacity, length = shape
    query, keys, values, n, extra = make_inputs(shape, torch.float32, seed=num_splits % 97,
                                                positions_dtype=torch.int32)
    extra["query_position"] = extra["query_position"][0]  # [] : one position for every KV head
    n = n.to(torch.int32)
    ref_probs = torch.empty(kv, capacity, device=DEVICE)
    ref = decode_attention_reference(query, keys, values, n, 0.3, probs=ref_probs, **extra)
    probs = torch.full((kv, capacity), float("nan"), device=DEVICE)
    out = decode_attention(query, keys, values, n, 0.3, probs=probs, num_splits=num_splits, **extra)
    assert rel_error(out, ref) < 1e-5
    check_probs(probs, ref_probs, length, torch.float32)


def test_rope_on_load_equals_the_models_own_rotation_and_sdpa():
    """With a model's real table (yarn: attention scaling != 1), rotating un-rotated keys at their
    positions inside the kernel gives what HF's apply_rotary_pos_emb + SDPA give."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from kvpot.kernels.decode import decode_attention

    heads, kv, d, capacity, length = 8, 2, 64, 150, 111
    config = LlamaConfig(hidden_size=heads * d, num_attention_heads=heads, num_key_value_heads=kv,
                         max_position_embeddings=4096, rope_parameters={
                             "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 512})
    rotary = LlamaRotaryEmbedding(config).to(DEVICE)
    assert rotary.attention_scaling != 1.0
    table = 1024
    like = torch.empty(1, device=DEVICE)
    cos, sin = (t[0] for t in rotary(like, torch.arange(table, device=DEVICE)[None]))  # [table, d]
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    query = torch.randn(heads, d, generator=gen, device=DEVICE)
    keys = torch.randn(kv, capacity, d, generator=gen, device=DEVICE)
    values = torch.randn(kv, capacity, d, generator=gen, device=DEVICE)
    positions = torch.stack([torch.randperm(table - 1, generator=gen, device=DEVICE)[:capacity] for _ in range(kv)])
    at = torch.tensor([table - 1, 700], device=DEVICE)  # per KV head, as after a per-head shift
    grouped = query.view(kv, heads // kv, 1, d)
    q_rot, _ = apply_rotary_pos_emb(grouped, grouped, cos[at][:, None], sin[at][:, None])  # [kv, g, 1, d]
    _, k_rot = apply_rotary_pos_emb(keys, keys, cos[positions], sin[positions], unsqueeze_dim=0)
    k_rot = k_rot[0]  # [kv, capacity, d]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q_rot, k_rot[:, None, :length], values[:, None, :length], scale=d**-0.5)  # [kv, g, 1, d]
    out = decode_attention(query, keys, values, torch.tensor(length, device=DEVICE), d**-0.5, cos=cos, sin=sin,
                           key_positions=positions, query_position=at)
    assert rel_error(out, expected.reshape(heads, d)) < 1e-5
    # pre-rotated keys and query (the `absolute` policy) through the table-free path: the same numbers
    pre = decode_attention(q_rot.reshape(heads, d), k_rot, values, torch.tensor(length, device=DEVICE), d**-0.5)
    assert rel_error(pre, expected.reshape(heads, d)) < 1e-5


def test_bad_inputs_raise_clear_errors():
    from kvpot.kernels.decode import decode_attention

    q, k, v = torch.randn(8, 48, device=DEVICE), torch.randn(2, 64, 48, device=DEVICE), torch.randn(2, 64, 48, device=DEVICE)
    n = torch.tensor(10, device=DEVICE)
    with pytest.raises(KvpotError, match="head dim 48"):
        decode_attention(q, k, v, n, 0.1)
    q, k, v = torch.randn(6, 64, device=DEVICE), torch.randn(4, 64, 64, device=DEVICE), torch.randn(4, 64, 64, device=DEVICE)
    with pytest.raises(KvpotError, match="do not split into groups"):
        decode_attention(q, k, v, n, 0.1)
    q = torch.randn(8, 64, device=DEVICE)
    cos = torch.randn(100, 64, device=DEVICE)
    with pytest.raises(KvpotError, match="needs key_positions and query_position"):
        decode_attention(q, k, v, n, 0.1, cos=cos, sin=cos)
    with pytest.raises(KvpotError, match="probs must be a float32"):
        decode_attention(q, k, v, n, 0.1, probs=torch.zeros(4, 64, dtype=torch.float16, device=DEVICE))
    with pytest.raises(KvpotError, match="last dimension must be contiguous"):
        decode_attention(q, k.transpose(1, 2), v, n, 0.1)
    with pytest.raises(KvpotError, match="num_splits"):
        decode_attention(q, k, v, n, 0.1, num_splits=0)
    if DEVICE == "cuda":
        with pytest.raises(KvpotError, match="on the cache's device"):
            decode_attention(q, k, v, n.cpu(), 0.1)


def capture(step):
    """Warm `step` up on a side stream (compiling its kernels), then capture it in a CUDA graph:
    (graph, the captured output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_one_captured_graph_serves_every_length_and_position(dtype):
    """Capture one decode step (RoPE on load + probs) in a CUDA graph, then change `length`, the key
    positions and the query position in place and replay: each replay matches the reference."""
    from kvpot.kernels.decode import decode_attention

    shape = ("graph", 32, 8, 128, 4096, 4096)
    query, keys, values, n, extra = make_inputs(shape, dtype, seed=12)
    keys.copy_(torch.randn_like(keys))  # every entry valid: `length` moves over the whole capacity
    values.copy_(torch.randn_like(values))
    positions, at = extra["key_positions"], extra["query_position"]
    positions.copy_(torch.stack([torch.randperm(4096, device=DEVICE) for _ in range(8)]))
    probs = torch.empty(8, 4096, device=DEVICE)

    def step():
        return decode_attention(query, keys, values, n, 0.088, probs=probs, **extra)

    graph, out = capture(step)
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    for length in (1, 63, 64, 1000, 3001, 4096):
        n.fill_(length)
        positions.copy_(torch.stack([torch.randperm(8000, generator=gen, device=DEVICE)[:4096] for _ in range(8)]))
        at.copy_(8100 + torch.randint(0, 90, (8,), generator=gen, device=DEVICE))
        probs.fill_(float("nan"))
        graph.replay()
        ref_probs = torch.empty_like(probs)
        ref = decode_attention_reference(query, keys, values, n, 0.088, probs=ref_probs, **extra)
        assert rel_error(out, ref) < TOLERANCE[dtype], length
        check_probs(probs, ref_probs, length, dtype)


def check_batch(out, ref, probs, ref_probs, lengths, rows, dtype) -> None:
    """The batched kernel's outputs (and probs) against the reference's, row by row where it matters:
    rows whose slot has no live entry are exact zeros."""
    assert rel_error(out, ref) < TOLERANCE[dtype]
    for b, slot in enumerate(rows):
        if lengths[slot] == 0:
            assert (out[b] == 0).all(), f"row {b} over an empty slot"
            assert probs is None or (probs[b] == 0).all(), f"probs of row {b} over an empty slot"
        elif probs is not None:
            check_probs(probs[b], ref_probs[b], lengths[slot], dtype)


@WITH_PROBS
@ROPE
@DTYPES
@pytest.mark.parametrize("shape", BATCH_SHAPES, ids=BATCH_IDS)
def test_decode_attention_batch_matches_the_reference(shape, dtype, rope, with_probs):
    from kvpot.kernels.decode import decode_attention_batch

    skip_interpreted_bf16(dtype)
    _, heads, kv, d, capacity, lengths, rows = shape
    query, keys, values, row_t, length_t, extra = make_batch_inputs(shape, dtype, seed=capacity + len(rows) + d,
                                                                    rope=rope)
    scaling = d**-0.5
    ref_probs = torch.empty(len(rows), kv, capacity, device=DEVICE) if with_probs else None
    ref = decode_attention_batch_reference(query, keys, values, row_t, length_t, scaling, probs=ref_probs, **extra)
    assert not ref.isnan().any()
    probs = torch.full((len(rows), kv, capacity), float("nan"), device=DEVICE) if with_probs else None
    out = decode_attention_batch(query, keys, values, row_t, length_t, scaling, probs=probs, **extra)
    assert out.shape == (len(rows), heads, d) and out.dtype == dtype
    check_batch(out, ref, probs, ref_probs, lengths, rows, dtype)


@pytest.mark.parametrize("launch", [(32, 4, 3), (64, 4, 2), (128, 8, 1)], ids=["32x3", "64x2", "128x1"])
@pytest.mark.parametrize("shape", [BATCH_SHAPES[1], BATCH_SHAPES[3]], ids=[BATCH_IDS[1], BATCH_IDS[3]])
def test_every_launch_shape_gives_the_same_batch_attention(shape, launch, monkeypatch):
    """The entries per loop step, warps and stages (`launch_shape`, tuned by speed alone) never change the
    attention or the probabilities, with one split or several."""
    import kvpot.kernels.decode as decode

    _, heads, kv, d, capacity, lengths, rows = shape
    query, keys, values, row_t, length_t, extra = make_batch_inputs(shape, torch.float32, seed=sum(launch))
    ref_probs = torch.empty(len(rows), kv, capacity, device=DEVICE)
    ref = decode_attention_batch_reference(query, keys, values, row_t, length_t, 0.3, probs=ref_probs, **extra)
    monkeypatch.setattr(decode, "launch_shape", lambda *args: launch)
    for splits in (1, 3):
        probs = torch.full((len(rows), kv, capacity), float("nan"), device=DEVICE)
        out = decode.decode_attention_batch(query, keys, values, row_t, length_t, 0.3, probs=probs,
                                            num_splits=splits, **extra)
        check_batch(out, ref, probs, ref_probs, lengths, rows, torch.float32)


def test_rows_that_fill_the_device_stream_their_slots_in_short_steps():
    """The launch shape the 64-reader sweeps chose: 32-entry steps once the rows give every multiprocessor a
    program (one split when they give it two; a tensor-parallel rank's 4 KV heads: two), 64 below that, where
    each slot is split further."""
    from kvpot.kernels.common import multiprocessors
    from kvpot.kernels.decode import BLOCK_N, default_splits, launch_shape

    keys = torch.empty(1, 8, 64, 128, dtype=torch.bfloat16, device=DEVICE)
    sms = multiprocessors(keys.device)
    full = 2 * sms // 8  # rows of 8 KV heads (GQA 4: one tile each) that fill it twice over
    assert launch_shape(full, 8, 4, 128, keys, keys)[0] == 32
    assert default_splits(8, 32, 4096, keys.device, full) == 1
    half = -(-sms // 4)  # rows of 4 KV heads (one TP=2 rank of llama3-8b) that give each multiprocessor one
    assert launch_shape(half, 4, 4, 128, keys, keys)[0] == 32
    assert launch_shape(half - 1, 4, 4, 128, keys, keys)[0] == BLOCK_N == 64
    assert launch_shape(1, 4, 4, 128, keys, None) == (64, 4, 3)  # one row (8 KV heads fill the interpreter's 8)


@pytest.mark.parametrize("num_splits", [1, 3, 10**6], ids=["one-split", "three-splits", "more-splits-than-blocks"])
@pytest.mark.parametrize("shape", [BATCH_SHAPES[1], BATCH_SHAPES[3]], ids=[BATCH_IDS[1], BATCH_IDS[3]])
def test_every_split_count_gives_the_same_batch_attention(shape, num_splits):
    """Explicit split counts over a batch, with int32 lengths/positions and one query position per slot."""
    from kvpot.kernels.decode import decode_attention_batch

    _, heads, kv, d, capacity, lengths, rows = shape
    query, keys, values, row_t, length_t, extra = make_batch_inputs(shape, torch.float32, seed=num_splits % 89,
                                                                    positions_dtype=torch.int32)
    extra["query_positions"] = extra["query_positions"][:, 0].clone()  # [S]: one position per slot
    length_t = length_t.to(torch.int32)
    ref_probs = torch.empty(len(rows), kv, capacity, device=DEVICE)
    ref = decode_attention_batch_reference(query, keys, values, row_t, length_t, 0.3, probs=ref_probs, **extra)
    probs = torch.full((len(rows), kv, capacity), float("nan"), device=DEVICE)
    out = decode_attention_batch(query, keys, values, row_t, length_t, 0.3, probs=probs, num_splits=num_splits,
                                 **extra)
    check_batch(out, ref, probs, ref_probs, lengths, rows, torch.float32)


def test_batch_rows_give_what_one_sequence_gives():
    """Each row of a batch equals `decode_attention` on its slot alone (one kernel, two entry points)."""
    from kvpot.kernels.decode import decode_attention, decode_attention_batch

    shape = BATCH_SHAPES[2]
    _, heads, kv, d, capacity, lengths, rows = shape
    query, keys, values, row_t, length_t, extra = make_batch_inputs(shape, torch.float32, seed=21)
    out = decode_attention_batch(query, keys, values, row_t, length_t, 0.2, **extra)
    for b, slot in enumerate(rows):
        single = decode_attention(query[b], keys[slot], values[slot], length_t[slot], 0.2, cos=extra["cos"],
                                  sin=extra["sin"], key_positions=extra["key_positions"][slot],
                                  query_position=extra["query_positions"][slot])
        torch.testing.assert_close(out[b], single, rtol=1e-6, atol=1e-6)


def test_batch_splits_come_from_shapes_and_fill_the_device():
    """About two programs per multiprocessor in all: many batch rows need fewer splits (at least one)."""
    from kvpot.kernels.common import multiprocessors
    from kvpot.kernels.decode import default_splits

    device = torch.device(DEVICE)
    sms = multiprocessors(device)
    one = default_splits(8, 32, 1 << 20, device)
    assert one == default_splits(8, 32, 1 << 20, device, batch=1) == -(-2 * sms // 8)
    assert default_splits(8, 32, 1 << 20, device, batch=2) == -(-2 * sms // 16)
    assert default_splits(8, 32, 1 << 20, device, batch=4 * sms) == 1
    assert default_splits(8, 32, 64, device) == 1  # at most one split per block of the capacity


def test_bad_batch_inputs_raise_clear_errors():
    from kvpot.kernels.decode import decode_attention_batch

    q, k, v = torch.randn(3, 8, 64, device=DEVICE), torch.randn(4, 2, 64, 64, device=DEVICE), torch.randn(
        4, 2, 64, 64, device=DEVICE)
    rows, lengths = torch.tensor([0, 1, 1], device=DEVICE), torch.tensor([3, 5, 0, 64], device=DEVICE)
    with pytest.raises(KvpotError, match="`rows` must be an int64"):
        decode_attention_batch(q, k, v, rows[:2], lengths, 0.1)
    with pytest.raises(KvpotError, match="head dim 48"):
        decode_attention_batch(q[..., :48], k[..., :48], v[..., :48], rows, lengths, 0.1)
    with pytest.raises(KvpotError, match="last dimension must be contiguous"):
        decode_attention_batch(q, k.transpose(2, 3), v, rows, lengths, 0.1)
    with pytest.raises(KvpotError, match="num_splits"):
        decode_attention_batch(q, k, v, rows, lengths, 0.1, num_splits=0)
    if DEVICE == "cuda":
        with pytest.raises(KvpotError, match="on the cache's device"):
            decode_attention_batch(q, k, v, rows.cpu(), lengths, 0.1)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a CUDA device")
def test_one_captured_batch_graph_serves_every_row_length_and_position():
    """Capture one batched decode step (RoPE on load + probs), then change `rows`, the lengths and the
    positions in place and replay: each replay matches the reference."""
    from kvpot.kernels.decode import decode_attention_batch

    lengths, rows = [4096, 1, 3001, 0, 64, 2047, 517, 4000], [0, 1, 2, 3, 4, 5, 6, 7, 7, 6, 5, 4]
    shape = ("graph", 32, 8, 128, 4096, lengths, rows)
    query, keys, values, row_t, length_t, extra = make_batch_inputs(shape, torch.bfloat16, seed=13)
    keys.copy_(torch.randn_like(keys))  # every entry valid: lengths move over the whole capacity
    values.copy_(torch.randn_like(values))
    positions, at = extra["key_positions"], extra["query_positions"]
    probs = torch.empty(len(rows), 8, 4096, device=DEVICE)

    def step():
        return decode_attention_batch(query, keys, values, row_t, length_t, 0.088, probs=probs, **extra)

    graph, out = capture(step)
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    for _ in range(4):
        new_lengths = torch.randint(0, 4097, (8,), generator=gen, device=DEVICE)
        new_lengths[0] = 0  # always one empty slot
        length_t.copy_(new_lengths)
        row_t.copy_(torch.randint(0, 8, (len(rows),), generator=gen, device=DEVICE))
        positions.copy_(torch.randint(0, 8000, positions.shape, generator=gen, device=DEVICE))
        at.copy_(8100 + torch.randint(0, 90, at.shape, generator=gen, device=DEVICE))
        probs.fill_(float("nan"))
        graph.replay()
        ref_probs = torch.empty_like(probs)
        ref = decode_attention_batch_reference(query, keys, values, row_t, length_t, 0.088, probs=ref_probs, **extra)
        check_batch(out, ref, probs, ref_probs, length_t.tolist(), row_t.tolist(), torch.bfloat16)
