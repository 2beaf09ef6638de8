"""One query over InfLLM's three parts in fixed shapes: a decoding step that a CUDA graph can replay.

Every size is fixed by the method (initial tokens, `topk` units of `block` tokens, a remainder of at
most `block` tokens, the `window`), and everything that depends on the length comes from the query's
position `t`, a device tensor: window start w0 = max(0, t - window + 1), initial tokens min(initial,
w0), complete units (w0 - initial) // block, the remainder from the last complete unit to w0. Keys
past those counts are masked, so one captured step serves every length.

`step_reference` is the PyTorch form (CPU, and any device without the kernel), `kvpot.kernels.infllm`
the Triton one; both add the query's q . k to the representative score of each window key (the
local part's scores before scaling: the work is already done there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpot.methods.infllm.memory import Rotate


@dataclass(frozen=True)
class Counts:
    """The step's counts as device tensors [1] (see the module docstring)."""

    t: torch.Tensor
    w0: torch.Tensor
    initial: torch.Tensor
    units: torch.Tensor
    rest: torch.Tensor  # first token of the remainder


def counts(t: torch.Tensor, initial: int, window: int, block: int) -> Counts:
    w0 = (t - window + 1).clamp(min=0)
    units = torch.div((w0 - initial).clamp(min=0), block, rounding_mode="floor")
    return Counts(t, w0, w0.clamp(max=initial), units, initial + units * block)


def read_set(c: Counts, selected: torch.Tensor, initial: int, window: int, block: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distant tokens [initial + topk * block + block] and the window's [window], each with its
    validity: initial, the selected units (valid when complete), the remainder; w0 .. w0 + window - 1."""
    device = selected.device
    lane = torch.arange(block, device=device)
    first = torch.arange(initial, device=device)
    units = (initial + selected.view(-1, 1) * block + lane).flatten()
    rest = c.rest + lane
    far = torch.cat([first, units, rest])
    far_ok = torch.cat([first < c.initial, (selected.view(-1, 1) < c.units).expand(-1, block).flatten(),
                        rest < c.w0])
    near = c.w0 + torch.arange(window, device=device)
    return far, far_ok, near, near <= c.t


def step_reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, score: torch.Tensor,
                   c: Counts, selected: torch.Tensor, sizes, scaling: float, rotate: Rotate,
                   far_turn: torch.Tensor) -> torch.Tensor:
    """query [h, d] un-rotated at position c.t; keys/values [kv, N, d] (N >= t + 1); score [kv, N]
    float32, updated in place; selected [topk] long. far_turn: the query rotated at the distant
    position, times the keys' rotation at 0 ([h, d]). Returns [h, d]."""
    kv, n, d = keys.shape
    h = query.shape[0]
    g = h // kv
    far, far_ok, near, near_ok = read_set(c, selected, sizes.initial, sizes.window, sizes.block)
    far_k, far_v = keys[:, far.clamp(max=n - 1)], values[:, far.clamp(max=n - 1)]
    index = near.clamp(max=n - 1)
    near_k = rotate(keys[:, index].float(), torch.arange(sizes.window, device=keys.device))
    near_q = rotate(query.float(), (c.t - c.w0).expand(h))  # [h, d], one position per row
    far_s = torch.einsum("kgd,kfd->kgf", far_turn.float().view(kv, g, d), far_k.float())
    near_s = torch.einsum("kgd,kwd->kgw", near_q.view(kv, g, d), near_k)
    share = near_s.sum(1).masked_fill(~near_ok, 0.0)  # [kv, window]: the query's share of each key's score
    score.scatter_add_(1, index.expand(kv, -1), share)
    logits = torch.cat([far_s, near_s], -1) * scaling
    logits = logits.masked_fill(~torch.cat([far_ok, near_ok]), float("-inf"))
    probs = logits.softmax(-1)
    f = far.numel()
    out = probs[..., :f] @ far_v.float() + probs[..., f:] @ values[:, index].float()  # [kv, g, d]
    return out.reshape(h, d).to(query.dtype)
