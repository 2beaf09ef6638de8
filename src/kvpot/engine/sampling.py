"""Token-level helpers of the engine's decoding loop: id validation, EOS ids, sampling, text streaming."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from kvpot.errors import Cancelled, KvpotError


def _as_ids(ids, device: torch.device, what: str) -> torch.Tensor:
    """A 1-D long tensor on `device` from a list, 1-D tensor or a [1, n] tensor (batch size 1)."""
    if ids is None:
        return torch.empty(0, dtype=torch.long, device=device)
    tensor = torch.as_tensor(ids, dtype=torch.long)
    if tensor.dim() == 2:
        if tensor.shape[0] != 1:
            raise KvpotError(f"{what}: kvpot runs batch size 1; got a batch of {tensor.shape[0]}.")
        tensor = tensor[0]
    if tensor.dim() != 1:
        raise KvpotError(f"{what} must be a list of token ids or a [1, n] tensor.")
    return tensor.to(device)


def _eos_ids(model: PreTrainedModel) -> set[int]:
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


class _TextStreamer:
    """Turns a token stream into text pieces, holding back incomplete UTF-8 / word pieces."""

    def __init__(self, tokenizer, sink: Callable[[str], None]):
        self.tokenizer, self.sink = tokenizer, sink
        self.tokens: list[int] = []
        self.printed = 0

    def __call__(self, token: int) -> None:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return  # an incomplete multi-byte character: wait for the next token
        self.sink(text[self.printed :])
        self.printed = len(text)

    def flush(self) -> None:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if len(text) > self.printed:
            self.sink(text[self.printed :])
            self.printed = len(text)


def _stopping(on_token: Callable[[int], None] | None, should_stop: Callable[[], bool]) -> Callable[[int], None]:
    """`on_token`, then a check of `should_stop` that ends decoding with `Cancelled`."""

    def call(token: int) -> None:
        if on_token is not None:
            on_token(token)
        if should_stop():
            raise Cancelled("stopped while decoding: should_stop() said so.")

    return call


# splitmix64's constants as signed int64 (torch has no uint64 arithmetic; products wrap the same way)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's `>>` is arithmetic: it would copy the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def hash_uniform(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform draws in (0, 1) [rows, vocab], a pure function of (seed, counter, token id) per row.

    splitmix64's finaliser over a counter: a request's draws depend on its seed and how many tokens
    it has drawn, never on which other requests share the batch, and need no generator state, so
    a captured step replays them."""
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.long)
    x = (seeds[:, None] + 1) * _GOLDEN + counters[:, None] * _MIX1 + ids[None, :] * _MIX2
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    x = x ^ _shift_right(x, 31)
    return (_shift_right(x, 11).double() + 0.5).mul_(2.0**-53).float()


def request_seed(seed: int | None, temperature: float) -> int:
    """A request's sampling seed as the int64 the sampler hashes: `seed`'s 64 bits, or a draw from torch's global
    generator where None (so `torch.manual_seed` makes unseeded sampling repeatable too); 0 for a greedy request,
    which draws nothing (and so takes no number from the caller's generator). Alone and batched take the same
    seed the same way, so a seeded request samples the same tokens on either path."""
    if temperature <= 0:
        return 0
    if seed is None:
        return int(torch.randint(0, 2**62, ()).item())
    return seed - 2**64 if seed >= 2**63 else seed


PICKING = ("greedy", "sample", "nucleus")  # what a batch's rows need, in increasing work


def picking(temperature: float, top_p: float) -> str:
    """What one request's picks need: an argmax, a draw, or a draw from its nucleus (`top_p` < 1) only."""
    return "greedy" if temperature <= 0 else "nucleus" if top_p < 1 else "sample"


def pick_rows(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor,
              counters: torch.Tensor, mode: str) -> torch.Tensor:
    """The next token [rows] of each row's logits [rows, vocab], on the device, each row with its own
    temperature (0: greedy), top_p and seed. `mode` (`PICKING`) is what the most demanding row needs: "greedy"
    takes every row's argmax; "sample" draws; "nucleus" also sorts each row to cut it to its top_p. A row's
    token never depends on the mode it ran under: a row whose top_p is 1 keeps its whole distribution in a
    nucleus batch, a greedy row takes its argmax in any. Sampling races exponential noise (`argmax p / E`,
    E ~ Exp(1), is a draw from p) drawn from `hash_uniform`: no data-dependent shapes and no generator state,
    so a captured step replays it. The one-sequence engine picks through it too, as a batch of one row: a
    seeded request draws the same tokens alone as in any batch."""
    greedy = logits.argmax(dim=-1)
    if mode == "greedy":
        return greedy
    probs = (logits / temperature.clamp_min(1e-6)[:, None]).softmax(dim=-1)
    if mode == "nucleus":
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = (sorted_probs.cumsum(-1) - sorted_probs > top_p[:, None]) & (top_p[:, None] < 1)
        probs = torch.zeros_like(probs).scatter(1, order, sorted_probs.masked_fill(outside, 0.0))
    noise = -hash_uniform(seeds, counters, logits.shape[-1]).log()
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy)
