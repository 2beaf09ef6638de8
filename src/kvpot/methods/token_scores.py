"""A score per token, the same in every head and layer: the token's -log p (`Step.token_nll`), written where
each forward or decoding step put the token's entries. InfiniPot's NuC and SirLLM's entropy keep it."""

from __future__ import annotations

import torch

from kvpot.methods.base import Step


def store_forward(cache, name: str, step: Step) -> None:
    """After a forward: the `step.n_new` newest entries of every layer get their tokens' scores."""
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
