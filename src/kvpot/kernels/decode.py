"""Triton decode attention over kvpot's bounded cache (issue 16: decoding at the memory-bandwidth limit).

`decode_attention_batch`: each of B batch rows holds one new token's query `[heads, d]` and
attends to the live entries `[0, lengths[s])` of its pool slot `s = rows[b]` in one layer's pool,
`keys`/`values` `[slots, kv_heads, capacity, d]`. `decode_attention` is the single-sequence case
(B = 1 row over one slot: a cache view `[kv_heads, capacity, d]` of `PotLayer.keys[0]`/`values[0]`),
run by the same kernels. `kvpot.kernels.decode_reference` holds the PyTorch references these must
match (tests/test_decode_kernel.py).

- GQA-native: the `g` query heads of a KV group are the rows of one program's tile, so each key and
  value is read once per split and batch row, not once per query head.
- Slots are read in place: each program loads its row's slot from `rows` and that slot's length
  from `lengths` on the device; several rows may name one slot, and a slot with no live entry
  gives an all-zero output row (and all-zero probs).
- RoPE on load: un-rotated keys (`shift`/`reset` policies) are rotated while loading, from each
  entry's position in `key_positions` and the model's cos/sin table, and the query is rotated at
  its slot's query position inside the kernel, so the cache is never re-rotated or copied.
  `cos=None`: keys and queries are already rotated (`absolute`).
- Split-K (FlashDecoding): the grid is (batch rows x KV heads x row tiles, splits), sized from tensor
  shapes and the SM count only. Each program reads its length from the device and takes its share
  of the live range, so every split has work whatever the length, programs whose share is empty
  write an empty partial (log-sum-exp -inf), and nothing synchronises with the host: one step can
  be captured in a CUDA graph and replayed as `rows`, the lengths and the positions change in place.
- `probs` (H2O/TOVA scores): the main kernel also writes the scaled logits, the merge the
  log-sum-exp of each head, and `_probs_kernel` each group's mean probability per entry.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpot.errors import KvpotError
from kvpot.kernels.common import (
    half_scores, load_keys, merge, multiprocessors, next_power_of_2, online_softmax_step, softmax_update,
)
from kvpot.kernels.decode_reference import (
    check_decode_batch_inputs,
    check_shared_inputs,
    check_decode_inputs,
    decode_attention_batch_reference,
    decode_attention_reference,
)

__all__ = [
    "decode_attention",
    "decode_attention_batch",
    "decode_attention_batch_reference",
    "decode_attention_reference",
    "default_splits",
]

BLOCK_N = 64  # entries per loop step
BLOCK_J = 128  # entries per program of the probabilities kernel


@triton.jit
def _slot_length(ROWS, LENGTHS, b, stride_r, stride_len, N):
    """Batch row `b`'s pool slot (int64: offsets into a pool can pass 2**31) and its live count."""
    slot = tl.load(ROWS + b * stride_r).to(tl.int64)
    return slot, tl.minimum(tl.load(LENGTHS + slot * stride_len).to(tl.int32), N)


