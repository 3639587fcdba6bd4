"""The sampler's top-k and top-p keep exactly the tokens transformers' warpers keep (vLLM keeps the same)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from kvpool.runner.sampler import sample


def kept(logits: torch.Tensor, **params: float) -> set[int]:
    """The tokens the sampler draws from, over enough seeded draws to see each one kept."""
    p = SimpleNamespace(**{"temperature": 1.0, "top_p": 1.0, "top_k": 0, **params})
    g = torch.Generator().manual_seed(0)
    return {sample(logits, [p], [g])[0] for _ in range(400)}


@pytest.mark.parametrize("top_p", [0.5, 0.75, 0.9, 0.3])
def test_top_p_keeps_the_smallest_set_reaching_it_ties_as_transformers(top_p: float) -> None:
    # Masses 0.5, 0.25, 0.125, 0.125 (exact in binary): 0.5 and 0.75 fall exactly on a boundary, and the
    # last two tokens tie.
    logits = torch.full((1, 8), float("-inf"))
    logits[0, [1, 3, 4, 6]] = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()
    want = set(torch.isfinite(TopPLogitsWarper(top_p)(None, logits.clone())[0]).nonzero().flatten().tolist())
    assert kept(logits, top_p=top_p) == want
    assert want == {0.5: {1}, 0.75: {1, 3}, 0.9: {1, 3, 4, 6}, 0.3: {1}}[top_p]


def test_two_tokens_of_half_the_mass_at_top_p_one_half_keep_one() -> None:
    logits = torch.full((1, 8), float("-inf"))
    logits[0, 3] = logits[0, 5] = 0.0
    want = set(torch.isfinite(TopPLogitsWarper(0.5)(None, logits.clone())[0]).nonzero().flatten().tolist())
    assert len(want) == 1 and kept(logits, top_p=0.5) == want


def test_top_k_keeps_the_k_largest() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5, 0.3, 1.9]])
    want = set(torch.isfinite(TopKLogitsWarper(3)(None, logits.clone())[0]).nonzero().flatten().tolist())
    assert kept(logits, top_k=3) == want == {1, 3, 5}


@pytest.mark.parametrize("temperature", [1e30, 1e300])
def test_top_k_keeps_the_k_largest_at_any_temperature(temperature: float) -> None:
    # Divided by such a temperature every logit rounds to 0: the k kept are chosen before the division.
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5, 0.3, 1.9]])
    assert kept(logits, top_k=1, temperature=temperature) == {1}
    assert kept(logits, top_k=3, temperature=temperature) == {1, 3, 5}


@pytest.mark.parametrize(("min_p", "temperature"), [(0.3, 1.0), (0.55, 1.0), (0.2, 0.5), (0.6, 2.0)])
def test_min_p_keeps_what_transformers_keeps(min_p: float, temperature: float) -> None:
    """After the temperature, as vLLM and transformers' warper (probabilities 0.4, 0.2, 0.15, 0.1, ... here)."""
    from transformers.generation.logits_process import MinPLogitsWarper

    logits = torch.full((1, 8), float("-inf"))
    logits[0, [0, 2, 3, 5, 7]] = torch.tensor([0.4, 0.2, 0.15, 0.1, 0.15]).log()
    scaled = logits / temperature
    want = set(torch.isfinite(MinPLogitsWarper(min_p)(None, scaled.clone())[0]).nonzero().flatten().tolist())
    assert kept(logits, min_p=min_p, temperature=temperature) == want
    assert 1 <= len(want) < 5  # (each case cuts some tokens; none falls on the boundary, where rounding decides)
