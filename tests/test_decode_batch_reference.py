"""The batched decode attention reference against a loop of the single-sequence reference, on CPU.

`decode_attention_batch_reference` (batched einsums over B rows of a slot pool) and
`decode_attention_reference` (one sequence) are written independently; here each batch row must
give what the single-sequence reference gives on its own slot. Plain PyTorch: no Triton needed,
so this runs everywhere (the batched Triton kernel is checked against this reference in
tests/test_decode_kernel.py). Inputs are poisoned as there: NaN past each slot's length and in
slots no row names, positions far outside the table.
"""

from __future__ import annotations

import pytest
import torch
from conftest import BATCH_SHAPES, make_batch_inputs

from kvpot.errors import KvpotError
from kvpot.kernels.decode_reference import (
    check_decode_batch_inputs,
    decode_attention_batch_reference,
    decode_attention_reference,
)

DEVICE = "cpu"
IDS = [s[0] for s in BATCH_SHAPES]
TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 4e-3}  # output rounding only


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def per_row_reference(query, keys, values, rows, lengths, scaling, extra, with_probs):
    """The single-sequence reference on each batch row's slot: outputs [B, heads, d] and probs
    [B, kv, capacity] (rows whose slot has no live entry: zeros, which the single reference,
    defined for length >= 1, does not give)."""
    out = torch.zeros_like(query)
    probs = torch.zeros(len(rows), keys.shape[1], keys.shape[2]) if with_probs else None
    for b, slot in enumerate(rows.tolist()):
        if lengths[slot] == 0:
            continue
        single = {}
        if extra:
            single = dict(cos=extra["cos"], sin=extra["sin"], key_positions=extra["key_positions"][slot],
                          query_position=extra["query_positions"][slot])
        out[b] = decode_attention_reference(query[b], keys[slot], values[slot], lengths[slot], scaling,
                                            probs=None if probs is None else probs[b], **single)
    return out, probs


