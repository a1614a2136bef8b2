"""The speculation cost model on synthetic step timings, the acceptance estimates, and prompt lookup's matching."""
from __future__ import annotations

import numpy as np
import pytest

from batchgen.engine.speculative.ngram import NgramProposer
from batchgen.engine.speculative.policy import (PROBE_SEQUENCES, AcceptanceTracker, ProbeSchedule, StepCostModel,
                                                choose_draft_lengths, probe_draft_lengths)


def fitted(step_s, sizes=(1, 2, 4, 8, 16, 32, 64, 5, 9, 13)) -> StepCostModel:
    model = StepCostModel()
    for _ in range(3):
        for n in sizes:
            model.observe(n, step_s(n))
    return model


def test_the_fit_recovers_a_linear_step_cost():
    a, b = fitted(lambda n: 0.010 + 0.002 * n).coefficients()
    assert a == pytest.approx(0.010, rel=0.05) and b == pytest.approx(0.002, rel=0.05)


def test_the_prior_holds_the_slope_until_the_steps_vary():
    model = StepCostModel()
    for _ in range(50):
        model.observe(8, 0.024)  # one batch size only: the slope comes from the prior's shape
    a, b = model.coefficients()
    assert a + 8 * b == pytest.approx(0.024, rel=0.02) and b > 0


def test_one_expensive_verification_turns_drafting_off():
    """Measured on a shared 2-core machine: a decode step 0.7 s, a step verifying 4 drafts 8 s."""
    model = StepCostModel()
    model.observe(1, 0.7)
    a, b = model.coefficients()
    assert choose_draft_lengths([0.5], [4], a, b)[0] > 0  # the prior: extra positions are cheap
    model.observe(5, 8.0)
    a, b = model.coefficients()
    assert b > 1.0 and choose_draft_lengths([0.9], [4], a, b) == [0]
    assert choose_draft_lengths([], [], 0.0, b) == []  # a step with no decoding sequence


def test_a_slow_verification_is_outvoted_once_its_size_is_timed_again():
    model = StepCostModel()
    for _ in range(20):
        model.observe(1, 0.010)
    model.observe(5, 2.0)  # the machine was busy
    assert choose_draft_lengths([0.8], [4], *model.coefficients()) == [0]
    model.observe(5, 0.012)
    model.observe(5, 0.012)  # its size's median is a real verification's time now
    a, b = model.coefficients()
    assert b == pytest.approx(0.0005, rel=0.2) and choose_draft_lengths([0.8], [4], a, b) == [4]


def test_probes_come_ever_further_apart_and_start_over_once_drafting_pays():
    probes = ProbeSchedule(first=4, longest=16)
    fired = [step for step in range(1, 61) if probes.probe()]
    assert fired == [4, 12, 28, 44, 60]  # gaps 4, 8, 16, then 16 at most
    probes.drafted()
    assert [probes.probe() for _ in range(4)] == [False, False, False, True]


def test_a_probe_lets_the_best_accepted_sequences_draft_all_they_may():
    rates = [0.1, 0.9, 0.5, 0.8, 0.7, 0.95, 0.2]
    caps = [4, 4, 0, 2, 4, 3, 4]
    ks = probe_draft_lengths(rates, caps)
    assert len(ks) == len(caps) and sum(k > 0 for k in ks) == PROBE_SEQUENCES
    assert ks == [0, 4, 0, 2, 4, 3, 0]  # the four best with room to draft, each up to its cap


@pytest.mark.parametrize("batch", [8, 64, 256])
def test_compute_bound_steps_get_no_drafts(batch):
    # Every token costs as much as the fixed part over 4 tokens: a batch's step grows in proportion to it.
    a, b = fitted(lambda n: 0.001 + 0.004 * n).coefficients()
    assert choose_draft_lengths([0.7] * batch, [4] * batch, a, b) == [0] * batch


@pytest.mark.parametrize("batch", [1, 8])
def test_flat_steps_get_drafts(batch):
    a, b = fitted(lambda n: 0.050 + 0.0001 * n).coefficients()  # reading the weights dominates
    ks = choose_draft_lengths([0.7] * batch, [4] * batch, a, b)
    assert all(k >= 3 for k in ks)


