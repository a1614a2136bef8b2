"""Rejection sampling of sampled drafts (Leviathan et al.) on hand-made distributions: the emitted tokens follow
the target's p at each position, a broken rule does not, and deterministic rows beside them keep the exact rule."""
from __future__ import annotations

import pytest
import torch

from batchgen.engine.backends.torch import ops
from tests.test_speculative import chi2_999

# Target p and draft q at two draft positions and the bonus one (vocabulary 5): at the first, q puts mass where p
# has none and misses a token p has (drafts rejected, tokens from the residual); at the second q == p (all kept).
P = torch.tensor([[0.40, 0.30, 0.20, 0.10, 0.00], [0.05, 0.05, 0.60, 0.20, 0.10], [0.2, 0.2, 0.2, 0.2, 0.2]])
Q = torch.tensor([[0.10, 0.30, 0.30, 0.00, 0.30], [0.05, 0.05, 0.60, 0.20, 0.10]])  # position 1: q == p
ROWS = 6000


def rule_inputs(rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``rows`` rows of two drafts sampled from Q, every third one deterministic instead (no q, drafts that the
    plain sample equals half the time), as ``ops.reject_drafts`` takes them."""
    gen = torch.Generator().manual_seed(seed)
    k, positions = 2, rows * 3
    probs = P.repeat(rows, 1)
    sampled = torch.multinomial(probs, 1, generator=gen)[:, 0]
    drafts = torch.multinomial(Q.repeat(rows, 1), 1, generator=gen)[:, 0].reshape(rows, k)
    deterministic = torch.arange(rows) % 3 == 2
    sampled_rows = sampled.reshape(rows, 3)
    coin = torch.rand(rows, k, generator=gen) < 0.5
    drafts = torch.where(deterministic[:, None] & coin, sampled_rows[:, :k], drafts)
    q_starts = torch.where(deterministic, -1, torch.arange(rows) * k)
    return dict(sampled=sampled, probs=probs, draft_probs=Q.repeat(rows, 1), q_starts=q_starts,
                uniforms=torch.rand(positions, generator=gen),
                residual_seeds=torch.randint(0, 2 ** 62, (positions,), generator=gen),
                steps=torch.arange(positions) % 3, starts=torch.arange(rows) * 3,
                lens=torch.full((rows,), k), drafts=drafts)


def goodness_of_fit(tokens: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    """One-sample chi-square of ``tokens`` against the exact distribution ``p`` (its zero cells must stay empty)."""
    counts = torch.bincount(tokens, minlength=len(p)).double()
    assert counts[p == 0].sum() == 0, counts
    expected = p.double()[p > 0] * len(tokens)
    return float(((counts[p > 0] - expected) ** 2 / expected).sum()), int((p > 0).sum()) - 1


def emitted(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled rows' first token, and their second where they kept the first draft."""
    tokens, counts = ops.reject_drafts(**inputs)
    rows = inputs["q_starts"] >= 0
    tokens, counts = tokens[rows], counts[rows]
    return tokens[:, 0], tokens[counts >= 2, 1]


def test_rejection_sampling_emits_the_targets_distribution():
    inputs = rule_inputs(ROWS)
    first, second = emitted(inputs)
    for tokens, p in ((first, P[0]), (second, P[1])):
        stat, df = goodness_of_fit(tokens, p)
        assert stat < chi2_999(df), (stat, df)
    # The first draft is kept with probability sum(min(p, q)) = 0.6; q == p keeps the second always.
    tokens, counts = ops.reject_drafts(**inputs)
    sampled_rows = inputs["q_starts"] >= 0
    kept_first = (counts[sampled_rows] >= 2).double().mean()
    assert abs(kept_first - 0.6) < 0.03
    assert bool((counts[sampled_rows][counts[sampled_rows] >= 2] == 3).all())


def test_deterministic_rows_beside_sampled_ones_keep_the_exact_rule():
    inputs = rule_inputs(300)
    tokens, counts = ops.reject_drafts(**inputs)
    exact, exact_counts, _ = ops.accept_drafts(inputs["sampled"], None, inputs["starts"], inputs["lens"],
                                               inputs["drafts"])
    rows = inputs["q_starts"] < 0
    assert torch.equal(counts[rows], exact_counts[rows])
    for got, want, n in zip(tokens[rows].tolist(), exact[rows].tolist(), counts[rows].tolist(), strict=True):
        assert got[:n] == want[:n]
    assert 1 < exact_counts[rows].float().mean() < 3  # kept and rejected drafts both


@pytest.mark.parametrize("broken", [
    lambda u, p, q: torch.ones_like(p, dtype=torch.bool),  # every sampled draft kept: the tokens follow q
    lambda u, p, q: u < p,  # the deterministic drafts' rule applied to sampled ones
], ids=["accept-always", "deterministic-rule"])
def test_a_broken_rejection_rule_fails_the_chi_square(monkeypatch, broken):
    monkeypatch.setattr(ops, "probabilistic_acceptance", broken)
    first, _ = emitted(rule_inputs(ROWS))
    counts = torch.bincount(first, minlength=5).double()
    expected = P[0].double() * len(first)
    stat = float(((counts - expected) ** 2 / expected.clamp(min=1e-9)).sum())  # p's zero cell counts too
    assert stat > chi2_999(3), stat
