"""The cost model that decides, per step and sequence, how many draft tokens to verify (0 .. num_speculative_tokens).

A step's time is fitted as ``a + b * tokens`` from the engine's own decode steps: at small batches ``a``
(reading the weights) dominates and extra query positions are nearly free; at large batches the step is
compute-bound and every extra position costs about as much as a plain decode token. A sequence's draft
tokens are accepted one after another with probability ``alpha`` (its running estimate), so its j-th draft
adds ``alpha ** j`` expected tokens for ``b`` more seconds, plus the proposer's own measured seconds per drafted
token (a draft model's forward passes; about zero for prompt lookup). Drafts are handed out, best first, while
each raises the step's expected tokens per second.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

PRIOR_KNEE_TOKENS = 16.0  # before any data: a step of this many tokens takes twice a step of one
PRIOR_WEIGHT = 2.0  # the prior counts as this many steps
DECAY = 0.98  # older steps fade: the fit follows the workload's current shape
PRIOR_ACCEPTANCE = 0.5  # a method's acceptance rate before it has verified anything
SEQ_DECAY = 0.8
SEQ_PRIOR_TRIALS = 2.0  # a sequence's estimate leans on the method's rate for about this many drafts
MIN_GAIN = 1.03  # drafting must beat plain decode's tokens per second by 3 %: proposing costs host time too


@dataclass
class StepCostModel:
    """Online weighted least squares of step seconds on tokens computed, anchored by a prior until the steps
    vary enough to fit a slope."""

    knee_tokens: float = PRIOR_KNEE_TOKENS
    prior_weight: float = PRIOR_WEIGHT
    decay: float = DECAY
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # w, w*x, w*y, w*x*x, w*x*y
    _prior: list[float] | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        if self._prior is None:
            self._prior = self._prior_sums(tokens, seconds)
        self._sums = [v * self.decay for v in self._sums]
        for i, v in enumerate((1.0, tokens, seconds, tokens * tokens, tokens * seconds)):
            self._sums[i] += v

    def _prior_sums(self, tokens: int, seconds: float) -> list[float]:
        """Two pseudo-steps on the prior's line through the first measured step."""
        a = seconds / (1 + tokens / self.knee_tokens)
        b = a / self.knee_tokens
        sums = [0.0] * 5
        for x in (1.0, 2 * self.knee_tokens):
            y, w = a + b * x, self.prior_weight / 2
            for i, v in enumerate((1.0, x, y, x * x, x * y)):
                sums[i] += w * v
        return sums

    @property
    def fitted(self) -> bool:
        return self._prior is not None

    def coefficients(self) -> tuple[float, float]:
        """(a seconds, b seconds per token); before any step, the prior's shape at a = 1."""
        if self._prior is None:
            return 1.0, 1.0 / self.knee_tokens
        w, sx, sy, sxx, sxy = (p + s for p, s in zip(self._prior, self._sums))
        det = w * sxx - sx * sx
        b = (w * sxy - sx * sy) / det if det > 0 else 0.0
        if b < 0:
            return sy / w, 0.0
        a = (sy - b * sx) / w
        if a < 0:
            return 0.0, sxy / sxx
        return a, b


@dataclass
class AcceptanceTracker:
    """Per-token acceptance estimates: the method's running rate, and a recent one per sequence leaning on it.

    A step that verified ``k`` drafts and kept ``a`` saw ``a`` acceptances in ``a + (a < k)`` trials.
    """

    accepted: float = 0.0
    trials: float = 0.0
    _seqs: dict[int, tuple[float, float]] = field(default_factory=dict)

    def observe(self, seq_id: int, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        trials = accepted + (accepted < proposed)
        self.accepted += accepted
        self.trials += trials
        s, n = self._seqs.get(seq_id, (0.0, 0.0))
        self._seqs[seq_id] = (s * SEQ_DECAY + accepted, n * SEQ_DECAY + trials)

    @property
    def method_rate(self) -> float:
        return (self.accepted + PRIOR_ACCEPTANCE * SEQ_PRIOR_TRIALS) / (self.trials + SEQ_PRIOR_TRIALS)

    def rate(self, seq_id: int) -> float:
        s, n = self._seqs.get(seq_id, (0.0, 0.0))
        return min(0.99, (s + self.method_rate * SEQ_PRIOR_TRIALS) / (n + SEQ_PRIOR_TRIALS))

    def drop(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)


@dataclass
class DraftCost:
    """The proposer's seconds per drafted token, a decayed mean over its calls."""

    decay: float = 0.8
    _seconds: float = 0.0
    _tokens: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self._seconds = self._seconds * self.decay + max(0.0, seconds)
            self._tokens = self._tokens * self.decay + tokens

    @property
    def seconds_per_token(self) -> float:
        return self._seconds / self._tokens if self._tokens else 0.0


def choose_draft_lengths(rates: list[float], caps: list[int], a: float, b: float,
                         draft_s: float = 0.0) -> list[int]:
    """Draft tokens per decoding sequence that maximise expected tokens per second for a step of
    ``len(rates)`` decodes costing ``a + b * tokens``, each draft token also costing ``draft_s`` seconds to
    propose; all zeros where no draft pays (compute-bound steps, slow proposers)."""
    ks = [0] * len(rates)
    per_draft = b + draft_s
    expected, seconds = float(len(rates)), a + b * len(rates)
    plain = expected / seconds
    heap = [(-r, i) for i, (r, cap) in enumerate(zip(rates, caps)) if cap > 0 and r > 0]
    heapq.heapify(heap)
    while heap:
        gain, i = -heap[0][0], heap[0][1]
        if (expected + gain) * seconds <= expected * (seconds + per_draft):  # (E + g) / (T + c) <= E / T
            break
        heapq.heappop(heap)
        ks[i] += 1
        expected += gain
        seconds += per_draft
        if ks[i] < caps[i]:
            heapq.heappush(heap, (-gain * rates[i], i))
    if expected / seconds < MIN_GAIN * plain:
        return [0] * len(rates)
    return ks
