"""A score per token, the same in every head and layer: the token's -log p (`Step.token_nll`), written where
each forward or decoding step put the token's entries. InfiniPot's NuC and SirLLM's entropy keep it."""

from __future__ import annotations

import torch

from kvpot.methods.base import Step


def store_forward(cache, name: str, step: Step) -> None:
    """After a forward: the `step.n_new` newest entries of every layer get their tokens' scores (unless the mixed
    step wrote them already, `store_chunks`)."""
    if step.scores_stored:
        return
    nll = {step.token_nll.device: step.token_nll}  # one copy per device of a model split over GPUs
    for layer in cache.layers:
        if layer.device not in nll:
            nll[layer.device] = step.token_nll.to(layer.device)
        layer.score(name)[:, :, layer.n - step.n_new :] = nll[layer.device].view(1, 1, -1)


def store_append(cache, name: str, step: Step) -> None:
    """A fixed-shape step: the new entry, at each layer's device-side `slot`, gets the token's score."""
    for layer in cache.layers:
        score = step.token_nll.view(1, 1, 1).expand(layer.batch, layer.kv_heads, 1)
        layer.scores[name].index_copy_(2, layer.slot, score)


def store_batch(layers, name: str, rows: torch.Tensor, index: list[torch.Tensor], step: Step) -> None:
    """A batched step: row i's new entry (slot `rows[i]`, entry `index[l][i]` in layer l) gets its token's score."""
    nll = step.token_nll[:, None]  # [B, 1]
    for layer, at in zip(layers, index):  # (the pool layer's own head index: no arange launched a layer a step)
        layer.score(name)[rows[:, None], layer.heads, at[:, None]] = nll.expand(-1, layer.kv_heads)


def store_chunks(caches: list, name: str, scores: list[torch.Tensor]) -> bool:
    """After a mixed forward: each of `caches`' newest `len(scores[i])` entries get `scores[i]`, what `store_forward`
    writes for each alone, as `store_batch` writes a batched step's rows: one indexed write a layer for them all.
    Only where every cache is a pool slot's (its layers' `storage` is the pool layer) with one count in every layer,
    all of one pool; else nothing is written (False) and each chunk's `after_forward` writes its own."""
    storages = [getattr(layer, "storage", None) for layer in caches[0].layers] if caches else [None]
    counts = [{layer.n for layer in cache.layers} for cache in caches]
    if None in storages or any(len(c) != 1 for c in counts) or any(
            [getattr(layer, "storage", None) for layer in cache.layers] != storages for cache in caches):
        return False
    device = caches[0].layers[0].device
    rows = torch.cat([torch.full((len(s),), cache.layers[0].row, dtype=torch.long) for cache, s in zip(caches, scores)])
    entries = torch.cat([torch.arange(n - len(s), n) for (n,), s in zip(counts, scores)]).to(device, non_blocking=True)
    values = torch.cat([s.to(device) for s in scores])
    store_batch(storages, name, rows.to(device, non_blocking=True), [entries] * len(storages),
                Step("context", len(values), token_nll=values))
    return True