@pytest.mark.parametrize("with_probs", [False, True], ids=["out", "probs"])
@pytest.mark.parametrize("rope", [True, False], ids=["rope-on-load", "pre-rotated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", BATCH_SHAPES, ids=IDS)
def test_batch_reference_equals_the_single_reference_per_row(shape, dtype, rope, with_probs):
    _, heads, kv, d, capacity, lengths, rows = shape
    query, keys, values, row_t, length_t, extra = make_batch_inputs(shape, dtype, seed=len(rows) + d, rope=rope,
                                                                    device=DEVICE)
    probs = torch.full((len(rows), kv, capacity), float("nan")) if with_probs else None
    out = decode_attention_batch_reference(query, keys, values, row_t, length_t, d**-0.5, probs=probs, **extra)
    assert out.shape == (len(rows), heads, d) and out.dtype == dtype
    assert not out.isnan().any(), "the batched reference read a poisoned entry"
    expected, expected_probs = per_row_reference(query, keys, values, row_t, length_t, d**-0.5, extra, with_probs)
    assert rel_error(out, expected) < TOLERANCE[dtype]
    empty = [b for b, slot in enumerate(rows) if lengths[slot] == 0]
    assert (out[empty] == 0).all()
    if with_probs:
        torch.testing.assert_close(probs, expected_probs, atol=1e-6, rtol=1e-5)
        assert (probs[empty] == 0).all()


def test_int32_inputs_and_one_query_position_per_slot():
    """int32 rows, lengths and key positions; query positions [S] (one per slot, for all its KV heads)."""
    shape = BATCH_SHAPES[2]
    _, heads, kv, d, capacity, lengths, rows = shape
    query, keys, values, row_t, length_t, extra = make_batch_inputs(shape, torch.float32, seed=5,
                                                                    positions_dtype=torch.int32, device=DEVICE)
    extra["query_positions"] = extra["query_positions"][:, 0]  # [S]
    out = decode_attention_batch_reference(query, keys, values, row_t.int(), length_t.int(), 0.3, **extra)
    expected_extra = dict(extra, query_positions=extra["query_positions"][:, None].expand(-1, kv))
    expected, _ = per_row_reference(query, keys, values, row_t, length_t, 0.3, expected_extra, False)
    assert rel_error(out, expected) < 1e-6


def test_rows_sharing_a_slot_attend_to_the_same_cache():
    """Two rows with the same query over the same slot give the same output; a row's result does not
    depend on which other rows are in the batch."""
    shape = BATCH_SHAPES[2]
    query, keys, values, rows, lengths, extra = make_batch_inputs(shape, torch.float32, seed=9, device=DEVICE)
    query[2] = query[0]  # rows 0 and 2 both read slot 1
    out = decode_attention_batch_reference(query, keys, values, rows, lengths, 0.125, **extra)
    torch.testing.assert_close(out[0], out[2], rtol=0, atol=0)
    alone = decode_attention_batch_reference(query[3:], keys, values, rows[3:], lengths, 0.125, **extra)
    torch.testing.assert_close(alone[0], out[3], rtol=1e-6, atol=1e-7)


def test_bad_batch_inputs_raise_clear_errors():
    q, k, v = torch.randn(3, 8, 64), torch.randn(4, 2, 64, 64), torch.randn(4, 2, 64, 64)
    rows, lengths = torch.tensor([0, 1, 1]), torch.tensor([3, 5, 0, 64])
    cos = torch.randn(100, 64)

    def check(match, **changes):
        args = dict(query=q, keys=k, values=v, rows=rows, lengths=lengths, cos=None, sin=None, key_positions=None,
                    query_positions=None, probs=None)
        args.update(changes)
        with pytest.raises(KvpotError, match=match):
            check_decode_batch_inputs(**args, kernel=False)

    check(r"query \[batch, heads, d\]", query=q[0])
    check(r"keys/values \[slots, kv_heads, capacity, d\]", keys=k[0])
    check("head dim 64 with one capacity", values=v[:, :, :32])
    check("do not split into groups", query=torch.randn(3, 7, 64))
    check("`rows` must be an int64 \\[3\\]", rows=rows[:2])
    check("`rows` must be an int64", rows=rows.float())
    check("`lengths` must be an int32/int64 \\[4\\]", lengths=lengths[:3])
    check("both cos and sin", cos=cos)
    check("needs key_positions and query_position", cos=cos, sin=cos)
    check(r"RoPE tables must be \[positions, 64\]", cos=cos[:, :32], sin=cos[:, :32],
          key_positions=torch.zeros(4, 2, 64, dtype=torch.long), query_positions=torch.zeros(4, dtype=torch.long))
    check(r"key_positions must be \[4, 2, 64\]", cos=cos, sin=cos, key_positions=torch.zeros(2, 64, dtype=torch.long),
          query_positions=torch.zeros(4, dtype=torch.long))
    check(r"query_positions must be \[4\] or \[4, 2\]", cos=cos, sin=cos,
          key_positions=torch.zeros(4, 2, 64, dtype=torch.long), query_positions=torch.zeros(3, dtype=torch.long))
    check(r"probs must be a float32 \[3, 2, 64\]", probs=torch.zeros(4, 2, 64))
    check("probs must be a float32", probs=torch.zeros(3, 2, 64, dtype=torch.float16))
    with pytest.raises(KvpotError, match="head dim 48"):  # the kernel's limit, not the reference's
        check_decode_batch_inputs(q[..., :48], k[..., :48], v[..., :48], rows, lengths, None, None, None, None, None)


@pytest.mark.parametrize("chunk_rows", [1, 2], ids=["row-by-row", "two-rows"])
def test_chunks_of_rows_give_what_one_chunk_gives(monkeypatch, chunk_rows):
    """Large pools go through in chunks of rows (CHUNK_ELEMENTS): the same outputs and probs, the last
    chunk short when the batch does not divide."""
    from kvpot.kernels import decode_reference

    shape = BATCH_SHAPES[2]
    _, heads, kv, d, capacity, lengths, rows = shape
    query, keys, values, row_t, length_t, extra = make_batch_inputs(shape, torch.float16, seed=3, device=DEVICE)
    whole_probs = torch.empty(len(rows), kv, capacity)
    whole = decode_attention_batch_reference(query, keys, values, row_t, length_t, 0.125, probs=whole_probs, **extra)
    monkeypatch.setattr(decode_reference, "CHUNK_ELEMENTS", chunk_rows * kv * capacity * d)
    probs = torch.full((len(rows), kv, capacity), float("nan"))
    out = decode_attention_batch_reference(query, keys, values, row_t, length_t, 0.125, probs=probs, **extra)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, whole)  # float16's tolerance: a matmul over fewer rows may round apart
    torch.testing.assert_close(probs, whole_probs, rtol=1e-6, atol=1e-7)
