"""The cost model that decides, per step and sequence, how many draft tokens to verify (0 .. num_speculative_tokens).

A step's time is fitted as ``a + b * tokens`` from the engine's own decode steps, plus ``c`` for a step that
verifies drafts: at small batches ``a`` (reading the weights) dominates and extra query positions are nearly
free; at large batches the step is compute-bound and every extra position costs about as much as a plain decode
token. ``c`` is what turning a decode step into a verifying one costs beyond its tokens (attention over several
query positions per sequence, the sampler's extra rows, the host work that can no longer overlap the device):
the first draft of a step pays it. A sequence's draft
tokens are accepted one after another with probability ``alpha`` (its running estimate), so its j-th draft
adds ``alpha ** j`` expected tokens for ``b`` more seconds, plus what proposing it costs: the proposer's measured
seconds per draft step over the batch (a draft model's forward passes; about zero for prompt lookup). Drafts are handed out, best first, while
each raises the step's expected tokens per second. Where none pays, a probe step now and then drafts anyway, so
that the fit keeps seeing verifying steps (see ProbeSchedule).
"""
from __future__ import annotations

import heapq
import statistics
from collections import deque
from dataclasses import dataclass, field

PRIOR_KNEE_TOKENS = 16.0  # before any data: a step of this many tokens takes twice a step of one
PRIOR_WEIGHT = 0.5  # the prior (a, b) weighs as half a step of the first step's size: two sizes outweigh it
SIZE_WINDOW = 9  # timings kept per step size (their median counts): a and b are the machine's and the model's
MAX_STEP_SIZES = 1024  # step sizes timed at once; the least timed one makes room
PROBE_SEQUENCES = 4  # sequences a probe step lets draft
PRIOR_ACCEPTANCE = 0.5  # a method's acceptance rate before it has verified anything
SEQ_DECAY = 0.8
SEQ_PRIOR_TRIALS = 2.0  # a sequence's estimate leans on the method's rate for about this many drafts
MIN_GAIN = 1.03  # drafting must beat plain decode's tokens per second by 3 %: proposing costs host time too


@dataclass
class StepCostModel:
    """Ridge regression of step seconds on tokens computed and whether the step verified drafts, over the
    median of each (kind, size)'s recent timings (one slow step on a shared machine moves nothing once its size
    has been timed three times), pulled towards a prior (a0, b0, c = 0) set from the first step. The prior is a
    penalty on the coefficients, not pseudo-steps: with steps of one size only, the slope stays the prior's;
    two sizes fix it."""

    knee_tokens: float = PRIOR_KNEE_TOKENS
    prior_weight: float = PRIOR_WEIGHT
    window: int = SIZE_WINDOW
    _timings: dict[tuple[bool, int], deque[float]] = field(default_factory=dict)  # (verifying, size) -> seconds
    _prior: tuple[float, float, float] | None = None  # a0, b0, the first step's tokens
    _fit: tuple[float, float, float] | None = None  # a, b, c; cached until the next observation

    def observe(self, tokens: int, seconds: float, verifying: bool = False) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        if self._prior is None:
            a0 = seconds / (1 + tokens / self.knee_tokens)
            self._prior = (a0, a0 / self.knee_tokens, float(tokens))
        key = (verifying, tokens)
        if key not in self._timings and len(self._timings) >= MAX_STEP_SIZES:
            del self._timings[min(self._timings, key=lambda k: len(self._timings[k]))]  # the least timed size
        self._timings.setdefault(key, deque(maxlen=self.window)).append(seconds)
        self._fit = None

    @property
    def fitted(self) -> bool:
        return self._prior is not None

    def coefficients(self) -> tuple[float, float]:
        """(a seconds, b seconds per token); before any step, the prior's shape at a = 1."""
        return self._coefficients()[:2]

    def verify_overhead(self) -> float:
        """c: the seconds a verifying step takes beyond a decode step of as many tokens (0 before any data)."""
        return self._coefficients()[2]

    def _coefficients(self) -> tuple[float, float, float]:
        if self._prior is None:
            return 1.0, 1.0 / self.knee_tokens, 0.0
        if self._fit is None:
            self._fit = self._solve()
        return self._fit

    def _solve(self) -> tuple[float, float, float]:
        a0, b0, scale = self._prior
        la, lb, lc = self.prior_weight, self.prior_weight * scale ** 2, self.prior_weight
        # Normal equations of sum n (y - a - b x - c v)^2 + la (a - a0)^2 + lb (b - b0)^2 + lc c^2.
        m = [[la, 0.0, 0.0], [0.0, lb, 0.0], [0.0, 0.0, lc]]
        r = [la * a0, lb * b0, 0.0]
        for (verifying, x), times in self._timings.items():
            n, y, f = len(times), statistics.median(times), (1.0, float(x), float(verifying))
            for i in range(3):
                r[i] += n * f[i] * y
                for j in range(3):
                    m[i][j] += n * f[i] * f[j]
        a, b, c = _solve3(m, r)
        if a >= 0 and b >= 0 and c >= 0:
            return a, b, c
        return (*self._solve_without_overhead(m, r), 0.0)

    @staticmethod
    def _solve_without_overhead(m: list[list[float]], r: list[float]) -> tuple[float, float]:
        """The fit with c = 0 (a verification costing no more than its tokens), a and b kept >= 0."""
        m00, m01, m11, r0, r1 = m[0][0], m[0][1], m[1][1], r[0], r[1]
        det = m00 * m11 - m01 * m01
        a, b = (r0 * m11 - m01 * r1) / det, (m00 * r1 - m01 * r0) / det
        if b < 0:
            return r0 / m00, 0.0
        if a < 0:
            return 0.0, r1 / m11
        return a, b


