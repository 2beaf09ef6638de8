"""Triton varlen attention over pool slots (issue 43): decoding rows and prompt chunks in one launch.

`varlen_attention` computes what `kvpot.kernels.varlen_reference` defines: packed rows of different query
lengths, row `r`'s `i`-th token over its slot's entries `[0, cached[r] + i]` (all that was cached before the
forward, its own chunk causally). tests/test_varlen_kernel.py holds both to each other over named shapes.

- One program per (row, tile of `BLOCK_Q` tokens, KV head): the `G` query heads of the group and the tile's
  tokens are folded into the rows of one matrix tile (row `m` is token `m // G_PAD`, head `m % G_PAD`), so each
  key and value is read once per tile, as in the decode kernel.
- The grid is sized from `max_tokens` (a host bound on any row's tokens: a step's bucket), never from device
  values: the rows' bounds, slots and cached counts are read on the device, and a tile past its row's tokens
  exits at once. A step of fixed buckets can therefore be captured in a CUDA graph.
- RoPE on load, as in the decode kernel: keys at their stored positions (`load_keys`), each token's query at
  its own entry's (appended before attention, as `PotLayer.rotate_queries` reads it: per KV head, so policies
  that number each head's entries apart are followed). `cos=None`: both are already rotated.
- Returns each token's log-sum-exp beside the output: the observation kernels (`kvpot.kernels.observe`)
  normalise with it, and a segment's output can be merged with another's.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvpot.errors import KvpotError
from kvpot.kernels.common import half_scores, load_keys, load_query, online_softmax_step, next_power_of_2
from kvpot.kernels.varlen_reference import check_document, check_varlen_inputs, varlen_attention_reference

__all__ = ["varlen_attention", "varlen_attention_reference"]

BLOCK_N = 64  # entries per loop step (float32)
# Half precision's launch: folded rows a tile (tokens x the group's heads), entries a loop step, warps, pipeline
# stages. `benchmarks/engine-core-h100/varlen_sweep.py` times the choices at the 8B mixed step's shapes: on an H200
# this one was the fastest or within 1% of it at all four (a 1,024-token chunk beside 32 decoding rows, a 2,048-token
# chunk; keys rotated on load or stored rotated), and 26% faster than 64 / 64 / 4 / 2 at 2,048 tokens
# (records/engine-core-h200/packed/). Head dims over 128 keep the smaller tiles (WIDE_LAUNCH), whose shared memory
# fits a 256-wide head.
HALF_LAUNCH = {"rows": 128, "block_n": 128, "warps": 8, "stages": 2}
# The entries every token of a tile sees (all cached before its first token) read in a loop of their own, without
# the causal mask over each block's scores; only the blocks at the tile's own tokens are masked. The same outputs bit
# for bit (interpreter tests; on an H200 `varlen_sweep.py --prefix off,on` at six shapes). There it saved 5-6% with
# keys rotated on load (chunk-1024 459 -> 431 us) but 0.1-0.4% with keys read already rotated (stored rotated, 344.0 ->
# 342.9 us: the key loop that keys rotated ahead, the default, run; records/engine-core-h200/packed-3/): off, as the
# kernel's GPU tests ran.
UNMASKED_PREFIX = False
WIDE_LAUNCH = {"rows": 64, "block_n": 64, "warps": 4, "stages": 2}
LN2 = math.log(2.0)


@triton.jit(do_not_specialize=["N", "TILES", "stride_ks", "stride_vs", "stride_ps"])
def _varlen_kernel(
    Q,  # [T, H, D] packed tokens' queries, un-rotated when ROPE (H = KV * G)
    K, V,  # [S, KV, N, D] pool buffers; the last stride is 1
    SLOTS, STARTS, CACHED,  # [R], [R + 1], [R] int: each row's slot, its tokens' bounds, its entries before them
    COS, SIN,  # [P, D] RoPE table (ROPE)
    KPOS,  # [S, KV, N] int RoPE position of each entry (ROPE); a token's query takes its own entry's
    OUT,  # [T, H, D] output dtype
    LSE,  # [T, H] float32 natural log-sum-exp
    DK, DV,  # [D, KV, N, D] a shared document region, keys stored rotated (DOC)
    DOC_ROWS, DOC_LENGTHS,  # [S] each slot's document row (-1: none), [D] each document's entries (DOC)
    N, TILES, scale,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_kn, stride_vs, stride_vh, stride_vn,
    stride_ps, stride_ph, stride_pn, stride_t, stride_ot, stride_oh,
    stride_dks, stride_dkh, stride_dkn, stride_dvs, stride_dvh, stride_dvn, stride_dr, stride_dl,
    G: tl.constexpr, G_PAD: tl.constexpr, KV: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    KEYS_BY_ROW: tl.constexpr = False,  # K is [R, KV, N, D]: each row's keys rotated already (`rotate_rows`)
    PREFIX: tl.constexpr = False,  # UNMASKED_PREFIX
    DOC: tl.constexpr = False,  # a slot reading a shared document takes its first entries from its region row
):
    pid = tl.program_id(0)
    h = tl.program_id(1)  # KV head
    r = pid // TILES  # row
    tile = pid % TILES
    first = tl.load(STARTS + r).to(tl.int64)
    count = (tl.load(STARTS + r + 1) - first).to(tl.int32)  # the row's tokens
    if tile * BLOCK_Q < count:
        slot = tl.load(SLOTS + r).to(tl.int64)
        before = tl.load(CACHED + r).to(tl.int32)
        m = tl.arange(0, BLOCK_Q * G_PAD)
        token = tile * BLOCK_Q + m // G_PAD  # within the row
        g = m % G_PAD
        row_ok = (token < count) & (g < G)
        head = h * G + g
        dh = tl.arange(0, HALF)
        dd = tl.arange(0, 2 * HALF)
        at = first + token  # packed index
        if KEYS_BY_ROW:
            K += r.to(tl.int64) * stride_ks + h * stride_kh
        else:
            K += slot * stride_ks + h * stride_kh
        V += slot * stride_vs + h * stride_vh
        KPOS += slot * stride_ps + h * stride_ph  # (strides 0 without ROPE)

        q_ptr = Q + at[:, None] * stride_qt + head[:, None] * stride_qh + dh[None, :]
        q1, q2 = load_query(q_ptr, KPOS, COS, SIN, before + token, row_ok, dh, stride_pn, stride_t, HALF, ROPE)
        qk = scale * 1.4426950408889634
        q1 = (q1 * qk).to(K.dtype.element_ty)
        q2 = (q2 * qk).to(K.dtype.element_ty)

        sees = before + token  # the last entry each folded row sees
        hi = tl.minimum(before + tl.minimum(count, (tile + 1) * BLOCK_Q), N)  # entries the tile reads at most
        m_i = tl.full([BLOCK_Q * G_PAD], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * G_PAD, 2 * HALF], tl.float32)
        first_entry = 0  # the slot's first entry read (past a shared document's, read from its region below)
        if DOC:  # every token of the tile sees the whole document: no causal mask, keys stored rotated
            doc = tl.load(DOC_ROWS + slot * stride_dr).to(tl.int64)
            n_doc = tl.where(doc >= 0, tl.load(DOC_LENGTHS + tl.maximum(doc, 0) * stride_dl), 0).to(tl.int32)
            n_doc = tl.minimum(n_doc, hi)
            first_entry = n_doc
            DK += tl.maximum(doc, 0) * stride_dks + h * stride_dkh
            DV += tl.maximum(doc, 0) * stride_dvs + h * stride_dvh
            for start in range(0, n_doc, BLOCK_N):
                j = start + tl.arange(0, BLOCK_N)
                live = j < n_doc
                k1, k2 = load_keys(DK, DK, DK, DK, j, live, dh, stride_dkn, 0, 0, HALF, False)
                sc = half_scores(q1, q2, k1, k2, IEEE)
                sc = tl.where(live[None, :], sc, float("-inf"))
                m_i, l_i, acc = online_softmax_step(sc, m_i, l_i, acc, DV, j, live, dd, stride_dvn, IEEE)
        masked = first_entry
        if PREFIX:  # whole blocks before the tile's first token: every folded row sees them all
            masked = tl.maximum(tl.minimum((before + tile * BLOCK_Q + 1) // BLOCK_N * BLOCK_N, hi), first_entry)
            for start in range(first_entry, masked, BLOCK_N):
                j = start + tl.arange(0, BLOCK_N)
                live = j < masked
                k1, k2 = load_keys(K, KPOS, COS, SIN, j, live, dh, stride_kn, stride_pn, stride_t, HALF,
                                   ROPE and not KEYS_BY_ROW)
                sc = half_scores(q1, q2, k1, k2, IEEE)
                if DOC:  # past a document, blocks start unaligned: the last may run past `masked`
                    sc = tl.where(live[None, :], sc, float("-inf"))
                m_i, l_i, acc = online_softmax_step(sc, m_i, l_i, acc, V, j, live, dd, stride_vn, IEEE)
        for start in range(masked, hi, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            live = j < hi
            k1, k2 = load_keys(K, KPOS, COS, SIN, j, live, dh, stride_kn, stride_pn, stride_t, HALF,
                               ROPE and not KEYS_BY_ROW)
            sc = half_scores(q1, q2, k1, k2, IEEE)  # log2 units
            sc = tl.where(live[None, :] & (j[None, :] <= sees[:, None]), sc, float("-inf"))
            m_i, l_i, acc = online_softmax_step(sc, m_i, l_i, acc, V, j, live, dd, stride_vn, IEEE)

        safe = tl.where(l_i > 0, l_i, 1.0)
        o_ptr = OUT + at[:, None] * stride_ot + head[:, None] * stride_oh + dd[None, :]
        tl.store(o_ptr, (acc / safe[:, None]).to(OUT.dtype.element_ty), mask=row_ok[:, None])
        lse = tl.where(l_i > 0, (m_i + tl.log2(safe)) * 0.6931471805599453, float("-inf"))
        tl.store(LSE + at * (KV * G) + head, lse, mask=row_ok)  # [T, H] contiguous


def _half(d: int) -> dict:
    return HALF_LAUNCH if d <= 128 else WIDE_LAUNCH


def _block_q(g_pad: int, dtype: torch.dtype, d: int) -> int:
    # about the launch's folded rows a tile (at least the 16 a matrix unit takes), fewer for float32's wider tiles
    rows = 32 if dtype == torch.float32 else _half(d)["rows"]
    return max(1, max(16, rows) // g_pad)


def _launch(dtype: torch.dtype, d: int) -> dict:
    if dtype == torch.float32:
        return {"BLOCK_N": BLOCK_N, "num_warps": 4, "num_stages": 1}
    launch = _half(d)
    return {"BLOCK_N": launch["block_n"], "num_warps": launch["warps"], "num_stages": launch["stages"]}


def varlen_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    cached: torch.Tensor,
    scaling: float,
    max_tokens: int,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    row_keys: torch.Tensor | None = None,
    document: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of packed rows over their pool slots, as `varlen_attention_reference` defines it: query
    [T, heads, d] -> (out [T, heads, d] in query.dtype, lse [T, heads] float32, natural log).

    `row_keys` [>= R, kv_heads, capacity, d]: row `r`'s keys already rotated at their positions (`rotate_rows`),
    read instead of rotating the slot's on load in every tile (queries are still rotated on load). The same result.

    `slots` [R], `starts` [R + 1] and `cached` [R] live on the device and are never read on the host;
    `max_tokens` bounds any row's tokens (the caller's bucket): a row's tokens past it, and tokens no row
    covers, are left unwritten. No host synchronisation and no allocation sized
    from device values: safe to capture in a CUDA graph."""
    check_varlen_inputs(query, keys, values, slots, starts, cached, cos, sin, key_positions)
    check_document(document, keys, slots)
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise KvpotError("varlen attention reads keys/values rows in place: their last dimension must be contiguous")
    if max_tokens < 1:
        raise KvpotError(f"max_tokens must be at least 1, got {max_tokens}")
    tokens, heads, d = query.shape
    kv = keys.shape[1]
    g = heads // kv
    out = torch.empty_like(query)
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=query.device)
    rows = slots.shape[0]
    if rows == 0 or tokens == 0:
        return out, lse
    if query.stride(-1) != 1:
        query = query.contiguous()
    g_pad = next_power_of_2(g)
    block_q = _block_q(g_pad, keys.dtype, d)
    tiles = triton.cdiv(max_tokens, block_q)
    rope = cos is not None
    if rope:
        if cos.stride(1) != 1 or sin.stride() != cos.stride():
            raise KvpotError("varlen attention wants cos/sin tables with contiguous rows and equal strides")
        tables = (cos, sin, key_positions)
        rope_strides = (*key_positions.stride(), cos.stride(0))
    else:
        tables, rope_strides = (keys, keys, slots), (0, 0, 0, 0)
    by_row = row_keys is not None
    if by_row and (row_keys.shape[1:] != keys.shape[1:] or row_keys.shape[0] < rows or row_keys.dtype != keys.dtype
                   or row_keys.stride(-1) != 1 or not rope):
        raise KvpotError(f"row_keys must be [>= {rows}, {', '.join(map(str, keys.shape[1:]))}] in {keys.dtype} with "
                         f"a contiguous last dimension, beside a RoPE table; got {tuple(row_keys.shape)}")
    source = row_keys if by_row else keys
    if document is not None:
        doc_keys, doc_values, doc_rows, doc_lengths = document
        if doc_keys.stride(-1) != 1 or doc_values.stride(-1) != 1:
            raise KvpotError("varlen attention reads a document's rows in place: their last dimension must be "
                             "contiguous")
        region = (doc_keys, doc_values, doc_rows, doc_lengths)
        region_strides = (*doc_keys.stride()[:3], *doc_values.stride()[:3], doc_rows.stride(0), doc_lengths.stride(0))
    else:
        region, region_strides = (keys, values, slots, slots), (0,) * 8
    _varlen_kernel[(rows * tiles, kv)](
        query, source, values, slots, starts, cached, *tables, out, lse, *region, keys.shape[2], tiles, scaling,
        query.stride(0), query.stride(1), *source.stride()[:3], *values.stride()[:3], *rope_strides,
        out.stride(0), out.stride(1), *region_strides,
        G=g, G_PAD=g_pad, KV=kv, ROPE=rope, HALF=d // 2, IEEE=keys.dtype == torch.float32, BLOCK_Q=block_q,
        KEYS_BY_ROW=by_row, PREFIX=UNMASKED_PREFIX, DOC=document is not None, **_launch(keys.dtype, d),
    )
    return out, lse


