"""Plain-PyTorch varlen attention over pool slots: the reference `kvpot.kernels.varlen` must match, and the path
used where Triton cannot run (CPU).

A mixed step (issue 43) packs rows of different query lengths into one forward: decoding rows of one token and
prompt chunks of many. Row `r` holds the packed tokens `[starts[r], starts[r + 1])` and reads pool slot
`slots[r]`, whose first `cached[r]` entries were there before this forward and whose next entries are the row's
own tokens (appended before attention). Its `i`-th token attends to the slot's entries `[0, cached[r] + i]`:
everything cached before, and its own chunk causally. A decoding row is the case of one token.

Keys are stored un-rotated with a RoPE position per entry and KV head (`shift`/`reset` policies), rotated here by
gathering the table's rows, and each token's query at its own entry's position (per KV head, as
`PotLayer.rotate_queries`); or already rotated (`absolute`, `cos=None`).
"""

from __future__ import annotations

import torch

from kvpot.errors import KvpotError
from kvpot.kernels.decode_reference import _rotate_at

INTS = (torch.int32, torch.int64)


def check_varlen_inputs(query, keys, values, slots, starts, cached, cos, sin, key_positions) -> None:
    """Shapes and dtypes shared by the kernel and the reference (shapes only: no device reads)."""
    if query.dim() != 3 or keys.dim() != 4 or values.shape != keys.shape:
        raise KvpotError(f"varlen attention needs query [tokens, heads, d] and keys/values [slots, kv_heads, "
                         f"capacity, d]; got {tuple(query.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}")
    heads, d = query.shape[1:]
    kv = keys.shape[1]
    if keys.shape[-1] != d or kv == 0 or heads % kv:
        raise KvpotError(f"{heads} query heads of dim {d} do not split into groups over keys {tuple(keys.shape)}")
    if slots.dim() != 1 or starts.shape != (slots.shape[0] + 1,) or cached.shape != slots.shape:
        raise KvpotError(f"varlen attention needs slots [rows], starts [rows + 1] and cached [rows]; got "
                         f"{tuple(slots.shape)}, {tuple(starts.shape)}, {tuple(cached.shape)}")
    if any(t.dtype not in INTS for t in (slots, starts, cached)):
        raise KvpotError("slots, starts and cached must be integer tensors")
    if (cos is None) != (sin is None) or (cos is not None and key_positions is None):
        raise KvpotError("varlen attention with a RoPE table needs cos, sin and key_positions")
    if cos is not None:
        if cos.dim() != 2 or cos.shape[1] != d or sin.shape != cos.shape:
            raise KvpotError(f"RoPE tables must be [positions, {d}]; got {tuple(cos.shape)}, {tuple(sin.shape)}")
        if tuple(key_positions.shape) != tuple(keys.shape[:3]):
            raise KvpotError(f"key_positions must be {list(keys.shape[:3])}; got {tuple(key_positions.shape)}")


def check_document(document: tuple | None, keys: torch.Tensor, slots: torch.Tensor) -> None:
    """A `document` argument's shapes: (doc_keys, doc_values [documents, kv_heads, capacity, d] as `keys` but the
    first dimension, doc_rows [slots] int, doc_lengths [documents] int)."""
    if document is None:
        return
    if len(document) != 4:
        raise KvpotError("document must be (doc_keys, doc_values, doc_rows, doc_lengths)")
    doc_keys, doc_values, doc_rows, doc_lengths = document
    if doc_keys.dim() != 4 or doc_keys.shape[1:] != keys.shape[1:] or doc_values.shape != doc_keys.shape \
            or doc_keys.dtype != keys.dtype:
        raise KvpotError(f"a document region must be [documents, {', '.join(map(str, keys.shape[1:]))}] in "
                         f"{keys.dtype}; got {tuple(doc_keys.shape)}, {tuple(doc_values.shape)} in {doc_keys.dtype}")
    if doc_rows.shape != (keys.shape[0],) or doc_lengths.shape != (doc_keys.shape[0],) \
            or doc_rows.dtype not in INTS or doc_lengths.dtype not in INTS:
        raise KvpotError(f"doc_rows must be [{keys.shape[0]}] (one per slot) and doc_lengths [{doc_keys.shape[0]}], "
                         f"integers; got {tuple(doc_rows.shape)}, {tuple(doc_lengths.shape)}")


def varlen_attention_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    cached: torch.Tensor,
    scaling: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    row_keys: torch.Tensor | None = None,
    document: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of packed rows over their pool slots: query [T, heads, d] (un-rotated when cos is given) ->
    (out [T, heads, d] in query.dtype, lse [T, heads] float32, natural log). Tokens no row covers get zeros and
    lse -inf. Reads the row bounds on the host (a reference: not for capture). `row_keys` (the kernel's keys
    rotated ahead, `rotate_rows`) is not read: the reference rotates the slot's keys itself, the same result.

    `document` (doc_keys, doc_values, doc_rows, doc_lengths): slots that read a shared document
    (`kvpot.engine.documents`): slot `s` with `doc_rows[s] >= 0` takes its first `doc_lengths[doc_rows[s]]` entries
    from that row of `doc_keys`/`doc_values` ([documents, kv_heads, capacity, d], keys stored rotated at their
    positions), not from its own slot; the rest as above."""
    check_varlen_inputs(query, keys, values, slots, starts, cached, cos, sin, key_positions)
    check_document(document, keys, slots)
    tokens, heads, d = query.shape
    g = heads // keys.shape[1]
    out = torch.zeros(tokens, heads, d, dtype=query.dtype, device=query.device)
    lse = torch.full((tokens, heads), float("-inf"), dtype=torch.float32, device=query.device)
    bounds, before, of_row = starts.tolist(), cached.tolist(), slots.tolist()
    for r, slot in enumerate(of_row):
        first, last = bounds[r], bounds[r + 1]
        q = last - first
        if q <= 0:
            continue
        n = before[r] + q
        if n > keys.shape[2]:
            raise KvpotError(f"row {r} reads {n} entries of a slot of capacity {keys.shape[2]}")
        k, v = keys[slot, :, :n], values[slot, :, :n]  # [kv, n, d]
        qs = query[first:last].transpose(0, 1)  # [heads, q, d]
        if cos is not None:
            k = _rotate_at(k.float(), cos.float(), sin.float(), key_positions[slot, :, :n]).to(keys.dtype)
            at = key_positions[slot, :, before[r] : n].repeat_interleave(g, dim=0)  # [heads, q]: their own entries'
            qs = _rotate_at(qs.float(), cos.float(), sin.float(), at)
        if document is not None and int(document[2][slot]) >= 0:  # the shared document's entries, from its row
            row = int(document[2][slot])
            n_doc = int(document[3][row])
            k = torch.cat([document[0][row, :, :n_doc], k[:, n_doc:]], dim=1)
            v = torch.cat([document[1][row, :, :n_doc], v[:, n_doc:]], dim=1)
        k = k.float().repeat_interleave(g, dim=0)
        v = v.float().repeat_interleave(g, dim=0)
        scores = (qs.float() * scaling) @ k.transpose(-1, -2)  # [heads, q, n]
        sees = before[r] + torch.arange(q, device=query.device)  # the last entry each token sees
        visible = torch.arange(n, device=query.device)[None, :] <= sees[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [heads, q]
        out[first:last] = (torch.exp(scores - row_lse[..., None]) @ v).transpose(0, 1).to(query.dtype)
        lse[first:last] = row_lse.transpose(0, 1)
    return out, lse
