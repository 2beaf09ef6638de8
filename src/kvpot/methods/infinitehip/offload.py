"""KV offloading for InfiniteHiP: the full cache in pinned host memory, a fixed GPU cache in front.

InfiniteHiP (Lee et al. 2025, Sec. 5 "KV cache offloading") keeps the KV cache in host memory and
a GPU-resident cache of recently used entries, so GPU memory is bounded by weights + GPU cache +
activations whatever the context. kvpot's reading:

- Every kernel can read pinned host memory directly (it is mapped into the GPU's address space), so
  a key that is not in the GPU cache is simply read over the bus: correctness never depends on the
  cache, which only decides how many reads stay on the GPU.
- The stage scan reads a few representative keys per chunk and reads them from host memory (the
  paper's unified-memory path); the final attention, which reads every selected key and value,
  goes through the GPU cache.
- After a decoding step that made a new selection, the keys the attention used are brought into
  the cache, evicting the least recently used slots; between refreshes only the newest key is new,
  so only it is brought in. Hits are counted on the device (no host synchronisation).
  Prefill reads through the cache without updating it (each query block of a chunk uses a
  different set, and the chunk's own keys are read once).

A layer's GPU footprint is `2 * gpu_cache_tokens * kv_heads * head_dim` values plus 4 bytes per
context token for the slot table (1M tokens: 4 MB per layer).
"""

from __future__ import annotations

import torch

from kvpot.errors import KvpotError
from kvpot.methods.infinitehip.fixed import stage_sizes


