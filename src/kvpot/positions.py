"""Positions: the model's own RoPE applied by kvpot, and the policies that choose positions.

kvpot runs every forward with `position_ids` all zero, so the model's rotary embedding is the
identity (times its `attention_scaling`, which we divide out) and q/k reach the cache un-rotated.
The cache then rotates them with the positions a *policy* assigns. Keeping one owner for positions
is what lets StreamingLLM's shift, InfiniPot's CR-RoPE and plain absolute positions share a cache.

Policies (docs/design.md, "Positions"):
- `absolute`: an entry keeps the position of its token in the input stream. Keys never move, so
  the cache stores them rotated once, at insertion (no per-step rotation cost).
- `shift` (StreamingLLM, Xiao et al. 2024, Sec. 3.2; CItruS Sec. 5.3): cached entries take
  0..n-1 in original order and new tokens continue from n. Keys are stored un-rotated and rotated
  at attention time.
- `hip` (InfiniteHiP): keys stay un-rotated at their stream positions; the method's sparse
  attention rotates what it reads, with the positions its paper prescribes (`kvpot.methods.infinitehip.reference`).
- `self-extend` (Self-Extend, Jin et al. 2024, Sec. 3.2): keys stay un-rotated at their stream positions; an
  entry's position is its grouped position `floor(k / G)`, and in fixed-shape decoding steps the last
  `window` entries are renumbered relative to the query (`decode_positions`), so one RoPE-on-load kernel
  call reads both of the paper's attentions. The method's attention (`kvpot.methods.selfextend`) does prefill.
- `reset` (InfiniPot's CR-RoPE, Sec. 3.5): after each compression the kept entries take 0..|C|-1
  in original order and new tokens continue from there. Because kvpot keeps entries in original
  order and only compressions remove entries, this assigns every entry its rank, exactly as
  `shift` does; the two names are kept so that each method states its paper's rule.
"""

from __future__ import annotations

import torch

from kvpot.errors import KvpotError

# Policies read a layer's `n`, `batch`, `kv_heads`, `keys` and write its `rope_positions`; they take the
# layer as an argument and never import `kvpot.cache` (which imports them), so the two modules have no
# import circle, not even one for type checkers. "PotLayer" in annotations names `kvpot.cache.PotLayer`.


class PositionPolicy:
    """Assigns RoPE positions to cache entries. Subclasses differ only in these two rules."""

    name = ""
    stores_rotated = False  # True when positions never change, so keys are rotated once
    raw_keys = False  # True when the method's own attention applies RoPE (InfiniteHiP)
    renumbers = False  # True when `after_select` rewrites every kept entry's position (no need to gather them)

    def new_positions(self, layer: PotLayer, original: torch.Tensor) -> torch.Tensor:
        """RoPE positions [b, kv_heads, q] for `q` tokens about to be appended to `layer`."""
        raise NotImplementedError

    def after_select(self, layer: PotLayer) -> None:
        """Re-assign the positions of `layer`'s entries after a selection."""

    # the fixed-shape decode kernels attend right from `rope_positions` and `query_position` (after
    # `decode_positions`); False where a method's own attention must run every step (InfiniteHiP)
    kernel_decoding = True

    def decode_positions(self, positions: torch.Tensor, rope_positions: torch.Tensor, query_position: torch.Tensor,
                         rows: torch.Tensor | None, index: torch.Tensor) -> None:
        """A fixed-shape decoding step wrote each row's token at entry `index` [B] of its slot `rows` [B]
        (None: one sequence, slot 0) in `positions`/`rope_positions` [slots, kv_heads, capacity] and its query
        position in `query_position` [slots]; renumber them in place before the attention reads them
        (fixed shapes, no host values: captured in CUDA graphs). Nothing to do for most policies."""


class Absolute(PositionPolicy):
    name = "absolute"
    stores_rotated = True

    def new_positions(self, layer: PotLayer, original: torch.Tensor) -> torch.Tensor:
        return original.expand(layer.batch, layer.kv_heads, -1)


