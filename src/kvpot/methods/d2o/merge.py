"""D2O's dynamic token merging (Sec. 4.2.2, eqs. 9-12): fold evicted entries into similar kept ones."""

from __future__ import annotations

import math

import torch

SELF_WEIGHT = math.e  # exp(cos(k, k)) = exp(1): a kept token's weight on itself (eq. 12)


def nearest_kept(evicted: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 9: for each evicted key, its most cosine-similar kept key, per head.

    evicted [b, h, e, d], kept [b, h, c, d] -> (similarity [b, h, e], index into kept [b, h, e]).
    The `[e, c]` similarities are computed in slices of evicted rows, at most `MAX_BLOCK_ELEMENTS`
    at a time: after a 128K-token prompt at ratio 0.2 the full matrix would be ~88 GB per layer.
    """
    from kvpot.attention import MAX_BLOCK_ELEMENTS

    b, h, e, _ = evicted.shape
    kept_n = torch.nn.functional.normalize(kept.float(), dim=-1)
    rows = max(1, MAX_BLOCK_ELEMENTS // max(1, b * h * kept.shape[2]))
    best = torch.empty(b, h, e, dtype=torch.float32, device=evicted.device)
    index = torch.empty(b, h, e, dtype=torch.long, device=evicted.device)
    for lo in range(0, e, rows):
        hi = min(e, lo + rows)
        piece = torch.nn.functional.normalize(evicted[:, :, lo:hi].float(), dim=-1)
        best[:, :, lo:hi], index[:, :, lo:hi] = torch.einsum("bhed,bhcd->bhec", piece, kept_n).max(dim=-1)
    return best, index


def weighted_merge(
    kept_k: torch.Tensor,  # [b, h, c, d]
    kept_v: torch.Tensor,  # [b, h, c, d]
    evicted_k: torch.Tensor,  # [b, h, e, d]
    evicted_v: torch.Tensor,  # [b, h, e, d]
    similarity: torch.Tensor,  # [b, h, e] each evicted entry's similarity to its nearest kept one
    target: torch.Tensor,  # [b, h, e] long, index of that kept entry
    merge: torch.Tensor,  # [b, h, e] bool, whether it passed the threshold
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eqs. 11-12: `k_c <- (e*k_c + sum_i exp(u_i) k_i) / (e + sum_i exp(u_i))` over the evicted
    entries i whose nearest kept entry is c and that are merged; the same weights for values.
    Kept entries that nothing merges into are unchanged (weight e/e = 1)."""
    weight = torch.where(merge, similarity.exp(), torch.zeros_like(similarity))  # [b, h, e]
    denominator = torch.full(kept_k.shape[:3], SELF_WEIGHT, dtype=torch.float32, device=kept_k.device)
    denominator.scatter_add_(2, target, weight)
    out = []
    for kept, evicted in ((kept_k, evicted_k), (kept_v, evicted_v)):
        total = kept.float() * SELF_WEIGHT
        index = target.unsqueeze(-1).expand(-1, -1, -1, kept.shape[-1])
        total.scatter_add_(2, index, evicted.float() * weight.unsqueeze(-1))
        out.append((total / denominator.unsqueeze(-1)).to(kept.dtype))
    return out[0], out[1]


def nearest_other(keys: torch.Tensor, drop: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`nearest_kept` for one evicted entry per head, the kept ones left in place: keys [b, h, n, d] (every
    entry), drop [b, h, 1] the evicted one, positions [b, h, n] their stream positions -> (similarity,
    index of the most similar other entry) [b, h, 1] each; among equal similarities the oldest, as
    `nearest_kept`'s first maximum over kept entries in stream order."""
    gone = keys.gather(2, drop.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
    unit = torch.nn.functional.normalize(keys.float(), dim=-1)
    piece = torch.nn.functional.normalize(gone.float(), dim=-1)
    similarity = torch.einsum("bhed,bhcd->bhec", piece, unit)[:, :, 0].scatter_(2, drop, float("-inf"))
    best = similarity.amax(dim=-1, keepdim=True)
    oldest = torch.where(similarity == best, positions, torch.iinfo(torch.long).max)
    return best, oldest.argmin(dim=-1, keepdim=True)


def merge_one(keys: torch.Tensor, values: torch.Tensor, drop: torch.Tensor, target: torch.Tensor,
              similarity: torch.Tensor, merge: torch.Tensor) -> None:
    """`weighted_merge` for one evicted entry per head, in place: keys/values [b, h, n, d] (every entry),
    entry `drop` [b, h, 1] folded into entry `target` [b, h, 1] where `merge` [b, h, 1], with eq. 12's
    weights and `weighted_merge`'s arithmetic. Its other kept entries come back from `(k * e) / e`,
    which is k itself in half precision (the error is far below half a unit); float32 entries are put
    through it as `weighted_merge` does."""
    weight = torch.where(merge, similarity.exp(), torch.zeros_like(similarity))  # [b, h, 1]
    denominator = torch.full_like(weight, SELF_WEIGHT).add_(weight).unsqueeze(-1)
    for buf in (keys, values):
        at = target.unsqueeze(-1).expand(-1, -1, -1, buf.shape[-1])
        gone = buf.gather(2, drop.unsqueeze(-1).expand(-1, -1, -1, buf.shape[-1])).float()
        total = buf.gather(2, at).float() * SELF_WEIGHT + gone * weight.unsqueeze(-1)
        merged = (total / denominator).to(buf.dtype)
        if buf.dtype == torch.float32:
            buf.copy_(buf * SELF_WEIGHT / torch.full_like(denominator, SELF_WEIGHT))
        buf.scatter_(2, at, merged)


def kernel_merges(keys: torch.Tensor) -> bool:
    """Whether `kvpot.kernels.replace.d2o_step` merges these keys: a device the kernels run on, and half
    precision (where it writes the target alone, `(k e) / e` being k)."""
    from kvpot import kernels

    return keys.dtype in (torch.float16, torch.bfloat16) and kernels.available(keys.device)
