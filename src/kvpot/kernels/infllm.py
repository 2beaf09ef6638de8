"""Triton kernel for InfLLM (Xiao et al. 2024): one decoding query over its three parts, in fixed shapes.

`kvpot.methods.infllm.decode.step_reference` is the reference this kernel must match
(tests/test_infllm_kernel.py). The keys one step reads form a virtual list of tiles of BLOCK_N lanes:
the initial tokens, each selected unit, the remainder (every one padded to whole tiles, so a tile
never mixes parts), then the window. A distant tile scores un-rotated keys against the query rotated
at the shared distant position; a window tile rotates its keys at their distance from the window's
start (the query at t - w0) and adds the query's q . k (summed over the group's heads) to each key's
representative score: every window key is in exactly one program, so the update needs no atomics.
Every count that grows with the length (window start, complete units, remainder) is derived from
the query's position `T` on the device, so a CUDA graph replays one launch at every length.
Programs split the list FlashDecoding-style, merged by `kvpot.kernels.common.merge`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpot.kernels.common import half_scores, merge, multiprocessors, next_power_of_2


@triton.jit(do_not_specialize=["N", "PER"])
def _step_kernel(
    Q,  # [KV, G, D] un-rotated query heads, by group
    K, V,  # [KV, N, D] un-rotated keys, values
    COS, SIN,  # [P, D] RoPE table (P > WIN)
    T,  # [1] int64 the query's position (its own key is at T)
    SEL,  # [TOPK] int64 selected units (valid below the complete count)
    SCORE,  # [KV, >= N] float32 representative scores (window keys get the query's share)
    OUT,  # [SPLITS, KV, G, D] float32 each split's normalised output
    LSE,  # [SPLITS, KV, G] float32 log2-sum-exp of each split's scores
    SLOT, KG, VG,  # the GPU cache (CACHED): slot per token (-1: host only), cached keys/values [KV, SLOTS, D]
    N, PER, scale,  # PER: tiles per split
    stride_qh, stride_qg, stride_kh, stride_kn, stride_vh, stride_vn, stride_t, stride_sh,
    stride_os, stride_oh, stride_gh, stride_gn,
    G: tl.constexpr, INIT: tl.constexpr, BS: tl.constexpr, TOPK: tl.constexpr, WIN: tl.constexpr,
    T_INIT: tl.constexpr, T_BS: tl.constexpr, T_WIN0: tl.constexpr, T_ALL: tl.constexpr,
    CACHED: tl.constexpr, HALF: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    h = tl.program_id(0)
    split = tl.program_id(1)
    dh = tl.arange(0, HALF)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < G
    lanes = tl.arange(0, BLOCK_N)
    t = tl.load(T)
    w0 = tl.maximum(t - WIN + 1, 0)
    n_init = tl.minimum(w0, INIT)
    units = tl.where(w0 > INIT, (w0 - INIT) // BS, 0)
    rest = INIT + units * BS

    q_ptr = Q + h * stride_qh + rows[:, None] * stride_qg + dh[None, :]
    q1 = tl.load(q_ptr, mask=row_ok[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(q_ptr + HALF, mask=row_ok[:, None], other=0.0).to(tl.float32)
    qk = scale * 1.4426950408889634  # scores in log2 units
    # distant part: the query at WIN, keys at 0 (their rotation is cos(0), the RoPE's scaling)
    c1 = tl.load(COS + WIN * stride_t + dh).to(tl.float32)[None, :]
    c2 = tl.load(COS + WIN * stride_t + HALF + dh).to(tl.float32)[None, :]
    s1 = tl.load(SIN + WIN * stride_t + dh).to(tl.float32)[None, :]
    s2 = tl.load(SIN + WIN * stride_t + HALF + dh).to(tl.float32)[None, :]
    z1 = tl.load(COS + dh).to(tl.float32)[None, :]
    z2 = tl.load(COS + HALF + dh).to(tl.float32)[None, :]
    f1 = ((q1 * c1 - q2 * s1) * z1 * qk).to(K.dtype.element_ty)
    f2 = ((q2 * c2 + q1 * s2) * z2 * qk).to(K.dtype.element_ty)
    # local part: the query at t - w0
    p = t - w0
    c1 = tl.load(COS + p * stride_t + dh).to(tl.float32)[None, :]
    c2 = tl.load(COS + p * stride_t + HALF + dh).to(tl.float32)[None, :]
    s1 = tl.load(SIN + p * stride_t + dh).to(tl.float32)[None, :]
    s2 = tl.load(SIN + p * stride_t + HALF + dh).to(tl.float32)[None, :]
    l1 = ((q1 * c1 - q2 * s1) * qk).to(K.dtype.element_ty)
    l2 = ((q2 * c2 + q1 * s2) * qk).to(K.dtype.element_ty)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a split with every key masked stays NaN-free
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc1 = tl.zeros([BLOCK_M, HALF], tl.float32)
    acc2 = tl.zeros([BLOCK_M, HALF], tl.float32)
    for step in range(0, PER):  # a runtime count from 0, the last split's tail masked (as kvpot.kernels.hip)
        tile = split * PER + step
        # which part the tile is in, and its keys, without branches: scalar selects only
        near = tile >= T_WIN0
        first = tile < T_INIT
        rest_tile = (tile >= T_INIT + TOPK * T_BS) & (tile < T_WIN0)
        j = tl.minimum(tl.maximum((tile - T_INIT) // T_BS, 0), tl.maximum(TOPK - 1, 0))
        unit = tl.load(SEL + j)
        o_unit = ((tile - T_INIT) % T_BS) * BLOCK_N + lanes
        o_near = (tile - T_WIN0) * BLOCK_N + lanes
        key_first = (tile * BLOCK_N + lanes).to(tl.int64)
        key_unit = (INIT + unit * BS + o_unit).to(tl.int64)
        key_rest = (rest + (tile - T_INIT - TOPK * T_BS) * BLOCK_N + lanes).to(tl.int64)
        key_near = (w0 + o_near).to(tl.int64)
        ok_far = tl.where(first, key_first < n_init,
                          tl.where(rest_tile, key_rest < w0, (o_unit < BS) & (unit < units)))
        key_far = tl.where(first, key_first, tl.where(rest_tile, key_rest, key_unit))
        ok = tl.where(near, (o_near < WIN) & (key_near <= t), ok_far)
        key = tl.where(near, key_near, key_far)
        ok = ok & (key >= 0) & (key < N) & (tile < T_ALL)
        key = tl.where(ok, key, 0)
        k1, k2 = _load_keys(K, KG, SLOT, key, ok, h, dh, stride_kh, stride_kn, stride_gh, stride_gn, CACHED, HALF)
        # window keys turn by their distance from the window's start; distant keys stay as they are
        turn = ok & near
        kt = tl.where(turn, o_near, 0)[:, None] * stride_t + dh[None, :]
        kc1 = tl.load(COS + kt, mask=turn[:, None], other=1.0).to(tl.float32)
        kc2 = tl.load(COS + kt + HALF, mask=turn[:, None], other=1.0).to(tl.float32)
        ks1 = tl.load(SIN + kt, mask=turn[:, None], other=0.0).to(tl.float32)
        ks2 = tl.load(SIN + kt + HALF, mask=turn[:, None], other=0.0).to(tl.float32)
        r1 = (k1 * kc1 - k2 * ks1).to(K.dtype.element_ty)
        r2 = (k2 * kc2 + k1 * ks2).to(K.dtype.element_ty)
        sc = half_scores(tl.where(near, l1, f1), tl.where(near, l2, f2), r1, r2, IEEE)
        share = tl.sum(tl.where(row_ok[:, None], sc, 0.0), axis=0) / qk  # the group's q . k per window key
        s_ptr = SCORE + h * stride_sh + key
        tl.store(s_ptr, tl.load(s_ptr, mask=turn, other=0.0) + share, mask=turn)
        sc = tl.where(row_ok[:, None] & ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp2(m_i - m_new)
        prob = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, axis=1)
        v1, v2 = _load_keys(V, VG, SLOT, key, ok, h, dh, stride_vh, stride_vn, stride_gh, stride_gn, CACHED, HALF)
        pv = prob.to(V.dtype.element_ty)
        if IEEE:
            acc1 = acc1 * alpha[:, None] + tl.dot(pv, v1.to(V.dtype.element_ty), input_precision="ieee")
            acc2 = acc2 * alpha[:, None] + tl.dot(pv, v2.to(V.dtype.element_ty), input_precision="ieee")
        else:
            acc1 = acc1 * alpha[:, None] + tl.dot(pv, v1.to(V.dtype.element_ty))
            acc2 = acc2 * alpha[:, None] + tl.dot(pv, v2.to(V.dtype.element_ty))
        m_i = m_new

    safe = tl.where(l_i > 0, l_i, 1.0)
    o_ptr = OUT + split * stride_os + h * stride_oh + rows[:, None] * HALF * 2 + dh[None, :]
    tl.store(o_ptr, acc1 / safe[:, None], mask=row_ok[:, None])
    tl.store(o_ptr + HALF, acc2 / safe[:, None], mask=row_ok[:, None])
    lse = tl.where(l_i > 0, m_i + tl.log2(safe), float("-inf"))
    tl.store(LSE + (split * tl.num_programs(0) + h) * G + rows, lse, mask=row_ok)


@triton.jit
def _load_keys(K, KG, SLOT, key, ok, h, dh, stride_kh, stride_kn, stride_gh, stride_gn, CACHED: tl.constexpr,
               HALF: tl.constexpr):
    """Rows `key` [BLOCK_N] of head h as two halves [BLOCK_N, HALF] float32: from the GPU cache where it
    holds them (CACHED), else from K (device or pinned host memory)."""
    if CACHED:
        slot = tl.load(SLOT + key, mask=ok, other=-1)
        on_gpu = ok & (slot >= 0)
        remote = ok & (slot < 0)
    else:
        remote = ok
    ptr = K + h * stride_kh + key[:, None] * stride_kn + dh[None, :]
    x1 = tl.load(ptr, mask=remote[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=remote[:, None], other=0.0).to(tl.float32)
    if CACHED:
        g_ptr = KG + h * stride_gh + slot[:, None] * stride_gn + dh[None, :]
        x1 += tl.load(g_ptr, mask=on_gpu[:, None], other=0.0).to(tl.float32)
        x2 += tl.load(g_ptr + HALF, mask=on_gpu[:, None], other=0.0).to(tl.float32)
    return x1, x2


def decode_step(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, score: torch.Tensor, t: torch.Tensor,
                selected: torch.Tensor, sizes, scaling: float, cos: torch.Tensor, sin: torch.Tensor,
                gpu_cache=None, splits: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """query [h, d] un-rotated at position t ([1] long, on the device); keys/values [kv, N, d] (pinned host
    memory with `gpu_cache`); score [kv, >= N] float32, the window's shares added in place; selected
    [topk] long; sizes: initial, window, block; cos/sin [P > window, d]. `splits` (programs per KV head)
    and `block_n` (lanes per tile) override the choices, for tests. Returns [h, d]."""
    h, d = query.shape
    kv, n, _ = keys.shape
    g = h // kv
    top = selected.numel()
    if block_n is None:  # a tile never spans two parts: narrow tiles when units are small
        block_n = max(16, min(64, next_power_of_2(sizes.block)))
    t_init = triton.cdiv(sizes.initial, block_n)
    t_bs = triton.cdiv(sizes.block, block_n)
    t_win0 = t_init + (top + 1) * t_bs
    t_all = t_win0 + triton.cdiv(sizes.window, block_n)
    if splits is None:  # enough programs to fill the GPU, a few tiles each
        splits = max(1, min(triton.cdiv(2 * multiprocessors(query.device), kv), triton.cdiv(t_all, 2)))
    per = triton.cdiv(t_all, splits)
    splits = triton.cdiv(t_all, per)
    q = query.reshape(kv, g, d)
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        keys, values = keys.contiguous(), values.contiguous()
    out = torch.empty(splits, kv, g, d, dtype=torch.float32, device=query.device)
    lse = torch.empty(splits, kv, g, dtype=torch.float32, device=query.device)
    sel = selected if top else torch.zeros(1, dtype=torch.long, device=query.device)
    if gpu_cache is not None:
        slot, kg, vg = gpu_cache.slot_of, gpu_cache.keys, gpu_cache.values
        gh, gn = kg.stride(0), kg.stride(1)
    else:
        slot, kg, vg, gh, gn = out, out, out, 0, 0  # unused
    _step_kernel[(kv, splits)](
        q, keys, values, cos, sin, t, sel, score, out, lse, slot, kg, vg, n, per, scaling,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), cos.stride(0),
        score.stride(0), out.stride(0), out.stride(1), gh, gn,
        G=g, INIT=sizes.initial, BS=sizes.block, TOPK=top, WIN=sizes.window, T_INIT=t_init, T_BS=t_bs,
        T_WIN0=t_win0, T_ALL=t_all, CACHED=gpu_cache is not None, HALF=d // 2, IEEE=query.dtype == torch.float32,
        BLOCK_M=max(16, next_power_of_2(g)), BLOCK_N=block_n, num_warps=4,
        **({"num_stages": 1} if query.dtype == torch.float32 else {}),  # float32 tiles outgrow shared memory
    )
    merged = torch.empty(kv * g, d, dtype=query.dtype, device=query.device)
    merge(out.view(splits, kv * g, d), lse.view(splits, kv * g), merged)
    return merged.view(h, d)
