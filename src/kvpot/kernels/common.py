"""Pieces shared by kvpot's Triton kernels: a block of keys loaded (and rotated on load), its scores, the
split-K merge and the device's multiprocessor count.

Split-K attention (FlashDecoding) has each program write a normalised partial output and the
log2-sum-exp of its scores; `merge` combines the partials of each row. Scores are in log2 units
throughout (queries are pre-scaled by log2(e)), so `exp2` is the only exponential.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def load_keys(K, KPOS, COS, SIN, j, live, dh, stride_kn, stride_pn, stride_t, HALF: tl.constexpr,
              ROPE: tl.constexpr):
    """Keys `j` [BLOCK_N] of one KV head's row (`K`, `KPOS` offset to it) as two halves [BLOCK_N, HALF], rotated
    on load at their RoPE positions when ROPE (in float32, then back to the keys' dtype), zero where not `live`."""
    k_ptr = K + j[:, None] * stride_kn + dh[None, :]
    k1 = tl.load(k_ptr, mask=live[:, None], other=0.0)
    k2 = tl.load(k_ptr + HALF, mask=live[:, None], other=0.0)
    if ROPE:
        pos = tl.load(KPOS + j * stride_pn, mask=live, other=0)
        kt = pos[:, None] * stride_t + dh[None, :]
        kc1 = tl.load(COS + kt, mask=live[:, None], other=0.0).to(tl.float32)
        kc2 = tl.load(COS + kt + HALF, mask=live[:, None], other=0.0).to(tl.float32)
        ks1 = tl.load(SIN + kt, mask=live[:, None], other=0.0).to(tl.float32)
        ks2 = tl.load(SIN + kt + HALF, mask=live[:, None], other=0.0).to(tl.float32)
        a, c = k1.to(tl.float32), k2.to(tl.float32)
        k1 = (a * kc1 - c * ks1).to(K.dtype.element_ty)  # rotate_half: (-x2, x1)
        k2 = (c * kc2 + a * ks2).to(K.dtype.element_ty)
    return k1, k2


@triton.jit
def load_query(q_ptr, KPOS, COS, SIN, entry, ok, dh, stride_pn, stride_t, HALF: tl.constexpr, ROPE: tl.constexpr):
    """Queries at `q_ptr` ([rows, HALF] pointers to their first halves) as two float32 halves, zero where not `ok`,
    rotated when ROPE at the RoPE position of their own entry `entry` [rows] (`KPOS` offset to the slot's head)."""
    q1 = tl.load(q_ptr, mask=ok[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(q_ptr + HALF, mask=ok[:, None], other=0.0).to(tl.float32)
    if ROPE:
        qt = tl.load(KPOS + entry * stride_pn, mask=ok, other=0)[:, None] * stride_t + dh[None, :]
        c1 = tl.load(COS + qt, mask=ok[:, None], other=0.0).to(tl.float32)
        c2 = tl.load(COS + qt + HALF, mask=ok[:, None], other=0.0).to(tl.float32)
        s1 = tl.load(SIN + qt, mask=ok[:, None], other=0.0).to(tl.float32)
        s2 = tl.load(SIN + qt + HALF, mask=ok[:, None], other=0.0).to(tl.float32)
        q1, q2 = q1 * c1 - q2 * s1, q2 * c2 + q1 * s2  # rotate_half: (-x2, x1)
    return q1, q2


@triton.jit
def half_scores(q1, q2, k1, k2, IEEE: tl.constexpr):
    """Scores [BLOCK_M, BLOCK_N] of queries and keys held as two halves (float32 products exact under IEEE)."""
    if IEEE:
        return tl.dot(q1, tl.trans(k1), input_precision="ieee") + tl.dot(q2, tl.trans(k2), input_precision="ieee")
    return tl.dot(q1, tl.trans(k1)) + tl.dot(q2, tl.trans(k2))


@triton.jit
def online_softmax_step(sc, m_i, l_i, acc, V, j, live, dd, stride_vn, IEEE: tl.constexpr):
    """One block of keys into a running softmax-weighted sum (FlashAttention's update): scores `sc`
    [BLOCK_M, BLOCK_N] in log2 units (-inf where masked), the block's values read from `V` at entries `j`
    (`live` ones), the running max `m_i`, sum `l_i` and unnormalised output `acc`; returns the three updated."""
    v = tl.load(V + j[:, None] * stride_vn + dd[None, :], mask=live[:, None], other=0.0)
    return softmax_update(sc, m_i, l_i, acc, v, IEEE)


@triton.jit
def softmax_update(sc, m_i, l_i, acc, v, IEEE: tl.constexpr):
    """`online_softmax_step` with the block's values `v` [BLOCK_N, D] loaded by the caller (zero where masked):
    a kernel that reads one block's entries from two buffers (`kvpot.kernels.decode`'s shared documents)."""
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["ROWS", "SPLITS"])  # ROWS: batch rows x heads, varies with the batch
def _merge_kernel(
    PART,  # [SPLITS, ROWS, D] float32 normalised partial outputs
    LSE,  # [SPLITS, ROWS] float32 log2-sum-exp of each split's scores (-inf: the split saw no key)
    OUT,  # [ROWS, D] output dtype
    LSE_OUT,  # [ROWS] float32 merged log2-sum-exp (written when WRITE_LSE)
    ROWS, SPLITS,
    D: tl.constexpr, CHUNK: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    # Splits go through in chunks of a fixed size, in order, for both the sums: a row's result then does not
    # depend on how many empty splits follow its last live one (batch-invariant decoding: a slot's capacity
    # sets the split count), and all the partials at once (up to 2 x 132 splits x 128 floats) would spill.
    row = tl.program_id(0).to(tl.int64)
    dd = tl.arange(0, D)
    top = tl.full([CHUNK], float("-inf"), tl.float32)
    for s0 in range(0, SPLITS, CHUNK):
        sc = (s0 + tl.arange(0, CHUNK)).to(tl.int64)
        top = tl.maximum(top, tl.load(LSE + sc * ROWS + row, mask=sc < SPLITS, other=float("-inf")))
    top = tl.max(top, axis=0)  # a maximum is exact in any order
    top = tl.where(top == float("-inf"), 0.0, top)
    total = 0.0
    acc = tl.zeros([D], tl.float32)
    for s0 in range(0, SPLITS, CHUNK):
        sc = (s0 + tl.arange(0, CHUNK)).to(tl.int64)  # int64: splits x rows x D can pass 2**31
        ok = sc < SPLITS
        w = tl.exp2(tl.load(LSE + sc * ROWS + row, mask=ok, other=float("-inf")) - top)
        part = tl.load(PART + (sc[:, None] * ROWS + row) * D + dd[None, :], mask=ok[:, None], other=0.0)
        total += tl.sum(w, axis=0)
        acc += tl.sum(part * w[:, None], axis=0)
    tl.store(OUT + row * D + dd, (acc / tl.where(total > 0, total, 1.0)).to(OUT.dtype.element_ty))
    if WRITE_LSE:
        tl.store(LSE_OUT + row, tl.where(total > 0, top + tl.log2(total), float("-inf")))


def next_power_of_2(n) -> int:
    """`triton.next_power_of_2`, also for the symbolic sizes of `torch.compile(dynamic=True)` (kvpot's
    compiled step). Triton's bit twiddling on a symbol grows into nested expressions that the compiler
    never finished simplifying (on an H100 the compiled step of the 4-layer `tiny` shape did not finish
    tracing in 60 s); comparisons instead give a constant under guards (`n <= p`), so a launch's tile
    and split sizes stay plain numbers."""
    if not torch.compiler.is_compiling():  # (a symbolic size passes for an int inside the compiler)
        return triton.next_power_of_2(n)
    power = 1
    while power < n:
        power *= 2
    return power


def merge(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, lse_out: torch.Tensor | None = None) -> None:
    """Write into `out` [rows, d] the softmax-weighted sum of the partials `part` [splits, rows, d]
    (contiguous, float32) with log2-sum-exps `lse` [splits, rows]; with `lse_out` [rows], also the
    merged log2-sum-exp of each row. One launch, no host synchronisation."""
    splits, rows, d = part.shape
    _merge_kernel[(rows,)](part, lse, out, part if lse_out is None else lse_out, rows, splits, D=d,
                           CHUNK=16, WRITE_LSE=lse_out is not None)


def multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # Triton's interpreter has none; a nominal few so that splitting runs in tests
    return torch.cuda.get_device_properties(device).multi_processor_count