@triton.jit(do_not_specialize=["N"])
def _rotate_rows_kernel(
    K,  # [S, KV, N, D] pool keys, un-rotated
    KPOS,  # [S, KV, N] int RoPE position of each entry
    COS, SIN,  # [P, D] RoPE table
    SLOTS, STARTS, CACHED,  # [R], [R + 1], [R] as `varlen_attention`'s
    OUT,  # [>= R, KV, N, D]: row r's entries [0, cached[r] + its tokens) rotated
    DOC_ROWS, DOC_LENGTHS,  # [S] each slot's document row (-1: none), [D] each document's entries (DOC)
    N, stride_ks, stride_kh, stride_kn, stride_ps, stride_ph, stride_pn, stride_t, stride_or, stride_oh, stride_on,
    stride_dr, stride_dl,
    HALF: tl.constexpr, BLOCK_N: tl.constexpr, DOC: tl.constexpr = False,
):
    block, h, r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(CACHED + r).to(tl.int32) + (tl.load(STARTS + r + 1) - tl.load(STARTS + r)).to(tl.int32)
    slot = tl.load(SLOTS + r).to(tl.int64)
    begin = 0  # a slot reading a shared document: its first entries are the region's, which the kernel reads there
    if DOC:
        doc = tl.load(DOC_ROWS + slot * stride_dr).to(tl.int64)
        begin = tl.where(doc >= 0, tl.load(DOC_LENGTHS + tl.maximum(doc, 0) * stride_dl), 0).to(tl.int32)
    if begin + block * BLOCK_N < n:  # blocks past the row's entries end at once
        j = begin + block * BLOCK_N + tl.arange(0, BLOCK_N)
        live = (j < n) & (j < N)
        dh = tl.arange(0, HALF)
        k1, k2 = load_keys(K + slot * stride_ks + h * stride_kh, KPOS + slot * stride_ps + h * stride_ph, COS, SIN,
                           j, live, dh, stride_kn, stride_pn, stride_t, HALF, True)
        o_ptr = OUT + r.to(tl.int64) * stride_or + h * stride_oh + j[:, None].to(tl.int64) * stride_on + dh[None, :]
        tl.store(o_ptr, k1, mask=live[:, None])
        tl.store(o_ptr + HALF, k2, mask=live[:, None])