class GpuKvCache:
    """One layer's GPU cache: `slots` rows of keys/values [kv, slots, d] and the maps between slots
    and tokens, updated least-recently-used after each decoding step."""

    def __init__(self, slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.slots = slots
        self.keys = torch.zeros(kv_heads, slots, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        # slot bookkeeping with one extra "trash" entry at the end, so masked updates need no branches
        self.token_of = torch.full((slots + 1,), -1, dtype=torch.long, device=device)
        self.stamp = torch.full((slots + 1,), -1, dtype=torch.long, device=device)
        self.stamp[slots] = torch.iinfo(torch.long).max  # the trash slot is never a victim
        self.slot_of = torch.full((1,), -1, dtype=torch.int32, device=device)  # [tokens + 1], last = trash
        self.hits = torch.zeros((), dtype=torch.long, device=device)
        self.used = torch.zeros((), dtype=torch.long, device=device)
        self.set_size = torch.zeros((), dtype=torch.long, device=device)  # keys the last step read
        # the LRU clock on the device: a captured step advances it (a host int would be baked into the graph)
        self.tick = torch.zeros((), dtype=torch.long, device=device)

    @property
    def row_bytes(self) -> int:
        """Bytes of one entry's key and value, over the layer's KV heads."""
        return 2 * self.keys.shape[0] * self.keys.shape[2] * self.keys.element_size()

    def clone(self) -> GpuKvCache:
        twin = object.__new__(GpuKvCache)
        twin.__dict__ = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()}
        return twin

    def ensure(self, tokens: int) -> None:
        """Grow the slot table to cover `tokens` context entries (plus its trash entry)."""
        have = self.slot_of.numel() - 1
        if tokens <= have:
            return
        size = max(tokens, have + max(have // 8, 4096))
        grown = torch.full((size + 1,), -1, dtype=torch.int32, device=self.slot_of.device)
        grown[:have] = self.slot_of[:have]  # the old trash entry becomes a real token: left at -1
        self.slot_of = grown

    def touch(self, tokens: torch.Tensor, valid: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Record that a step read `tokens` [L] (where `valid`), then cache the ones that missed.

        Hits get this step's stamp; each miss takes the slot of one of the L least recently used
        entries (at least `slots >= 2 L`, so no slot hit in this step is a victim) and its key and
        value are copied from host memory. Everything stays on the device.
        """
        length = tokens.numel()
        if 2 * length > self.slots:
            raise KvpotError(f"infinitehip: gpu_cache_tokens={self.slots} is too small for a step that reads "
                             f"{length} keys (needs at least {2 * length}).")
        trash_token = self.slot_of.numel() - 1
        tokens = torch.where(valid, tokens, trash_token)
        slot = self.slot_of[tokens].long()  # [L]
        hit = valid & (slot >= 0)
        self.hits += hit.sum()
        self.set_size.copy_(valid.sum())  # in place: a captured step's graph keeps writing this tensor
        self.used += self.set_size
        self._admit(tokens, valid, slot, hit, keys, values)

    def touch_newest(self, token: int | torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     fused: bool | None = None) -> None:
        """A step whose selection did not change reads the last step's keys, all cached by then (no
        victim is ever in the read set while it holds at most half the slots), plus the newest key
        (`token`: an int, or [1] long on the device in a fixed-shape step): count that, and cache the
        newest key: no top-k over the whole read set. `fused` (default: where the Triton kernels run)
        does it in one launch (`kvpot.kernels.hip.admit_newest`), else in PyTorch operations."""
        from kvpot import kernels

        if fused is None:
            fused = (kernels.available(self.stamp.device) and kernels.supports_head_dim(self.keys.shape[-1])
                     and keys.stride() == values.stride() and keys.stride(-1) == 1)
        if fused:
            from kvpot.kernels.hip import admit_newest

            if not isinstance(token, torch.Tensor):
                token = torch.full((1,), token, dtype=torch.long, device=self.stamp.device)
            admit_newest(keys, values, self, token.view(1).to(torch.long))
            return
        self.set_size += 1
        self.used += self.set_size
        self.hits += self.set_size - 1
        if isinstance(token, torch.Tensor):
            tokens = token.view(1).to(torch.long)
        else:
            tokens = torch.full((1,), token, dtype=torch.long, device=self.stamp.device)
        slot = self.slot_of[tokens].long()
        valid = torch.ones(1, dtype=torch.bool, device=self.stamp.device)
        self._admit(tokens, valid, slot, valid & (slot >= 0), keys, values)

    def _admit(self, tokens: torch.Tensor, valid: torch.Tensor, slot: torch.Tensor, hit: torch.Tensor,
               keys: torch.Tensor, values: torch.Tensor) -> None:
        """Stamp the hits and give each miss the slot of one of the least recently used entries."""
        from kvpot.kernels.hip import fetch

        length = tokens.numel()
        trash_token = self.slot_of.numel() - 1
        self.tick += 1
        # (index_put_ of the device clock, fill_ of constants: no host value, CUDA-graph capturable)
        self.stamp.index_put_((torch.where(hit, slot, self.slots),), self.tick)
        miss = valid & ~hit
        if length == 1:  # the newest key alone (most steps): one reduction, not a top-k
            victims = self.stamp[: self.slots].argmin().view(1)
        else:
            victims = torch.topk(self.stamp[: self.slots], length, largest=False).indices  # [L] oldest first
        rank = (miss.cumsum(0) - 1).clamp(min=0)
        target = torch.where(miss, victims[rank], self.slots)  # [L] slot per miss, trash otherwise
        old = self.token_of[target]
        self.slot_of.index_fill_(0, torch.where(miss & (old >= 0), old, trash_token), -1)  # evicted: host only
        self.slot_of[torch.where(miss, tokens, trash_token)] = target.to(torch.int32)
        self.slot_of[trash_token:].fill_(-1)
        self.token_of[target] = torch.where(miss, tokens, -1)
        self.token_of[self.slots:].fill_(-1)
        self.stamp.index_put_((target,), self.tick)
        self.stamp[self.slots:].fill_(torch.iinfo(torch.long).max)
        fetch(keys, values, self.keys, self.values, tokens, torch.where(miss, target, -1))


def probes(chunk: int) -> int:
    """Keys one candidate range of `chunk` keys reads in a stage scan: 2 ceil(log2(chunk)) probes
    (Algorithm 3's halvings) and the representative's score."""
    return 2 * max(0, (chunk - 1).bit_length()) + 1


def scan_bytes(plan, masks, keys: torch.Tensor) -> int:
    """Bytes the stage scans of a decoding step read from host memory (`keys` [kv, n, d] there): each
    candidate range of a recomputed stage costs `probes(chunk)` reads of one key of every KV head;
    requested, not measured on the bus (a repeated read may hit the GPU's L2)."""
    kv, n, d = keys.shape
    row = kv * d * keys.element_size()
    total = 0
    for i in masks.recomputed[-1]:
        chunk = plan.stages[i].chunk
        if i == 0:
            span = max(masks.stages[0].window_starts[0] - plan.sink, 0)
            candidates = max(1, -(-span // chunk))
        else:
            candidates = masks.stages[i - 1].starts.shape[-1] * (plan.stages[i - 1].chunk // chunk)
        total += candidates * probes(chunk) * row
    return total


def fixed_scan_bytes(plan, last_keep: int, due: tuple[bool, ...], position: int, row: int) -> int:
    """`scan_bytes` of a fixed-shape decoding step at `position`, from host counts: the ranges the eager
    step would scan (the fixed step's padding ranges are empty and read nothing). `row`: bytes of one
    key of every KV head."""
    candidates, sizes = stage_sizes(plan, last_keep, position + 1)
    total = 0
    for i, stage in enumerate(plan.stages):
        if due[i]:
            count = candidates if i == 0 else sizes[i - 1] * (plan.stages[i - 1].chunk // stage.chunk)
            total += count * probes(stage.chunk) * row
    return total


def used_tokens(sink_count: int, starts: torch.Tensor, ends: torch.Tensor, chunk: int, window_start: int,
                n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys one decoding step's attention reads: sinks [0, sink_count), every selected range
    `[starts, ends)` ([C] each, at most `chunk` keys), and the window [window_start, n).
    Returns tokens [L] and their validity [L]."""
    device = starts.device
    sinks = torch.arange(sink_count, device=device)
    offsets = torch.arange(chunk, device=device)
    selected = (starts.unsqueeze(-1) + offsets).flatten()  # [C * chunk]
    selected_valid = selected < ends.unsqueeze(-1).expand(-1, chunk).flatten()
    window = torch.arange(window_start, n, device=device)
    tokens = torch.cat([sinks, selected, window])
    valid = torch.cat([torch.ones_like(sinks, dtype=torch.bool), selected_valid,
                       torch.ones_like(window, dtype=torch.bool)])
    return tokens, valid

