"""Triton decode attention over a shared document and each row's private tail (cascade attention).

`decode_attention_shared` takes `kvpot.kernels.shared_reference.decode_attention_shared_reference`'s arguments and
must match it (tests/test_shared_document_kernel.py). One kernel, `_segment_kernel`, attends *groups* of batch rows
to one range of one row of a KV buffer, launched twice:

- the document segment: a group is every batch row reading one document row of the pool's region; its tile is
  (reader, query head) pairs, so the document's keys and values are read once per tile of up to 64 query rows
  (16 readers of a GQA-4 model), not once per reader: the step reads a document shared by 64 readers 4 times
  instead of 64 (FlashInfer calls this cascade attention; nothing here is taken from its code);
- the tail: a group is one batch row, its range `[n_doc, length)` of its own slot (rows reading no document:
  `[0, length)`), as `kvpot.kernels.decode` reads a slot.

Both write split-K partials (normalised outputs and log2-sum-exps) into one `[splits_a + splits_b, B * H, d]`
buffer, and `kvpot.kernels.common.merge` merges them: the log-sum-exp merge of two segments is the split-K merge.
Each program reads its range's ends itself (the document's length; a tail's slot, document and counts). A tail
in one split merges the document's partials in its own program and writes the output; otherwise its program
writes "no key" into the document partials of a row that reads none, and `merge` runs. So a layer's attention is
two launches (three when tails split) and nothing else: a captured step runs every small index or fill operation
as a launch of its own, once per layer. `launch_shape` gives each launch's tile, warps, stages and splits
(`benchmarks/shared-document-h100/shared_sweep.py` sweeps them).
Shapes and grids depend on tensor shapes only; groups are formed on the device (a stable sort of the rows by
their document), so nothing synchronises with the host and the step can be captured in a CUDA graph.
`probs` (an observation of the step: H2O, TOVA) is not written by this kernel: with `probs` the reference runs
(the methods that share a document through decoding, Full, Truncate, InfiniPot and SirLLM, observe nothing
in an append step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpot.errors import KvpotError
from kvpot.kernels.common import half_scores, load_keys, online_softmax_step, merge, multiprocessors, next_power_of_2
from kvpot.kernels.decode_reference import check_decode_batch_inputs
from kvpot.kernels.shared_reference import check_shared_inputs, decode_attention_shared_reference

BLOCK_N = 64  # entries per loop step of the document segment


@triton.jit(do_not_specialize=["N", "G", "KV", "SPLITS", "TILES", "BASE", "stride_os", "stride_ls"])
def _segment_kernel(
    Q,  # [B, H, D] one token's queries per batch row, un-rotated when ROPE (H = KV * G)
    K, V,  # [R, KV, N, D] the buffer the launch reads (the document region, or the pool's slots)
    ROWS,  # [B] each batch row's pool slot (where its query position is)
    MEMBERS,  # [B] batch rows ordered by document (DOC)
    GSTART,  # [documents + 1] document g's readers are MEMBERS[GSTART[g] : GSTART[g + 1]] (DOC)
    DOC_ROWS,  # [S] each slot's document row, -1: none
    DOC_LENGTHS,  # [documents] each document row's entries
    LENGTHS,  # [S] each slot's entries (its tail ends there)
    COS, SIN,  # [P, D] RoPE table (ROPE)
    KPOS,  # [R, KV, N] RoPE position of each entry (ROPE_K)
    QPOS,  # [S] or [S, KV] each slot's query position (ROPE)
    OUT,  # [BASE + SPLITS, B * H, D] float32 normalised partials; this launch writes splits BASE..
    LSE,  # [BASE + SPLITS, B * H] float32 log2-sum-exp of each partial's scores (-inf: it saw no key)
    FINAL,  # [B * H, D] the attention's output (MERGE)
    N, G, KV, SPLITS, TILES, BASE, scale,
    stride_qb, stride_qh, stride_r, stride_dr, stride_dl, stride_len,
    stride_ks, stride_kh, stride_kn, stride_vs, stride_vh, stride_vn,
    stride_ps, stride_ph, stride_pn, stride_qs, stride_qk, stride_t,
    stride_os, stride_or, stride_ls,
    # DOC: a program's group is a document row and its readers, else one batch row and its tail. MERGE (a tail in
    # one split): the tail's program merges the document's partials (splits 0..BASE, written by the launch before)
    # with its own and writes the output, else it writes its partials and clears the document partials of a row
    # reading no document (nothing else writes them) for `merge`
    DOC: tl.constexpr, MERGE: tl.constexpr,
    # ROPE: the queries are rotated here; ROPE_K: the keys too (not those of a document stored rotated)
    ROPE: tl.constexpr, ROPE_K: tl.constexpr, HALF: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # a group is the grid's slower dimension: its programs are dispatched together, and the region's idle rows
    # (documents no row reads) come after the read ones, exiting at once, instead of holding multiprocessors
    # between the read one's splits (records/shared-document-h100/)
    pid = tl.program_id(0)
    grp = tl.program_id(1).to(tl.int64)
    split = pid // (KV * TILES)
    h = pid // TILES % KV
    tile = pid % TILES
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # (member, query head of the group) pairs
    if DOC:
        first = tl.load(GSTART + grp)
        count = tl.load(GSTART + grp + 1) - first
        row_ok = r < count * G
        member = tl.load(MEMBERS + first + r // G, mask=row_ok, other=0).to(tl.int64)  # each tile row's batch row
        src = grp
        start_at = 0
        end_at = tl.load(DOC_LENGTHS + grp * stride_dl).to(tl.int32)
    else:
        count = 1
        row_ok = r < G
        member = grp + r * 0
        src = tl.load(ROWS + grp * stride_r).to(tl.int64)
        doc = tl.load(DOC_ROWS + src * stride_dr).to(tl.int64)
        start_at = tl.where(doc >= 0, tl.load(DOC_LENGTHS + tl.maximum(doc, 0) * stride_dl), 0).to(tl.int32)
        end_at = tl.load(LENGTHS + src * stride_len).to(tl.int32)
    if tile * BLOCK_M < count * G:  # a tile past its group's rows (an idle document's: all) does nothing
        head = h * G + r % G
        out_row = member * (KV * G) + head
        dh = tl.arange(0, HALF)
        dd = tl.arange(0, 2 * HALF)
        if not DOC and not MERGE:
            if (split == 0) & (doc < 0):  # the row reads no document: its document partials say "no key"
                for s in range(0, BASE):
                    tl.store(OUT + s * stride_os + out_row[:, None] * stride_or + dd[None, :],
                             tl.zeros([BLOCK_M, 2 * HALF], tl.float32), mask=row_ok[:, None])
                    tl.store(LSE + s * stride_ls + out_row, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
        K += src * stride_ks + h * stride_kh
        V += src * stride_vs + h * stride_vh

        q_ptr = Q + member[:, None] * stride_qb + head[:, None] * stride_qh + dh[None, :]
        q1 = tl.load(q_ptr, mask=row_ok[:, None], other=0.0).to(tl.float32)  # [BLOCK_M, HALF]
        q2 = tl.load(q_ptr + HALF, mask=row_ok[:, None], other=0.0).to(tl.float32)
        if ROPE:  # each tile row rotated at its own slot's query position
            slot = tl.load(ROWS + member * stride_r, mask=row_ok, other=0).to(tl.int64)
            qt = tl.load(QPOS + slot * stride_qs + h * stride_qk, mask=row_ok, other=0)[:, None] * stride_t \
                + dh[None, :]
            c1 = tl.load(COS + qt, mask=row_ok[:, None], other=0.0).to(tl.float32)
            c2 = tl.load(COS + qt + HALF, mask=row_ok[:, None], other=0.0).to(tl.float32)
            s1 = tl.load(SIN + qt, mask=row_ok[:, None], other=0.0).to(tl.float32)
            s2 = tl.load(SIN + qt + HALF, mask=row_ok[:, None], other=0.0).to(tl.float32)
            q1, q2 = q1 * c1 - q2 * s1, q2 * c2 + q1 * s2  # rotate_half: (-x2, x1)
        if ROPE_K:
            KPOS += src * stride_ps + h * stride_ph
        qk = scale * 1.4426950408889634
        q1 = (q1 * qk).to(K.dtype.element_ty)
        q2 = (q2 * qk).to(K.dtype.element_ty)

        # this split's share of the group's range
        end_at = tl.minimum(end_at, N)
        per = tl.cdiv(tl.cdiv(tl.maximum(end_at - start_at, 0), SPLITS), BLOCK_N) * BLOCK_N
        lo = start_at + split * per
        hi = tl.minimum(lo + per, end_at)
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, 2 * HALF], tl.float32)
        for begin in range(lo, hi, BLOCK_N):
            j = begin + tl.arange(0, BLOCK_N)
            live = j < hi
            k1, k2 = load_keys(K, KPOS, COS, SIN, j, live, dh, stride_kn, stride_pn, stride_t, HALF, ROPE_K)
            sc = half_scores(q1, q2, k1, k2, IEEE)  # log2 units
            sc = tl.where(live[None, :], sc, float("-inf"))
            m_i, l_i, acc = online_softmax_step(sc, m_i, l_i, acc, V, j, live, dd, stride_vn, IEEE)
        safe = tl.where(l_i > 0, l_i, 1.0)
        lse_own = tl.where(l_i > 0, m_i + tl.log2(safe), float("-inf"))
        if MERGE:  # as `kvpot.kernels.common.merge`, with this tail as the last split
            reads = row_ok & (doc >= 0)
            top = lse_own
            for s in range(0, BASE):
                top = tl.maximum(top, tl.load(LSE + s * stride_ls + out_row, mask=reads, other=float("-inf")))
            top = tl.where(top == float("-inf"), 0.0, top)
            w = tl.exp2(lse_own - top)
            total = w
            merged = (acc / safe[:, None]) * w[:, None]
            for s in range(0, BASE):
                w = tl.exp2(tl.load(LSE + s * stride_ls + out_row, mask=reads, other=float("-inf")) - top)
                part = tl.load(OUT + s * stride_os + out_row[:, None] * stride_or + dd[None, :], mask=reads[:, None],
                               other=0.0)
                total += w
                merged += part * w[:, None]
            merged = merged / tl.where(total > 0, total, 1.0)[:, None]
            tl.store(FINAL + out_row[:, None] * (2 * HALF) + dd[None, :], merged.to(FINAL.dtype.element_ty),
                     mask=row_ok[:, None])
        else:
            at = BASE + split
            tl.store(OUT + at * stride_os + out_row[:, None] * stride_or + dd[None, :], acc / safe[:, None],
                     mask=row_ok[:, None])
            tl.store(LSE + at * stride_ls + out_row, lse_own, mask=row_ok)


def _block_m(rows: int) -> int:
    return min(64, max(16, next_power_of_2(rows)))


def _splits(programs: int, capacity: int, device: torch.device, block_n: int, per_sm: float) -> int:
    """Splits of a range: about `per_sm` programs per multiprocessor in all, at most one per block (shapes only)."""
    target = max(1, round(per_sm * multiprocessors(device)))
    return max(1, min(triton.cdiv(capacity, block_n), triton.cdiv(target, max(1, programs))))


def launch_shape(segment: str, batch: int, kv: int, g: int, d: int, capacity: int,
                 device: torch.device, element_size: int = 2) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages, splits) of one segment's launch, `segment` "document" or "tail": from
    shapes only, so a captured step keeps its launches. `benchmarks/shared-document-h100/shared_sweep.py`
    replaces it to time others. Chosen on an H100 at 64 readers of a 2,993-entry document with 160-entry tails
    (`records/shared-document-h100/`): the document's tiles in 8 warps, three stages deep, its range split so that
    its programs fill one wave of multiprocessors (4 splits there: the document's launch alone 22.1 us, against
    27.3 at 3, 31.9 at 6 and 37.0 at 2, once an idle document's programs exit at once; before that, when they held
    multiprocessors, 3 splits were fastest at 37.4); tails 32 entries a loop step, three stages deep (114 against
    125 us at 64, with the document at its former shape)."""
    # the loop's stages hold K and V blocks in shared memory: three of 64 x 128 in 2 bytes fit, not in 4 or at 256
    deep = 3 if element_size <= 2 and d <= 128 else 2 if d <= 128 else 1
    if segment == "document":  # a tile is up to 64 (reader, query head) pairs of one document's readers
        block_m = _block_m(batch * g)
        programs = kv * triton.cdiv(batch * g, block_m)
        # one wave: as many splits as leave every program a multiprocessor (an idle document's programs exit at once)
        wave = max(1, multiprocessors(device) // programs)
        return block_m, BLOCK_N, 8, deep, max(1, min(triton.cdiv(capacity, BLOCK_N), wave))
    block_m = _block_m(g)  # a tile is one row's query heads
    programs = batch * kv * triton.cdiv(g, block_m)
    return block_m, 32, 4, deep, _splits(programs, capacity, device, 32, 2.0)


def _launch(segment, query, keys, values, rows, groups, documents, lengths, rope, part, lse, base, shape, g, kv,
            scaling, rotated: bool = False, final: torch.Tensor | None = None):
    block_m, block_n, warps, stages, splits = shape
    members, gstart = groups
    doc_rows, doc_lengths = documents
    cos, sin, key_positions, query_positions = rope
    batch = query.shape[0]
    document = segment == "document"
    owners = doc_lengths.shape[0] if document else batch
    tiles = triton.cdiv((batch if document else 1) * g, block_m)
    if cos is None:
        tables, rope_strides = (keys, keys, rows, rows), (0,) * 6
    else:
        per_head = query_positions.dim() == 2
        tables = (cos, sin, key_positions, query_positions)
        rope_strides = (*key_positions.stride(), query_positions.stride(0),
                        query_positions.stride(1) if per_head else 0, cos.stride(0))
    d = query.shape[-1]
    _segment_kernel[(splits * kv * tiles, owners)](
        query, keys, values, rows, members, gstart, doc_rows, doc_lengths, lengths, *tables, part, lse,
        part if final is None else final, keys.shape[2], g, kv, splits, tiles, base, scaling,
        query.stride(0), query.stride(1), rows.stride(0), doc_rows.stride(0), doc_lengths.stride(0), lengths.stride(0),
        *keys.stride()[:3], *values.stride()[:3], *rope_strides,
        part.stride(0), part.stride(1), lse.stride(0),
        DOC=document, MERGE=final is not None, ROPE=cos is not None, ROPE_K=cos is not None and not rotated, HALF=d // 2,
        IEEE=keys.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
    )


def shared_groups(rows: torch.Tensor, doc_rows: torch.Tensor, documents: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(members [B], starts [documents + 1]): the batch rows sorted (stably) by the document they read, and where
    each document's run of readers starts (rows reading none sort first, in no run). The same for every layer of
    a step: `StepCache` makes them once per step and passes them as `groups`."""
    rows = rows.to(torch.int64)
    doc_of_row = doc_rows.to(torch.int64)[rows]  # [B], -1: none
    sorted_docs, members = torch.sort(doc_of_row, stable=True)
    # (the last start, of value `documents`, is B: every row's document is below it. No element is written from
    # the host: a Python scalar stored into a CUDA tensor is a host-to-device copy, which a graph capture refuses)
    starts = torch.searchsorted(sorted_docs, torch.arange(documents + 1, device=rows.device, dtype=torch.int64))
    return members, starts


def decode_attention_shared(query, keys, values, rows, lengths, doc_keys, doc_values, doc_rows, doc_lengths,
                            scaling: float, cos=None, sin=None, key_positions=None, doc_key_positions=None,
                            query_positions=None, probs=None, groups=None, doc_rotated: bool = False) -> torch.Tensor:
    """`decode_attention_shared_reference` on Triton (same arguments and result): the document segment read once
    per tile of its readers, each row's tail, merged by log-sum-exp. `groups`: `shared_groups(rows, doc_rows,
    documents)` if made already (once per step). `doc_rotated`: the document's keys are stored rotated at their
    positions (`kvpot.engine.documents`: loaded once, so rotated once), and only the queries are rotated here.
    No host synchronisation."""
    if probs is not None:  # the observation is not written here: the reference (exact, capture-safe) writes it
        return decode_attention_shared_reference(query, keys, values, rows, lengths, doc_keys, doc_values, doc_rows,
                                                 doc_lengths, scaling, cos, sin, key_positions, doc_key_positions,
                                                 query_positions, probs, doc_rotated)
    check_decode_batch_inputs(query, keys, values, rows, lengths, cos, sin, key_positions, query_positions, None)
    check_shared_inputs(query, keys, doc_keys, doc_values, doc_rows, doc_lengths, doc_key_positions, cos, doc_rotated)
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or doc_keys.stride(-1) != 1 or doc_values.stride(-1) != 1:
        raise KvpotError("shared decode attention reads rows in place: their last dimension must be contiguous")
    batch, heads, d = query.shape
    docs, kv, capacity = doc_keys.shape[:3]
    g = heads // kv
    device = query.device
    out = torch.empty(batch, heads, d, dtype=query.dtype, device=device)
    if batch == 0:
        return out
    query = query.contiguous()
    rows = rows.to(torch.int64)
    # groups, on the device: the rows sorted (stably) by their document, each document's run of rows
    groups = groups if groups is not None else shared_groups(rows, doc_rows, docs)
    doc_shape = launch_shape("document", batch, kv, g, d, capacity, device, keys.element_size())
    tail_shape = launch_shape("tail", batch, kv, g, d, capacity, device, keys.element_size())
    splits_doc, splits_tail = doc_shape[-1], tail_shape[-1]
    # a tail in one split merges in its own program (the document's partials are written by the launch before);
    # otherwise a third launch merges. Every partial is written by a launch (a row reading no document: its
    # tail's program clears its document partials), so nothing is filled first
    merged = splits_tail == 1
    partials = splits_doc + (0 if merged else splits_tail)
    part = torch.empty(partials, batch * heads, d, dtype=torch.float32, device=device)
    lse = torch.empty(partials, batch * heads, dtype=torch.float32, device=device)
    documents = (doc_rows, doc_lengths)
    _launch("document", query, doc_keys, doc_values, rows, groups, documents, lengths,
            (cos, sin, doc_key_positions, query_positions), part, lse, 0, doc_shape, g, kv, scaling,
            rotated=doc_rotated)
    _launch("tail", query, keys, values, rows, groups, documents, lengths, (cos, sin, key_positions, query_positions),
            part, lse, splits_doc, tail_shape, g, kv, scaling, final=out if merged else None)
    if not merged:
        merge(part, lse, out.view(batch * heads, d))
    return out


decode_attention_shared = torch.compiler.disable(decode_attention_shared)