def test_better_accepted_sequences_draft_more_and_caps_hold():
    a, b = fitted(lambda n: 0.010 + 0.0015 * n).coefficients()
    ks = choose_draft_lengths([0.95, 0.6, 0.1, 0.95], [4, 4, 4, 1], a, b)
    assert ks[0] >= ks[1] >= ks[2] and ks[0] > 0 and ks[2] == 0 and ks[3] == 1


def test_acceptance_estimates_follow_each_sequence_and_the_method():
    t = AcceptanceTracker()
    for _ in range(10):
        t.observe(1, 4, 4)  # always accepted
        t.observe(2, 4, 0)  # never
    # A rejection ends a step's trials: 10 steps of 4 kept are 40 in 40 trials, 10 of none 0 in 10.
    assert t.method_rate == pytest.approx((40 + 0.5 * 2) / (50 + 2))
    assert t.rate(1) > 0.95 and t.rate(2) < 0.3
    assert t.rate(3) == pytest.approx(t.method_rate)  # a new sequence starts at the method's rate
    t.drop(1)
    assert t.rate(1) == pytest.approx(t.method_rate)


def naive_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup spelled out: the longest suffix n-gram seen earlier, its earliest occurrence."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_matches_the_spelled_out_rule():
    rng = np.random.default_rng(0)
    proposer = NgramProposer(num_speculative_tokens=5, prompt_lookup_min=2, prompt_lookup_max=4)
    for _ in range(300):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist()
        assert proposer.propose(0, tokens, 5) == naive_lookup(tokens, 2, 4, 5), tokens
    assert proposer.propose(0, [1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3) == [9, 1, 2]  # earliest of the longest
    assert proposer.propose(0, [1, 2, 3, 4], 3) == []


def test_the_fit_separates_what_verifying_costs_beyond_its_tokens():
    """Verifying steps that cost 8 ms more than decode steps of as many tokens: the fit finds the 8 ms, and
    the drafts that a fit without it would hand out do not pay once it is counted."""
    model = StepCostModel()
    for _ in range(3):
        for n in (8, 6, 4):
            model.observe(n, 0.010 + 0.001 * n)
        for n in (12, 20, 28, 40):
            model.observe(n, 0.018 + 0.001 * n, verifying=True)
    a, b = model.coefficients()
    assert a == pytest.approx(0.010, rel=0.1) and b == pytest.approx(0.001, rel=0.1)
    assert model.verify_overhead() == pytest.approx(0.008, rel=0.25)  # the ridge prior shrinks it a little
    rates, caps = [0.6] * 8, [4] * 8
    assert any(choose_draft_lengths(rates, caps, a, b))
    assert choose_draft_lengths(rates, caps, a, b, verify_s=model.verify_overhead()) == [0] * 8
    assert any(choose_draft_lengths([0.95] * 8, caps, a, b, verify_s=model.verify_overhead()))  # it still pays here


def test_no_verifying_step_means_no_overhead():
    model = StepCostModel()
    for n in (1, 2, 4, 8):
        model.observe(n, 0.010 + 0.001 * n)
    assert model.verify_overhead() == 0.0


def test_drafts_a_proposer_does_not_deliver_stop_being_planned():
    """Prompt lookup finds nothing for some sequences: their planned drafts never come, and a verifying step
    planned for them would pay for nothing, so their expected gain shrinks with what was delivered."""
    tracker = AcceptanceTracker()
    for _ in range(10):
        tracker.offered(1, 4, 0)
        tracker.offered(2, 4, 4)
    assert tracker.supply(1) < 0.2 and tracker.supply(2) == 1.0
    supplies = [tracker.supply(1), tracker.supply(2)]
    assert choose_draft_lengths([0.8, 0.8], [4, 4], 0.010, 0.002) == [3, 3]  # both, were every draft delivered
    ks = choose_draft_lengths([0.8, 0.8], [4, 4], 0.010, 0.002, supplies=supplies)
    assert ks[0] == 0 and ks[1] > 0
