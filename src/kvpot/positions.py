"""Positions: the model's own RoPE applied by kvpot, and the policies that choose positions.

kvpot runs every forward with `position_ids` all zero, so the model's rotary embedding is the
identity (times its `attention_scaling`, which we divide out) and q/k reach the cache un-rotated.
The cache then rotates them with the positions a *policy* assigns. Keeping one owner for positions
is what lets StreamingLLM's shift, InfiniPot's CR-RoPE and plain absolute positions share a cache.

Policies (DESIGN.md "Positions"):
- `absolute`: an entry keeps the position of its token in the input stream. Keys never move, so
  the cache stores them rotated once, at insertion (no per-step rotation cost).
- `shift` (StreamingLLM, Xiao et al. 2024, Sec. 3.2; CItruS Sec. 5.3): cached entries take
  0..n-1 in original order and new tokens continue from n. Keys are stored un-rotated and rotated
  at attention time.
- `hip` (InfiniteHiP): keys stay un-rotated at their stream positions; the method's sparse
  attention rotates what it reads, with the positions its paper prescribes (`kvpot.methods.infinitehip.reference`).
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

    def new_positions(self, layer: PotLayer, original: torch.Tensor) -> torch.Tensor:
        return original.expand(layer.batch, layer.kv_heads, -1)


POLICIES: dict[str, type[PositionPolicy]] = {p.name: p for p in (Absolute, Rank, Reset, Hip)}


def make_policy(name: str) -> PositionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise KvpotError(f"unknown position policy {name!r}; choose one of {sorted(POLICIES)}.") from None