# stride_os, stride_ls grow with the batch: unspecialised, so a new batch size never compiles again
@triton.jit(do_not_specialize=["N", "G", "KV", "SPLITS", "PER", "stride_os", "stride_ls"])
def _decode_kernel(
    Q,  # [B, H, D] one new token's queries per batch row, un-rotated when ROPE (H = KV * G)
    K, V,  # [S, KV, N, D] pool buffers; the last stride is 1
    ROWS,  # [B] int32/int64: each batch row's pool slot
    LENGTHS,  # [S] int32/int64: slot s has live entries [0, LENGTHS[s])
    COS, SIN,  # [P, D] RoPE table (ROPE)
    KPOS,  # [S, KV, N] int32/int64 RoPE position of each entry (ROPE)
    QPOS,  # [S] or [S, KV] int: each slot's query position, per KV head when stride_qk != 0 (ROPE)
    OUT,  # [SPLITS, B * H, D] float32 partials (SPLIT) or [B * H, D] in the output dtype
    LSE,  # [SPLITS, B * H] float32 log2-sum-exp of each split's scores (SPLIT, or PROBS with one split)
    LOGITS,  # [B * H, N] float32 scores in log2 units (PROBS)
    DK, DV, DKPOS,  # [R, KV, N, D] / [R, KV, N] a shared document region's keys, values, positions (DOC)
    DOC_ROWS, DOC_LENGTHS,  # [S] each slot's document row (-1: none), [R] each document's entries (DOC)
    N, G, KV, SPLITS, PER, scale,  # PER > 0: each split's entries, fixed (else the live count over SPLITS)
    stride_qb, stride_qh, stride_r, stride_len,
    stride_ks, stride_kh, stride_kn, stride_vs, stride_vh, stride_vn,
    stride_ps, stride_ph, stride_pn, stride_qs, stride_qk, stride_t,
    stride_os, stride_or, stride_ls,
    stride_dks, stride_dkh, stride_dkn, stride_dvs, stride_dvh, stride_dvn, stride_dps, stride_dph, stride_dpn,
    stride_dr, stride_dl,
    ROPE: tl.constexpr, PROBS: tl.constexpr, SPLIT: tl.constexpr, HALF: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOC: tl.constexpr,
):
    tiles = tl.cdiv(G, BLOCK_M)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // (KV * tiles)).to(tl.int64)  # batch row
    h = pid // tiles % KV  # KV head
    slot, n = _slot_length(ROWS, LENGTHS, b, stride_r, stride_len, N)
    rows = (pid % tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < G
    head = h * G + rows  # each row's query head
    out_row = b * (KV * G) + head  # its row of OUT, LSE and LOGITS
    dh = tl.arange(0, HALF)
    dd = tl.arange(0, 2 * HALF)
    K += slot * stride_ks + h * stride_kh
    V += slot * stride_vs + h * stride_vh
    n_doc = 0  # DOC: entries [0, n_doc) are read from the slot's document row, the rest from the slot
    if DOC:
        drow = tl.load(DOC_ROWS + slot * stride_dr).to(tl.int64)
        n_doc = tl.where(drow >= 0, tl.load(DOC_LENGTHS + tl.maximum(drow, 0) * stride_dl), 0).to(tl.int32)
        drow = tl.maximum(drow, 0)
        DK += drow * stride_dks + h * stride_dkh
        DV += drow * stride_dvs + h * stride_dvh
        DKPOS += drow * stride_dps + h * stride_dph

    # the query rotated at its position (once per program), scaled for exp2, in the keys' dtype
    q_ptr = Q + b * stride_qb + head[:, None] * stride_qh + dh[None, :]
    q1 = tl.load(q_ptr, mask=row_ok[:, None], other=0.0).to(tl.float32)  # [BLOCK_M, HALF]
    q2 = tl.load(q_ptr + HALF, mask=row_ok[:, None], other=0.0).to(tl.float32)
    if ROPE:
        qt = tl.load(QPOS + slot * stride_qs + h * stride_qk) * stride_t + dh
        c1 = tl.load(COS + qt).to(tl.float32)[None, :]
        c2 = tl.load(COS + qt + HALF).to(tl.float32)[None, :]
        s1 = tl.load(SIN + qt).to(tl.float32)[None, :]
        s2 = tl.load(SIN + qt + HALF).to(tl.float32)[None, :]
        q1, q2 = q1 * c1 - q2 * s1, q2 * c2 + q1 * s2  # rotate_half: (-x2, x1)
        KPOS += slot * stride_ps + h * stride_ph
    qk = scale * 1.4426950408889634
    q1 = (q1 * qk).to(K.dtype.element_ty)
    q2 = (q2 * qk).to(K.dtype.element_ty)

    # this split's share of the live entries: a whole number of blocks, from the device's length
    per = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_N) * BLOCK_N
    if PER > 0:
        per = PER
    lo = split * per
    hi = tl.minimum(lo + per, n)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: an empty split stays NaN-free
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, 2 * HALF], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        live = j < hi
        if DOC:  # each entry from one of the two buffers, loaded and rotated as the slot's are: the same sums
            own = live & (j >= n_doc)
            shared = live & (j < n_doc)
            k1, k2 = load_keys(K, KPOS, COS, SIN, j, own, dh, stride_kn, stride_pn, stride_t, HALF, ROPE)
            d1, d2 = load_keys(DK, DKPOS, COS, SIN, j, shared, dh, stride_dkn, stride_dpn, stride_t, HALF, ROPE)
            k1 = tl.where(shared[:, None], d1, k1)
            k2 = tl.where(shared[:, None], d2, k2)
        else:
            k1, k2 = load_keys(K, KPOS, COS, SIN, j, live, dh, stride_kn, stride_pn, stride_t, HALF, ROPE)
        sc = half_scores(q1, q2, k1, k2, IEEE)  # [BLOCK_M, BLOCK_N], log2 units
        sc = tl.where(live[None, :], sc, float("-inf"))
        if PROBS:
            tl.store(LOGITS + out_row[:, None] * N + j[None, :], sc, mask=row_ok[:, None] & live[None, :])
        if DOC:
            v = tl.load(V + j[:, None] * stride_vn + dd[None, :], mask=own[:, None], other=0.0)
            dv = tl.load(DV + j[:, None] * stride_dvn + dd[None, :], mask=shared[:, None], other=0.0)
            m_i, l_i, acc = softmax_update(sc, m_i, l_i, acc, tl.where(shared[:, None], dv, v), IEEE)
        else:
            m_i, l_i, acc = online_softmax_step(sc, m_i, l_i, acc, V, j, live, dd, stride_vn, IEEE)

    # a slot with no live entry (l_i == 0) writes zeros and log-sum-exp -inf
    safe = tl.where(l_i > 0, l_i, 1.0)
    o_ptr = OUT + split.to(tl.int64) * stride_os + out_row[:, None] * stride_or + dd[None, :]
    tl.store(o_ptr, (acc / safe[:, None]).to(OUT.dtype.element_ty), mask=row_ok[:, None])
    if SPLIT or PROBS:
        lse = tl.where(l_i > 0, m_i + tl.log2(safe), float("-inf"))
        tl.store(LSE + split * stride_ls + out_row, lse, mask=row_ok)


