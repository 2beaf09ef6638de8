"""InfLLM's attention of a chunk of queries: the distant part and the local part, merged.

A lookup chunk's queries attend to two key sets (Xiao et al. 2024, Sec. 3.1 and 3.3):
- the distant part: initial tokens, the looked-up units and the tokens between the last complete unit
  and the window, every one at the shared distant position (keys un-rotated, the queries rotated at
  the window size): no mask, every key precedes every query;
- the local part: the window, from the chunk's first query - window + 1 to each query, at true
  distances: causal, lower-right aligned.

Each part is an attention with its log-sum-exp, merged exactly (InfiniteHiP's split attention,
`kvpot.kernels.sdpa`): on CUDA in half precision both run on cuDNN's kernels (the distant part
with each group's heads folded into query rows, as a prefix without a mask); elsewhere a sliced
PyTorch softmax over both parts computes the same thing.
"""

from __future__ import annotations

import torch

from kvpot.kernels import sdpa

# float32 elements of one [lookups, heads, rows, keys] score block in the PyTorch path
MAX_ELEMENTS = 1 << 26


def two_part_attention(far_q: torch.Tensor, far_k: torch.Tensor, far_v: torch.Tensor, near_q: torch.Tensor,
                       near_k: torch.Tensor, near_v: torch.Tensor, scaling: float) -> torch.Tensor:
    """far_q/near_q [c, h, r, d] (rotated for each part), far_k/v [c, kv, f, d] (f may be 0),
    near_k/v [c, kv, w, d] rotated, w >= r (row i sees near keys up to w - r + i). Returns [c, h, r, d]."""
    if sdpa.split_ok(near_q.device, near_q.dtype, near_q.shape[-1]) and near_q.shape[2] > 1:
        out, lse = sdpa.split_attention(near_q, near_k, near_v, scaling)
        if far_k.shape[2] == 0:
            return out
        far_out, far_lse = sdpa.prefix_attention(far_q, far_k, far_v, scaling)
        return sdpa.merge(far_out, far_lse, out, lse)[0]
    return _reference(far_q, far_k, far_v, near_q, near_k, near_v, scaling)


def _reference(far_q, far_k, far_v, near_q, near_k, near_v, scaling) -> torch.Tensor:
    """One softmax over both parts in float32, query rows in slices below MAX_ELEMENTS scores."""
    c, h, r, d = near_q.shape
    kv, f, w = near_k.shape[1], far_k.shape[2], near_k.shape[2]
    g = h // kv
    rows = max(1, MAX_ELEMENTS // max(1, c * h * (f + w)))
    fk, fv = far_k.float().unsqueeze(2), far_v.float().unsqueeze(2)  # [c, kv, 1, f, d]
    nk, nv = near_k.float().unsqueeze(2), near_v.float().unsqueeze(2)
    out = torch.empty(c, h, r, d, dtype=near_q.dtype, device=near_q.device)
    for lo in range(0, r, rows):
        hi = min(r, lo + rows)
        fq = far_q[:, :, lo:hi].float().view(c, kv, g, hi - lo, d)
        nq = near_q[:, :, lo:hi].float().view(c, kv, g, hi - lo, d)
        far = fq @ fk.transpose(-1, -2) * scaling  # [c, kv, g, rows, f]
        near = nq @ nk.transpose(-1, -2) * scaling  # [c, kv, g, rows, w]
        row = torch.arange(lo, hi, device=near.device).view(-1, 1)
        near = near.masked_fill(torch.arange(w, device=near.device).view(1, -1) > w - r + row, float("-inf"))
        probs = torch.cat([far, near], dim=-1).softmax(-1)
        mixed = probs[..., :f] @ fv + probs[..., f:] @ nv  # [c, kv, g, rows, d]
        out[:, :, lo:hi] = mixed.view(c, h, hi - lo, d).to(out.dtype)
    return out
