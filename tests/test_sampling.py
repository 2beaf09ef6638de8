"""The sampler both decoding paths pick through (`kvpot.engine.sampling.pick_rows`): what a row draws depends on
its own logits, temperature, top_p, seed and draw count, never on the rows beside it or on the picking mode the
batch needed; and its draws follow the distribution they claim to."""

from __future__ import annotations

import pytest
import torch

from kvpot.engine.sampling import PICKING, hash_uniform, pick_rows, picking, request_seed

VOCAB = 50


def rows(temperature, top_p, seeds, counters=None, n=None):
    n = n or len(temperature)
    return (torch.tensor(temperature, dtype=torch.float32), torch.tensor(top_p, dtype=torch.float32),
            torch.tensor(seeds, dtype=torch.long), torch.zeros(n, dtype=torch.long) if counters is None
            else torch.tensor(counters, dtype=torch.long))


def test_picking_names_what_a_request_needs():
    assert picking(0.0, 0.5) == "greedy" and picking(0.7, 1.0) == "sample" and picking(0.7, 0.9) == "nucleus"
    assert PICKING == ("greedy", "sample", "nucleus")


def test_a_row_draws_the_same_token_under_every_mode_that_covers_it():
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB) * 3
    t, p, s, c = rows([0.0, 1.0, 0.8, 1.3], [1.0, 1.0, 1.0, 0.5], [1, 2, 3, 4], [0, 5, 9, 2])
    nucleus = pick_rows(logits, t, p, s, c, "nucleus")
    sample = pick_rows(logits, t, p, s, c, "sample")
    greedy = pick_rows(logits, t, p, s, c, "greedy")
    assert torch.equal(nucleus[:3], sample[:3])  # rows without a nucleus: the same draws in either mode
    assert nucleus[0] == greedy[0] == logits[0].argmax()  # a greedy row is greedy in every mode
    assert torch.equal(greedy, logits.argmax(-1))
    for i in range(4):  # alone, as a batch of one row (what Engine.generate does)
        alone = pick_rows(logits[i : i + 1], t[i : i + 1], p[i : i + 1], s[i : i + 1], c[i : i + 1],
                          picking(float(t[i]), float(p[i])))
        assert alone.item() == nucleus[i].item()


def test_draws_follow_the_distribution_and_stay_in_the_nucleus():
    """Over 4,000 draws (counters 0..3999) a row's token frequencies match softmax(logits / T), and with top_p
    only the nucleus is ever drawn."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    n = 4000
    t, p, s, _ = rows([0.9] * n, [1.0] * n, [7] * n)
    counters = torch.arange(n)
    draws = pick_rows(logits.expand(n, -1), t, p, s, counters, "sample")
    expected = (logits[0] / 0.9).softmax(-1)
    observed = torch.bincount(draws, minlength=5).float() / n
    assert (observed - expected).abs().max() < 0.03  # ~4 standard errors at n = 4,000
    p_small = torch.full((n,), 0.7)  # the first token holds 0.60 of the mass, the first two 0.80: nucleus {0, 1}
    nucleus = pick_rows(logits.expand(n, -1), t, p_small, s, counters, "nucleus")
    assert set(nucleus.tolist()) == {0, 1}


def test_uniforms_are_a_function_of_seed_counter_and_token():
    a = hash_uniform(torch.tensor([3, 3]), torch.tensor([0, 1]), VOCAB)
    b = hash_uniform(torch.tensor([3]), torch.tensor([1]), VOCAB)
    assert torch.equal(a[1:], b) and not torch.equal(a[0], a[1])
    assert float(a.min()) > 0 and float(a.max()) < 1


@pytest.mark.parametrize("seed, bits", [(5, 5), (2**64 - 1, -1), (2**63, -(2**63))])
def test_request_seeds_keep_their_64_bits(seed, bits):
    assert request_seed(seed, 1.0) == bits
    torch.manual_seed(0)
    drawn = request_seed(None, 1.0)
    torch.manual_seed(0)
    assert request_seed(None, 1.0) == drawn and 0 <= drawn < 2**62
    state = torch.get_rng_state()
    assert request_seed(None, 0.0) == 0 and torch.equal(torch.get_rng_state(), state)  # greedy: nothing drawn
