"""Plain-PyTorch decode attention over two segments: a shared, read-only document and each row's private tail
(docs/design.md, *Shared documents*). The reference `kvpot.kernels.shared` must match, and the path on CPU.

Readers of one stored document keep its entries once, in a document row of the pool's shared region
(`kvpot.engine.documents`); each reader's slot holds what follows them. A row's entries keep the indices they
have when copied per reader: entries `[0, n_doc)` are the document's (read from the region), `[n_doc, length)`
the row's own (read from its slot). Each segment is attended on its own, giving an output and a log-sum-exp,
and the two are merged exactly: `out = (e^(lse_a - m) o_a + e^(lse_b - m) o_b) / (e^(lse_a - m) + e^(lse_b - m))`
with `m` the larger log-sum-exp, as prefill merges a cached prefix and a chunk. A row whose slot reads no
document (`doc_rows[slot] == -1`) has an empty first segment: the ordinary attention over its slot.
"""

from __future__ import annotations

import torch

from kvpot.kernels.decode_reference import (
    _rotate,
    _rotate_at,
    check_decode_batch_inputs,
    check_shared_inputs,
    document_span,
)

CHUNK_ELEMENTS = 1 << 21  # float32 elements of gathered keys per chunk of batch rows, per segment


def decode_attention_shared_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    doc_keys: torch.Tensor,
    doc_values: torch.Tensor,
    doc_rows: torch.Tensor,
    doc_lengths: torch.Tensor,
    scaling: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    doc_key_positions: torch.Tensor | None = None,
    query_positions: torch.Tensor | None = None,
    probs: torch.Tensor | None = None,
    doc_rotated: bool = False,
) -> torch.Tensor:
    """Attention [B, heads, d] (query.dtype) of each row's `query` [B, heads, d] over its document's entries
    `[0, n_doc)` in `doc_keys`/`doc_values` [D, kv_heads, capacity, d] (row `doc_rows[rows[b]]`, `n_doc` its
    `doc_lengths`) and its slot's entries `[n_doc, lengths[rows[b]])` in `keys`/`values` [S, kv_heads, capacity,
    d], merged by log-sum-exp, in float32. RoPE as `decode_attention_batch_reference`, the document's keys at
    `doc_key_positions` [D, kv_heads, capacity]. `probs` [B, kv_heads, capacity] receives each KV group's mean
    probabilities at the entries' indices (document entries below `n_doc`), 0 past the length. `doc_rotated`: the
    document's keys are stored rotated at their positions (only the queries are rotated here)."""
    check_decode_batch_inputs(query, keys, values, rows, lengths, cos, sin, key_positions, query_positions, probs,
                              kernel=False)
    check_shared_inputs(query, keys, doc_keys, doc_values, doc_rows, doc_lengths, doc_key_positions, cos, doc_rotated)
    batch, heads, d = query.shape
    kv, capacity = keys.shape[1:3]
    step = max(1, CHUNK_ELEMENTS // (kv * capacity * d))
    out = query.new_empty(batch, heads, d)
    for lo in range(0, batch, step):  # chunks sized from shapes alone: nothing read from the device
        part = slice(lo, lo + step)
        out[part] = _attend(query[part], keys, values, rows[part], lengths, doc_keys, doc_values, doc_rows,
                            doc_lengths, scaling, cos, sin, key_positions, doc_key_positions, query_positions,
                            None if probs is None else probs[part], doc_rotated)
    return out


def _segment_scores(q, keys, at, live, positions, cos, sin):
    """Scores [B, kv, g, capacity] of rotated queries `q` over `keys[at]`, -inf where not `live` [B, capacity]."""
    k = keys[at].float()  # [B, kv, capacity, d]
    if cos is not None:
        k = _rotate_at(k, cos, sin, torch.where(live[:, None], positions[at].long(), 0))
    scores = torch.einsum("bkgd,bknd->bkgn", q, k)
    return scores.masked_fill_(~live[:, None, None], float("-inf"))


def _attend(query, keys, values, rows, lengths, doc_keys, doc_values, doc_rows, doc_lengths, scaling, cos, sin,
            key_positions, doc_key_positions, query_positions, probs, doc_rotated=False):
    batch, heads, d = query.shape
    kv, capacity = keys.shape[1:3]
    device = keys.device
    rows = rows.to(device)
    doc_at, in_doc = document_span(rows, doc_rows, doc_lengths, capacity)
    in_tail = (torch.arange(capacity, device=device) < lengths.to(device)[rows][:, None]) & ~in_doc
    q = query.float().view(batch, kv, heads // kv, d)
    if cos is not None:
        cos, sin = cos.float(), sin.float()
        at = query_positions[rows].long().reshape(batch, -1).expand(batch, kv)
        q = _rotate(q, cos[at][:, :, None], sin[at][:, :, None])
    q = q * scaling
    a = _segment_scores(q, doc_keys, doc_at, in_doc, doc_key_positions, *((None, None) if doc_rotated else (cos, sin)))
    b = _segment_scores(q, keys, rows, in_tail, key_positions, cos, sin)
    lse_a, lse_b = torch.logsumexp(a, dim=-1), torch.logsumexp(b, dim=-1)  # [B, kv, g]; -inf: an empty segment
    o_a = _segment_output(a, lse_a, doc_values, doc_at, in_doc)
    o_b = _segment_output(b, lse_b, values, rows, in_tail)
    # the merge: each segment weighted by its share of the whole softmax's denominator
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, 0.0)  # both empty: weights 0, output 0 (as the kernels write)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    safe = torch.where(total > 0, total, 1.0)
    out = (o_a * w_a[..., None] + o_b * w_b[..., None]) / safe[..., None]
    if probs is not None:
        lse = m + torch.log(safe)  # the whole softmax's log-denominator
        p = torch.where(in_doc[:, None, None], torch.exp(a - lse[..., None]), torch.exp(b - lse[..., None]))
        live = (in_doc | in_tail)[:, None, None]
        probs.copy_(p.masked_fill_(~live | (total == 0)[..., None], 0.0).mean(2))
    return out.reshape(batch, heads, d).to(query.dtype)


def _segment_output(scores, lse, values, at, live):
    """The segment's own softmax-weighted values [B, kv, g, d] (zero for an empty segment)."""
    finite = torch.isfinite(lse)
    weights = torch.exp(scores - torch.where(finite, lse, 0.0)[..., None]).masked_fill_(~finite[..., None], 0.0)
    v = values[at].float().masked_fill_(~live[:, None, :, None], 0.0)
    return torch.einsum("bkgn,bknd->bkgd", weights, v)