@triton.jit(do_not_specialize=["N", "G", "KV"])
def _probs_kernel(
    LOGITS,  # [B * H, N] float32 scores in log2 units (entries below the row's length written)
    LSE,  # [B * H] float32 each head's log2-sum-exp over the live entries
    PROBS,  # [B, KV, N] float32 out: mean over the group's heads of the probabilities, 0 past the length
    ROWS, LENGTHS,  # [B] each batch row's pool slot, [S] each slot's live count
    N, G, KV, stride_r, stride_len, stride_pb, stride_pk, stride_pn,
    BLOCK_G: tl.constexpr, BLOCK_J: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // KV).to(tl.int64)  # batch row
    h = pid % KV  # KV head
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    _, n = _slot_length(ROWS, LENGTHS, b, stride_r, stride_len, N)
    r = tl.arange(0, BLOCK_G)
    r_ok = r < G
    out_row = b * (KV * G) + h * G + r
    live = j < n
    lse = tl.load(LSE + out_row, mask=r_ok, other=0.0)
    logit = tl.load(LOGITS + out_row[:, None] * N + j[None, :], mask=r_ok[:, None] & live[None, :],
                    other=float("-inf"))
    mean = tl.sum(tl.exp2(logit - lse[:, None]), axis=0) / G  # NaN only where nothing is live: not stored
    tl.store(PROBS + b * stride_pb + h * stride_pk + j * stride_pn, tl.where(live, mean, 0.0), mask=j < N)


def default_splits(kv_heads: int, heads: int, capacity: int, device: torch.device, batch: int = 1) -> int:
    """Splits per (batch row, KV head, row tile): about two programs per multiprocessor in all, at
    least one split and at most one per block of the capacity. With many batch rows the rows fill
    the device and one split suffices. Never depends on the live lengths, so a captured graph
    stays valid as they grow."""
    programs = batch * kv_heads * triton.cdiv(heads // kv_heads, _block_m(heads // kv_heads))
    return max(1, min(triton.cdiv(capacity, BLOCK_N), triton.cdiv(2 * multiprocessors(device), programs)))


def _block_m(group: int) -> int:
    # 16 rows is the smallest matrix-unit tile: small groups pad up to it (the work is memory-bound)
    return min(64, max(16, next_power_of_2(group)))


def _stages(d: int, keys: torch.Tensor, cos: torch.Tensor | None, block_n: int = BLOCK_N) -> int:
    """Software-pipeline depth that fits each stage's K, V (and cos/sin) tiles in ~160 KB of shared memory."""
    per_stage = 2 * block_n * d * keys.element_size()
    if cos is not None:
        per_stage += 2 * block_n * d * cos.element_size()
    return max(1, min(3, (160 * 1024) // per_stage))


def launch_shape(batch: int, kv: int, g: int, d: int, keys: torch.Tensor, cos: torch.Tensor | None
                 ) -> tuple[int, int, int]:
    """(entries per loop step, warps, pipeline stages) of `_decode_kernel` for a launch; the results never
    depend on it (tests/test_decode_kernel.py tries several).

    When the rows give every multiprocessor at least one program (one or two splits then), 32-entry steps
    three deep keep more loads in flight per multiprocessor than 64-entry steps two deep. On an H100, 64 rows
    over 4,096 entries (the 64-reader step, rotated on load): 374 against 463 us a layer, 2.92 against 2.36 TB/s
    (benchmarks/engine-core-h100/decode_sweep.py, records/engine-core-h100/decode-tuning/). On an H200, one
    tensor-parallel rank's half of it (64 rows, 4 KV heads: one program per multiprocessor, two splits):
    177.5 against 217.3 us, 3.07 against 2.51 TB/s (records/tp-h200x2/). Fewer rows split each slot further,
    where the sweeps did not look."""
    if batch * kv * triton.cdiv(g, _block_m(g)) >= multiprocessors(keys.device):
        return 32, 4, _stages(d, keys, cos, 32)
    return BLOCK_N, 4, _stages(d, keys, cos)


def _rope_arguments(keys, lengths, cos, sin, key_positions, query_positions):
    """The RoPE tensors and strides of `_decode_kernel` (placeholders and zero strides without a table)."""
    if cos is None:
        return (keys, keys, lengths, lengths), (0, 0, 0, 0, 0, 0)
    if cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise KvpotError("decode attention wants cos/sin tables with contiguous rows and equal strides")
    per_head = query_positions.dim() == 2  # [S, KV]; [S] is one position for all of a slot's heads
    strides = (*key_positions.stride(), query_positions.stride(0), query_positions.stride(1) if per_head else 0,
               cos.stride(0))
    return (cos, sin, key_positions, query_positions), strides


def _document_arguments(documents, keys, lengths, cos):
    """The region tensors and strides of `_decode_kernel` (placeholders and zero strides without documents)."""
    if documents is None:
        return (keys, keys, lengths, lengths, lengths), (0,) * 11
    doc_keys, doc_values, doc_positions, doc_rows, doc_lengths = documents
    if doc_keys.stride(-1) != 1 or doc_values.stride(-1) != 1:
        raise KvpotError("decode attention reads a document region's rows in place: their last dimension must be "
                         "contiguous")
    if cos is None or doc_positions is None:  # keys stored rotated: positions are not read
        doc_positions, position_strides = lengths, (0, 0, 0)
    else:
        position_strides = doc_positions.stride()
    strides = (*doc_keys.stride()[:3], *doc_values.stride()[:3], *position_strides, doc_rows.stride(0),
               doc_lengths.stride(0))
    return (doc_keys, doc_values, doc_positions, doc_rows, doc_lengths), strides


def decode_attention_batch(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    scaling: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    query_positions: torch.Tensor | None = None,
    probs: torch.Tensor | None = None,
    num_splits: int | None = None,
    split_entries: int | None = None,
    documents: tuple | None = None,
) -> torch.Tensor:
    """Attention [B, heads, d] (query.dtype) of each batch row's `query` [B, heads, d] over the live
    entries `[0, lengths[rows[b]])` of its pool slot in `keys`/`values` [S, kv_heads, capacity, d]
    (any strides but the last).

    `rows` [B] int64 and `lengths` [S] int32/int64 live on the device; several rows may name one slot
    (e.g. padding rows pointing at a scratch slot), and a slot with no live entry gives an all-zero
    row. With cos/sin [P, d] (the model's table, attention scaling included), keys are rotated
    while loading at `key_positions` [S, kv_heads, capacity] and each row's query at its slot's
    `query_positions` ([S] or [S, kv_heads]); without, both are taken as already rotated. `probs`
    [B, kv_heads, capacity] float32, when given, receives per row each KV group's mean attention
    probabilities over the live entries (0 past the length). `num_splits` overrides the split-K
    count (default: `default_splits`, from shapes and the SM count). `split_entries` (a multiple of
    `BLOCK_N`) instead fixes each split's entries, and the launch shape with it: a row's output then
    depends on its slot's live entries alone, not on the batch or the capacity (batch-invariant decoding,
    `kvpot.kernels.invariant`). `documents` (doc_keys, doc_values, doc_key_positions, doc_rows, doc_lengths): a
    slot reading a shared document reads its first entries from the document's row of that region, as
    `decode_attention_batch_reference` says, each entry loaded and rotated as its copy in the slot would be: with
    `split_entries`, a reader's output is then the copied reader's, bit for bit (batch-invariant sharing; the
    cascade kernel `kvpot.kernels.shared` reads a document once per group instead, in sums of its own). No host
    synchronisation and no allocation sized from device values: safe to capture in a CUDA graph.
    """
    check_decode_batch_inputs(query, keys, values, rows, lengths, cos, sin, key_positions, query_positions, probs)
    if documents is not None:
        check_shared_inputs(query, keys, *documents[:2], *documents[3:], documents[2], cos)
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise KvpotError("decode attention reads keys/values rows in place: their last dimension must be contiguous")
    given = (query, values, rows, lengths, cos, sin, key_positions, query_positions, probs, *(documents or ()))
    if any(t is not None and t.device != keys.device for t in given):
        raise KvpotError(f"decode attention needs every tensor on the cache's device ({keys.device})")
    if num_splits is not None and num_splits < 1:
        raise KvpotError(f"num_splits must be at least 1, got {num_splits}")
    if split_entries is not None and (num_splits is not None or split_entries < 1 or split_entries % BLOCK_N):
        raise KvpotError(f"split_entries must be a positive multiple of {BLOCK_N}, without num_splits; got "
                         f"{split_entries} (num_splits {num_splits})")
    batch, heads, d = query.shape
    _, kv, capacity, _ = keys.shape
    g = heads // kv
    device = query.device
    out = torch.empty(batch, heads, d, dtype=query.dtype, device=device)
    if batch == 0:  # nothing to launch (a grid of zero programs)
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    block_m = _block_m(g)
    tiles = triton.cdiv(g, block_m)
    if split_entries is not None:  # fixed: the sums' order must not follow the batch
        block_n, warps, stages = BLOCK_N, 4, _stages(d, keys, cos)
        splits = triton.cdiv(capacity, split_entries)
    else:
        block_n, warps, stages = launch_shape(batch, kv, g, d, keys, cos)
        blocks = triton.cdiv(capacity, block_n)
        splits = min(blocks, num_splits) if num_splits is not None else default_splits(kv, heads, capacity, device,
                                                                                        batch)
    flat = out.view(batch * heads, d)  # the merge and the kernels index rows b * heads + head
    lse_final = torch.empty(batch * heads, dtype=torch.float32, device=device) if probs is not None else None
    logits = torch.empty(batch * heads, capacity, dtype=torch.float32, device=device) if probs is not None else out
    if splits > 1:
        part = torch.empty(splits, batch * heads, d, dtype=torch.float32, device=device)
        lse = torch.empty(splits, batch * heads, dtype=torch.float32, device=device)
    else:  # one split: the kernel writes the output (and the log-sum-exp probs need) itself
        part, lse = flat.unsqueeze(0), lse_final if lse_final is not None else out
    tables, rope_strides = _rope_arguments(keys, lengths, cos, sin, key_positions, query_positions)
    region, region_strides = _document_arguments(documents, keys, lengths, cos)
    _decode_kernel[(batch * kv * tiles, splits)](
        query, keys, values, rows, lengths, *tables, part, lse, logits, *region, capacity, g, kv, splits,
        split_entries or 0, scaling,
        query.stride(0), query.stride(1), rows.stride(0), lengths.stride(0),
        *keys.stride()[:3], *values.stride()[:3], *rope_strides,
        part.stride(0), part.stride(1), batch * heads, *region_strides,
        ROPE=cos is not None, PROBS=probs is not None, SPLIT=splits > 1, HALF=d // 2,
        IEEE=keys.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, DOC=documents is not None,
        num_warps=warps, num_stages=stages,
    )
    if splits > 1:
        merge(part, lse, flat, lse_final)
    if probs is not None:
        _probs_kernel[(batch * kv, triton.cdiv(capacity, BLOCK_J))](
            logits, lse_final, probs, rows, lengths, capacity, g, kv, rows.stride(0), lengths.stride(0),
            *probs.stride(), BLOCK_G=max(2, next_power_of_2(g)), BLOCK_J=BLOCK_J,
        )
    return out


def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    length: torch.Tensor,
    scaling: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    query_position: torch.Tensor | None = None,
    probs: torch.Tensor | None = None,
    num_splits: int | None = None,
    split_entries: int | None = None,
) -> torch.Tensor:
    """Attention [heads, dv] (query.dtype) of one token's `query` [heads, d] over entries
    `[0, length)` of `keys`/`values` [kv_heads, capacity, d] (any strides but the last).

    `length`: [] int32/int64 on the device (0 gives zeros). With cos/sin [P, d] (the model's table,
    attention scaling included), keys are rotated while loading at `key_positions` [kv_heads,
    capacity] and the query at `query_position` ([] or [kv_heads]); without, both are taken as
    already rotated.
    `probs` [kv_heads, capacity] float32, when given, receives each KV group's mean attention
    probabilities over the live entries (0 past `length`). `num_splits` overrides the split-K
    count (default: `default_splits`, from shapes and the SM count); `split_entries` fixes each split's
    entries (as in `decode_attention_batch`). No host synchronisation and
    no allocation sized from device values: safe to capture in a CUDA graph.

    The batch of one row over one slot: `decode_attention_batch` on views, so one kernel serves both.
    """
    check_decode_inputs(query, keys, values, length, cos, sin, key_positions, query_position, probs)
    if query_position is not None:  # [] -> [S = 1]; [kv_heads] -> [1, kv_heads]
        query_position = query_position.reshape(1) if query_position.numel() == 1 else query_position[None]
    rows = torch.zeros(1, dtype=torch.int64, device=keys.device)  # the one row reads slot 0
    out = decode_attention_batch(
        query[None], keys[None], values[None], rows, length.reshape(1), scaling, cos, sin,
        None if key_positions is None else key_positions[None], query_position,
        None if probs is None else probs[None], num_splits, split_entries,
    )
    return out[0]


# The compiled step (`Engine(compile_step=True)`) calls the decode kernels as they are, between its compiled
# regions: on the H100 (torch 2.11) inductor's functionalisation of these user-defined Triton kernels failed
# on the `llama3-8b` step (an assertion in `decompose_triton_kernel_wrapper_functional`; the `llama3.2-1b`
# step compiled), and the attention is one kernel launch already: what the compiler fuses is around it.
decode_attention_batch = torch.compiler.disable(decode_attention_batch)
decode_attention = torch.compiler.disable(decode_attention)
