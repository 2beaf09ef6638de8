"""Plain-PyTorch decode attention over kvpot's bounded cache: the references `kvpot.kernels.decode`
must match, and the path used where Triton cannot run (CPU).

`decode_attention_reference`: one new token's query attends to the live entries `[0, length)` of a
cache laid out per KV head (`PotLayer.keys[0]` etc.). `decode_attention_batch_reference`: each of
B batch rows attends to the live entries of its slot in a pool `[slots, kv_heads, capacity, d]`,
all rows in batched einsums; it is written independently of the single-sequence one, so each
checks the other (tests/test_decode_batch_reference.py). Keys may be stored un-rotated with a
RoPE position per entry (the `shift`/`reset` policies) — they are rotated here by gathering the
table's rows — or already rotated (`absolute`, `cos=None`). Nothing here synchronises with the
device or sizes a tensor from a device value, so it can also be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from kvpot.kernels import supports_head_dim
from kvpot.errors import KvpotError

INTS = (torch.int32, torch.int64)
CHUNK_ELEMENTS = 1 << 21  # float32 elements of gathered keys per chunk of batch rows (8 MB)


def _check_heads(query, keys, values, kernel: bool) -> None:
    """query [..., heads, d] and keys/values [..., kv_heads, capacity, d] (the caller checks the ranks)."""
    heads, d = query.shape[-2:]
    kv, dk = keys.shape[-3], keys.shape[-1]
    if dk != d or values.shape != keys.shape:
        raise KvpotError(f"decode attention needs keys and values of head dim {d} with one capacity; got keys "
                         f"{tuple(keys.shape)}, values {tuple(values.shape)}")
    if kv == 0 or heads % kv:
        raise KvpotError(f"{heads} query heads do not split into groups over {kv} KV heads")
    if kernel and not supports_head_dim(d):  # the reference takes any head dim
        raise KvpotError(f"decode attention does not support head dim {d} (supported: 32, 64, 128, 256)")


def _check_rope(cos, sin, d: int, key_positions, query_position, positions_shape: tuple) -> bool:
    """The RoPE table and the key positions (the caller checks the query position's shape): whether RoPE is on."""
    if (cos is None) != (sin is None):
        raise KvpotError("decode attention needs both cos and sin, or neither")
    if cos is None:
        return False
    if key_positions is None or query_position is None:
        raise KvpotError("decode attention with a RoPE table needs key_positions and query_position")
    if cos.dim() != 2 or cos.shape[1] != d or sin.shape != cos.shape:
        raise KvpotError(f"RoPE tables must be [positions, {d}]; got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if tuple(key_positions.shape) != positions_shape:
        raise KvpotError(f"key_positions must be {list(positions_shape)}; got {tuple(key_positions.shape)}")
    return True


def _check_index(t: torch.Tensor, n: int, message: str) -> None:
    """An index tensor: [n] int32/int64, else `message` (`{n}` in it formatted then: a compiled step's check must not
    turn the batch's size into text, which would specialise the compilation on it) and what it got."""
    if tuple(t.shape) != (n,) or t.dtype not in INTS:
        raise KvpotError(f"{message.format(n=n)}; got {t.dtype} {tuple(t.shape)}")


def _check_probs(probs, shape: tuple) -> None:
    if probs is not None and (tuple(probs.shape) != shape or probs.dtype != torch.float32):
        raise KvpotError(f"probs must be a float32 {list(shape)} tensor; got {probs.dtype} {tuple(probs.shape)}")


def check_decode_inputs(query, keys, values, length, cos, sin, key_positions, query_position, probs,
                        kernel: bool = True) -> None:
    """Shape/dtype validation shared by the kernel and the reference (shapes only: no device reads)."""
    if query.dim() != 2 or keys.dim() != 3 or values.dim() != 3:
        raise KvpotError(f"decode attention wants query [heads, d] and keys/values [kv_heads, capacity, d]; "
                         f"got {tuple(query.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}")
    _check_heads(query, keys, values, kernel)
    kv, capacity, d = keys.shape
    if length.numel() != 1 or length.dtype not in INTS:
        raise KvpotError("decode attention's `length` must be a one-element int32/int64 tensor")
    if _check_rope(cos, sin, d, key_positions, query_position, (kv, capacity)):
        if query_position.dim() > 1 or query_position.numel() not in (1, kv):
            raise KvpotError(f"query_position must be a scalar or [{kv}]; got {tuple(query_position.shape)}")
    _check_probs(probs, (kv, capacity))


def check_decode_batch_inputs(query, keys, values, rows, lengths, cos, sin, key_positions, query_positions, probs,
                              kernel: bool = True) -> None:
    """`check_decode_inputs` for the batched entry points: B rows over a pool of S slots."""
    if query.dim() != 3 or keys.dim() != 4 or values.dim() != 4:
        raise KvpotError(f"batched decode attention wants query [batch, heads, d] and keys/values "
                         f"[slots, kv_heads, capacity, d]; got {tuple(query.shape)}, {tuple(keys.shape)}, "
                         f"{tuple(values.shape)}")
    _check_heads(query, keys, values, kernel)
    batch = query.shape[0]
    slots, kv, capacity, d = keys.shape
    _check_index(rows, batch, "batched decode attention's `rows` must be an int64 [{n}] tensor (one pool slot per "
                 "batch row)")
    _check_index(lengths, slots, "batched decode attention's `lengths` must be an int32/int64 [{n}] tensor (one live "
                 "count per slot)")
    if _check_rope(cos, sin, d, key_positions, query_positions, (slots, kv, capacity)):
        if tuple(query_positions.shape) not in ((slots,), (slots, kv)):
            raise KvpotError(f"query_positions must be [{slots}] or [{slots}, {kv}] (per slot, or per slot and KV "
                             f"head); got {tuple(query_positions.shape)}")
    _check_probs(probs, (batch, kv, capacity))


def check_shared_inputs(query, keys, doc_keys, doc_values, doc_rows, doc_lengths, doc_key_positions, cos,
                        doc_rotated: bool = False) -> None:
    """The document region's shapes against the pool's (the slot side is `check_decode_batch_inputs`')."""
    slots, kv, capacity, d = keys.shape
    if doc_keys.dim() != 4 or tuple(doc_keys.shape[1:]) != (kv, capacity, d) or doc_values.shape != doc_keys.shape:
        raise KvpotError(f"the document region must be [documents, {kv}, {capacity}, {d}] like the pool's slots; got "
                         f"keys {tuple(doc_keys.shape)}, values {tuple(doc_values.shape)}")
    docs = doc_keys.shape[0]
    _check_index(doc_rows, slots, "doc_rows must be an int64 [{n}] tensor (each slot's document row, -1: none)")
    _check_index(doc_lengths, docs, "doc_lengths must be an int64 [{n}] tensor")
    positions_ok = doc_key_positions is not None and tuple(doc_key_positions.shape) == (docs, kv, capacity)
    if cos is not None and not doc_rotated and not positions_ok:
        raise KvpotError(f"with a RoPE table, doc_key_positions must be [{docs}, {kv}, {capacity}]")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _rotate_at(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """`_rotate(x, cos[at], sin[at])` with three temporaries of x's size instead of seven: on CPU a
    batch's keys are large, and every fresh buffer of that size costs page faults."""
    half = x.shape[-1] // 2
    c, s = cos[at], sin[at]
    out = x * c
    out[..., :half].addcmul_(x[..., half:], s[..., :half], value=-1)  # rotate_half: (-x2, x1)
    out[..., half:].addcmul_(x[..., :half], s[..., half:])
    return out


def decode_attention_reference(
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
    """Attention [heads, dv] (query.dtype) of `query` [heads, d] over entries `[0, length)` of
    `keys`/`values` [kv_heads, capacity, d], in float32. With cos/sin [P, d], keys are rotated at
    `key_positions` [kv_heads, capacity] and the query at `query_position` ([] or [kv_heads]);
    without, both are taken as already rotated. `probs` [kv_heads, capacity] float32, when given,
    receives each KV group's mean attention probabilities (0 past `length`). `num_splits` is the
    kernel's tuning knob and is ignored here, as is `split_entries` (the kernel's fixed split size)."""
    del num_splits, split_entries
    check_decode_inputs(query, keys, values, length, cos, sin, key_positions, query_position, probs, kernel=False)
    heads, d = query.shape
    kv, capacity, _ = keys.shape
    live = torch.arange(capacity, device=keys.device) < length.to(keys.device)  # [capacity]
    # entries past `length` hold whatever was there (NaN, stale positions): zero them, never read them
    q = query.float().view(kv, heads // kv, d)
    k = keys.float().masked_fill(~live[:, None], 0.0)
    if cos is not None:
        table_cos, table_sin = cos.float(), sin.float()
        at = torch.where(live, key_positions.long(), 0)
        k = _rotate(k, table_cos[at], table_sin[at])
        at = query_position.long().reshape(-1).expand(kv)  # [kv]
        q = _rotate(q, table_cos[at][:, None], table_sin[at][:, None])
    scores = torch.einsum("kgd,knd->kgn", q, k) * scaling
    weights = torch.softmax(scores.masked_fill(~live, float("-inf")), dim=-1)  # [kv, g, capacity]
    if probs is not None:
        probs.copy_(weights.mean(1))
    out = torch.einsum("kgn,knd->kgd", weights, values.float().masked_fill(~live[:, None], 0.0))
    return out.reshape(heads, d).to(query.dtype)


def decode_attention_batch_reference(
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
    entries `[0, lengths[rows[b]])` of its pool slot in `keys`/`values` [S, kv_heads, capacity, d], in
    float32 — `kvpot.kernels.decode.decode_attention_batch`'s reference and its path on CPU. Rows
    may share a slot; a slot with no live entry gives an all-zero row (and all-zero probs). With
    cos/sin [P, d], keys are rotated at `key_positions` [S, kv_heads, capacity] and each row's query
    at its slot's `query_positions` ([S] or [S, kv_heads]); without, both are taken as already
    rotated. `probs` [B, kv_heads, capacity] float32, when given, receives per row each KV group's
    mean attention probabilities (0 past the length). `num_splits` and `split_entries` are ignored here. Rows
    go through batched einsums, in chunks sized from the shapes alone.

    `documents` (doc_keys, doc_values, doc_key_positions, doc_rows, doc_lengths): a shared document region
    (`kvpot.engine.documents`) laid out as the slots, keys un-rotated as a slot's. A slot `s` with `doc_rows[s] >= 0`
    reads its entries `[0, doc_lengths[doc_rows[s]])` from that row of the region and the rest from itself, as if
    the document were copied into it (batch-invariant sharing)."""
    del num_splits, split_entries
    check_decode_batch_inputs(query, keys, values, rows, lengths, cos, sin, key_positions, query_positions, probs,
                              kernel=False)
    if documents is not None:
        check_shared_inputs(query, keys, *documents[:2], *documents[3:], documents[2], cos)
        keys, values, key_positions, rows, lengths, query_positions = _joined(
            keys, values, key_positions, rows, lengths, query_positions, *documents)
    batch, heads, d = query.shape
    kv, capacity = keys.shape[1:3]
    # rows go in chunks whose gathered slots stay near CHUNK_ELEMENTS (one chunk for most batches): on
    # CPU, every buffer past glibc's mmap threshold is a fresh mapping that faults in page by page,
    # which made one big gather slower than a loop over the rows
    step = max(1, CHUNK_ELEMENTS // (kv * capacity * d))
    if batch <= step:
        return _attend_rows(query, keys, values, rows, lengths, scaling, cos, sin, key_positions, query_positions,
                            probs)
    out = query.new_empty(batch, heads, d)
    for lo in range(0, batch, step):
        part = slice(lo, lo + step)
        out[part] = _attend_rows(query[part], keys, values, rows[part], lengths, scaling, cos, sin, key_positions,
                                 query_positions, None if probs is None else probs[part])
    return out


def _attend_rows(query, keys, values, rows, lengths, scaling, cos, sin, key_positions, query_positions, probs):
    """`decode_attention_batch_reference` on checked inputs, every row at once."""
    batch, heads, d = query.shape
    kv, capacity = keys.shape[1:3]
    rows = rows.to(keys.device)
    live = torch.arange(capacity, device=keys.device) < lengths.to(keys.device)[rows][:, None]  # [B, capacity]
    dead = ~live[:, None, None]  # [B, 1, 1, capacity], against scores [B, kv, g, capacity]
    q = query.float().view(batch, kv, heads // kv, d)
    # each row's slot, gathered; entries past the length hold whatever was there (NaN, stale positions):
    # their scores are overwritten below and their values zeroed, so they never reach a live result
    k = keys[rows].float()  # [B, kv, capacity, d]
    if cos is not None:
        table_cos, table_sin = cos.float(), sin.float()
        k = _rotate_at(k, table_cos, table_sin, torch.where(live[:, None], key_positions[rows].long(), 0))
        at = query_positions[rows].long().reshape(batch, -1).expand(batch, kv)  # [B, kv]
        q = _rotate(q, table_cos[at][:, :, None], table_sin[at][:, :, None])
    scores = torch.einsum("bkgd,bknd->bkgn", q, k).mul_(scaling).masked_fill_(dead, float("-inf"))
    # a slot with no live entry softmaxes a row of -inf (NaN): zero it, as the kernel writes zeros
    weights = torch.softmax(scores, dim=-1).masked_fill_(dead, 0.0)
    if probs is not None:
        probs.copy_(weights.mean(2))
    v = values[rows].float().masked_fill_(~live[:, None, :, None], 0.0)
    return torch.einsum("bkgn,bknd->bkgd", weights, v).reshape(batch, heads, d).to(query.dtype)


def document_span(rows, doc_rows, doc_lengths, capacity: int):
    """Per batch row (`rows`, on the slots' device): its document's row (clamped to 0 where it has none) and which
    of its `capacity` entries are the document's, `[0, n_doc)` [B, capacity] (none without a document)."""
    doc = doc_rows.to(rows.device)[rows]
    at = doc.clamp(min=0)
    n_doc = torch.where(doc >= 0, doc_lengths.to(rows.device)[at], 0)
    return at, torch.arange(capacity, device=rows.device) < n_doc[:, None]


def _joined(keys, values, key_positions, rows, lengths, query_positions, doc_keys, doc_values, doc_positions,
            doc_rows, doc_lengths):
    """Each batch row's slot with its document's entries in place: buffers [B, ...] read by rows 0..B-1."""
    rows = rows.to(keys.device)
    at, in_doc = document_span(rows, doc_rows, doc_lengths, keys.shape[2])
    keys = torch.where(in_doc[:, None, :, None], doc_keys[at], keys[rows])
    values = torch.where(in_doc[:, None, :, None], doc_values[at], values[rows])
    if key_positions is not None:
        key_positions = torch.where(in_doc[:, None], doc_positions[at], key_positions[rows])
    if query_positions is not None:
        query_positions = query_positions[rows]
    order = torch.arange(rows.shape[0], device=keys.device)
    return keys, values, key_positions, order, lengths.to(keys.device)[rows], query_positions
