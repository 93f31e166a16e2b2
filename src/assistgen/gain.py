"""The expected speed-up of speculative decoding, written once: the policy, the benchmark report,
early exit's calibration and the lookup-ceiling replay all import it.

Contract: pure functions of numbers; this module knows nothing of models, timers or schedules.
Vocabulary (Leviathan et al. 2023, with a measured verification cost instead of a constant one):
    rates[i]  P(draft token i+1 accepted | draft tokens 1..i accepted); one constant acceptance
              rate a is `[a]` (the last rate holds for every later position);
    v[k]      the target's verification cost: a step that verifies k draft tokens feeds k+1 tokens
              and costs v[k] plain steps, v[k] = t(k+1) / t(1), v[0] = 1 (`costs.py` measures it);
    c         a drafter's cost per proposed token, in plain steps.
A step that verifies k draft tokens emits E(k) = 1 + sum_{i=1..k} prod_{j<=i} rates[j-1] tokens
(the accepted ones and the target's own) and costs k*c + v[k] plain steps, so it produces
E(k) / (k*c + v[k]) tokens per unit of time relative to plain decoding (`expected_gain`; 1 at k = 0).
For a batch of sequences verified in one forward pass, `batch_lookahead` picks each one's k for the whole
step: the step costs t(N) for its N rows in all (t(n) / t(1) given as a function), and emits the sum
of the sequences' E(k_i).
A fractional k (a mean lookahead) is the mix of its two neighbouring integers with that mean: E and
the cost are interpolated linearly between them. `MAX_K` is the most draft tokens any step verifies.
"""

from __future__ import annotations

import math

MAX_K = 16  # the most draft tokens verified in one step: the cost curve is measured for k = 0..MAX_K


def expected_tokens(rates: list[float], k: float) -> float:
    """E(k): tokens one step emits when it verifies k draft tokens."""
    low = math.floor(k)
    total, chain = 1.0, 1.0
    for i in range(low):
        chain *= rates[min(i, len(rates) - 1)]
        total += chain
    if k == low:
        return total
    return total + (k - low) * chain * rates[min(low, len(rates) - 1)]  # mixed with E(low + 1)


def step_cost(costs: list[float], k: float, c: float = 0.0) -> float:
    """k*c + v[k]: what a step verifying k draft tokens costs, in plain steps (k within the curve)."""
    low = math.floor(k)
    v = costs[low] if k == low else costs[low] + (k - low) * (costs[low + 1] - costs[low])
    return k * c + v


def expected_gain(rates: list[float], k: float, costs: list[float], c: float = 0.0) -> float:
    """Expected tokens per unit of time relative to plain decoding: E(k) / (k*c + v[k])."""
    return expected_tokens(rates, k) / step_cost(costs, k, c)


def best_draft_length(rates: list[float], costs: list[float], c: float, k_max: int) -> tuple[int, float]:
    """The k in 1..k_max (and within the curve) with the highest expected gain, and that gain, even
    below 1; ties go to the smaller k; (0, 0.0) when no k >= 1 is possible."""
    best, best_gain = 0, 0.0
    for k in range(1, min(k_max, len(costs) - 1) + 1):
        gain = expected_gain(rates, k, costs, c)
        if gain > best_gain:
            best, best_gain = k, gain
    return best, best_gain


def best_lookahead(rates: list[float], costs: list[float], c: float, k_max: int) -> tuple[int, float]:
    """The k in 0..k_max with the highest expected gain; k = 0 (plain decoding, gain 1) unless drafting beats it."""
    k, gain = best_draft_length(rates, costs, c, k_max)
    return (k, gain) if gain > 1.0 else (0, 1.0)


def batch_lookahead(rates: list[list[float]], limits: list[int], cost, fixed_rows: int) -> list[int]:
    """Each sequence's k_i <= limits[i] maximising the step's tokens per unit of time, sum E_i(k_i) / cost(N), where
    N = fixed_rows (every other row of the step, each sequence's own last token included) + sum k_i, and
    cost(n) = t(n) / t(1). A sequence's j-th draft token adds E_i(j) - E_i(j-1) = prod_{l<j} rates_i[l] expected
    tokens, which shrinks with j; taking draft tokens in order of what they add (ties: earlier sequences first),
    the best prefix of that order wins (ties to fewer rows), so a step is never planned slower per token than
    verifying no draft at all."""
    adds = []  # (expected tokens it adds, sequence) for every draft token that could be verified
    for i, (r, limit) in enumerate(zip(rates, limits, strict=True)):
        chain = 1.0
        for j in range(limit):
            chain *= r[min(j, len(r) - 1)]
            adds.append((chain, i))
    order = sorted(range(len(adds)), key=lambda a: -adds[a][0])  # stable: a sequence's tokens stay in order
    tokens = float(len(rates))
    best, best_rate = 0, tokens / cost(fixed_rows)
    for n, a in enumerate(order, start=1):
        tokens += adds[a][0]
        rate = tokens / cost(fixed_rows + n)
        if rate > best_rate:
            best, best_rate = n, rate
    k = [0] * len(rates)
    for a in order[:best]:
        k[adds[a][1]] += 1
    return k