def _solve3(m: list[list[float]], r: list[float]) -> tuple[float, float, float]:
    """x with m x = r for a symmetric positive definite 3 x 3 m (Cramer's rule)."""
    def det(q: list[list[float]]) -> float:
        return (q[0][0] * (q[1][1] * q[2][2] - q[1][2] * q[2][1]) - q[0][1] * (q[1][0] * q[2][2] - q[1][2] * q[2][0])
                + q[0][2] * (q[1][0] * q[2][1] - q[1][1] * q[2][0]))

    d = det(m)
    return tuple(det([[r[i] if j == col else m[i][j] for j in range(3)] for i in range(3)]) / d
                 for col in range(3))


@dataclass
class ProbeSchedule:
    """When the cost model says drafting does not pay, a step drafts anyway now and then, so that the model keeps
    timing verifying steps: otherwise one slow verification (a busy machine) would keep drafting off for the rest
    of the run, as no verifying step would be timed again. The first probe comes ``first`` undrafted steps after
    drafting stopped, then twice as far apart up to ``longest``: on a workload where drafting never pays, probes
    take a vanishing share of the steps."""

    first: int = 8
    longest: int = 256
    _gap: int = 8
    _waited: int = 0

    def __post_init__(self) -> None:
        self._gap = self.first

    def probe(self) -> bool:
        """Called for a step the cost model gives no drafts: True when this one should draft anyway."""
        self._waited += 1
        if self._waited < self._gap:
            return False
        self._waited, self._gap = 0, min(self.longest, self._gap * 2)
        return True

    def drafted(self) -> None:
        """The cost model gave a step drafts of its own accord: probes start over from ``first``."""
        self._waited, self._gap = 0, self.first


@dataclass
class AcceptanceTracker:
    """Per-token acceptance estimates: the method's running rate, and a recent one per sequence leaning on it.

    A step that verified ``k`` drafts and kept ``a`` saw ``a`` acceptances in ``a + (a < k)`` trials.
    """

    accepted: float = 0.0
    trials: float = 0.0
    _seqs: dict[int, tuple[float, float]] = field(default_factory=dict)
    _supply: dict[int, tuple[float, float]] = field(default_factory=dict)  # drafts given, drafts planned

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

    def offered(self, seq_id: int, planned: int, proposed: int) -> None:
        """The proposer gave ``proposed`` of the ``planned`` drafts (prompt lookup finds no match at times)."""
        if planned <= 0:
            return
        s, n = self._supply.get(seq_id, (0.0, 0.0))
        self._supply[seq_id] = (s * SEQ_DECAY + min(proposed, planned), n * SEQ_DECAY + planned)

    def supply(self, seq_id: int) -> float:
        """The share of planned drafts the proposer is expected to give the sequence (1 before any plan)."""
        s, n = self._supply.get(seq_id, (0.0, 0.0))
        return (s + SEQ_PRIOR_TRIALS) / (n + SEQ_PRIOR_TRIALS)

    def drop(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
        self._supply.pop(seq_id, None)


@dataclass
class DraftCost:
    """The proposer's seconds per draft step (a call's time over the most drafts it gave one sequence), a decayed
    mean over its calls. A draft model runs one step for the whole batch per draft token, at about the same cost
    whatever the batch (a small model is memory-bound), so a drafted token costs a step's time over the batch."""

    decay: float = 0.8
    _seconds: float = 0.0
    _steps: float = 0.0

    def observe(self, steps: int, seconds: float) -> None:
        if steps > 0:
            self._seconds = self._seconds * self.decay + max(0.0, seconds)
            self._steps = self._steps * self.decay + steps

    @property
    def seconds_per_step(self) -> float:
        return self._seconds / self._steps if self._steps else 0.0

    def per_token(self, batch: int) -> float:
        """Seconds one draft token costs in a step of ``batch`` decoding sequences."""
        return self.seconds_per_step / max(1, batch)


def choose_draft_lengths(rates: list[float], caps: list[int], a: float, b: float,
                         draft_s: float = 0.0, verify_s: float = 0.0,
                         supplies: list[float] | None = None) -> list[int]:
    """Draft tokens per decoding sequence that maximise expected tokens per second for a step of
    ``len(rates)`` decodes costing ``a + b * tokens``, each draft token also costing ``draft_s`` seconds to
    propose and the step ``verify_s`` more once it verifies any; all zeros where no draft pays (compute-bound
    steps, slow proposers, costly verification). ``supplies[i]`` (default 1) scales sequence i's expected
    gains: the share of its planned drafts its proposer is expected to deliver."""
    ks = [0] * len(rates)
    per_draft = b + draft_s
    expected, seconds = float(len(rates)), a + b * len(rates)
    if seconds <= 0:  # no decoding sequence, or no measured cost to weigh drafts against
        return ks
    plain = expected / seconds
    seconds += verify_s  # the plan below is a verifying step's
    supplies = supplies if supplies is not None else [1.0] * len(rates)
    heap = [(-r * w, i) for i, (r, cap, w) in enumerate(zip(rates, caps, supplies, strict=True))
            if cap > 0 and r > 0 and w > 0]
    heapq.heapify(heap)
    while heap:
        gain, i = -heap[0][0], heap[0][1]
        if any(ks) and (expected + gain) * seconds <= expected * (seconds + per_draft):  # (E + g) / (T + c) <= E / T
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


def probe_draft_lengths(rates: list[float], caps: list[int]) -> list[int]:
    """A probe step's draft lengths: the ``PROBE_SEQUENCES`` best-accepted sequences draft all they may."""
    best = sorted((i for i, cap in enumerate(caps) if cap > 0), key=lambda i: -rates[i])[:PROBE_SEQUENCES]
    return [caps[i] if i in best else 0 for i in range(len(caps))]