def rotate_rows(keys: torch.Tensor, key_positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                slots: torch.Tensor, starts: torch.Tensor, cached: torch.Tensor, out: torch.Tensor,
                document: tuple | None = None) -> None:
    """Each row's live keys (its slot's first `cached[r]` entries and its own tokens') rotated at their RoPE
    positions into `out[r]`, with the roundings `load_keys` applies on load, so `varlen_attention(row_keys=out)`
    gives what rotating on load gives. One pass a layer instead of one per tile that reads them. Bounds are read on
    the device and the grid is sized from the capacity: safe to capture in a CUDA graph.

    `document` (`varlen_attention`'s): a row whose slot reads a shared document has its first `n_doc` entries in the
    region, which the varlen kernel reads there; they are neither read nor written here (`out[r, :, :n_doc]` is left
    as it was). Rotating the slot's empty lanes too took 41 us a layer of a packed step reading 8 questions over a
    2,993-entry document on the 8B shape (an H100, records/shared-document-h100/, call15)."""
    kv, capacity, d = keys.shape[1:]
    if out.shape[1:] != keys.shape[1:] or out.shape[0] < slots.shape[0] or out.dtype != keys.dtype:
        raise KvpotError(f"rotate_rows writes [>= {slots.shape[0]}, {kv}, {capacity}, {d}] in {keys.dtype}; "
                         f"got {tuple(out.shape)} in {out.dtype}")
    check_document(document, keys, slots)
    doc_rows, doc_lengths = (slots, slots) if document is None else document[2:]
    block = 64
    _rotate_rows_kernel[(triton.cdiv(capacity, block), kv, slots.shape[0])](
        keys, key_positions, cos, sin, slots, starts, cached, out, doc_rows, doc_lengths, capacity, *keys.stride()[:3],
        *key_positions.stride(), cos.stride(0), *out.stride()[:3], doc_rows.stride(0), doc_lengths.stride(0),
        HALF=d // 2, BLOCK_N=block, DOC=document is not None,
    )