class Rank(PositionPolicy):
    """Entries are numbered 0..n-1 in original order; new tokens continue from n."""

    name = "shift"
    renumbers = True

    def new_positions(self, layer: PotLayer, original: torch.Tensor) -> torch.Tensor:
        q = original.shape[-1]
        ranks = torch.arange(layer.n, layer.n + q, device=original.device)
        return ranks.expand(layer.batch, layer.kv_heads, q)

    def after_select(self, layer: PotLayer) -> None:
        ranks = torch.arange(layer.n, device=layer.keys.device)
        layer.rope_positions[:, :, : layer.n] = ranks


class Reset(Rank):
    name = "reset"


class Hip(PositionPolicy):
    """InfiniteHiP: every entry keeps its stream position and its key stays un-rotated.

    The method's sparse attention (`kvpot.methods.infinitehip.reference`) chooses positions per use: chunk-indexed or
    relative while pruning, streaming in the final attention; nothing is rotated by the cache.
    """

    name = "hip"
    raw_keys = True
    kernel_decoding = False

    def new_positions(self, layer: PotLayer, original: torch.Tensor) -> torch.Tensor:
        return original.expand(layer.batch, layer.kv_heads, -1)


class SelfExtendPositions(PositionPolicy):
    """Self-Extend (Jin et al. 2024): query at stream position q, key at k. Within the neighbour window
    (q - k < W) the relative position is q - k; beyond it floor(q / G) - floor(k / G) + W - floor(W / G).

    Keys stay un-rotated; an entry's `rope_positions` holds its grouped position floor(k / G) (fixed for
    good). A decoding step puts its query at P = floor(q / G) + W - floor(W / G) (P = q while q < W: no
    key is grouped yet, and the neighbours' positions stay >= 0) and the last W entries at P - (q - k),
    so every query-key pair gets the paper's relative position in one kernel call; the entry that just
    left the window gets its grouped position back. Group size and window come from the method
    (`configure`, called by `SelfExtend.begin` before anything is read).
    """

    name = "self-extend"
    raw_keys = True

    def __init__(self):
        self.group: int | None = None
        self.window: int | None = None

    def configure(self, group: int, window: int) -> None:
        self.group, self.window = group, window

    def _check(self) -> None:
        if self.group is None:
            raise KvpotError("the self-extend positions were used before SelfExtend.begin configured them.")

    def new_positions(self, layer: PotLayer, original: torch.Tensor) -> torch.Tensor:
        self._check()
        return original.expand(layer.batch, layer.kv_heads, -1) // self.group

    def query_position(self, q: torch.Tensor) -> torch.Tensor:
        """P: the grouped query position, or q itself while q < W."""
        group, window = self.group, self.window
        return torch.where(q >= window, q // group + (window - window // group), q)

    def decode_positions(self, positions, rope_positions, query_position, rows, index) -> None:
        self._check()
        group, window = self.group, self.window
        device = index.device
        if rows is None:
            rows = torch.zeros_like(index)
        heads = torch.arange(positions.shape[1], device=device).view(1, -1, 1)
        # entries index - W .. index; lanes before entry 0 re-read entry 0 and write what its own lane writes
        at = (index.view(-1, 1) + torch.arange(-window, 1, device=device)).clamp(min=0).unsqueeze(1)  # [B, 1, W+1]
        slots = rows.view(-1, 1, 1)
        keys = positions[slots, heads, at]  # [B, kv, W + 1] stream positions
        q = positions[slots, heads, index.view(-1, 1, 1)]  # [B, kv, 1]
        p = self.query_position(q)
        distance = q - keys
        rope_positions[slots, heads, at] = torch.where(distance < window, p - distance, keys // group)
        query_position[rows] = p[:, 0, 0]


POLICIES: dict[str, type[PositionPolicy]] = {p.name: p for p in (Absolute, Rank, Reset, Hip, SelfExtendPositions)}


def make_policy(name: str) -> PositionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise KvpotError(f"unknown position policy {name!r}; choose one of {sorted(POLICIES)}.") from None
