"""The expected speed-up of speculative decoding, and the one lookahead optimizer, written once: the
policy, the generation loop, the benchmark report, early exit's calibration and the lookup-ceiling replay
all import it.

Contract: pure functions of numbers; this module knows nothing of models, timers or schedules.
Vocabulary (Leviathan et al. 2023, with a measured verification cost instead of a constant one):
    rates[i]  P(draft token i+1 accepted | draft tokens 1..i accepted); one constant acceptance
              rate a is `[a]` (the last rate holds for every later position);
    curve     the target's verification cost v: a step that verifies k draft tokens feeds k+1 tokens
              and costs v[k] plain steps, v[k] = t(k+1) / t(1), v[0] = 1 (`costs.py` measures it);
    c         a drafter's cost per proposed token, in plain steps.
A step that verifies k draft tokens emits E(k) = 1 + sum_{i=1..k} prod_{j<=i} rates[j-1] tokens
(the accepted ones and the target's own) and costs k*c + v[k] plain steps (plus, for a model drafter whose first
pass also feeds the tokens it has not seen, that pass's extra rows: `first`), so it produces
E(k) / (k*c + v[k]) tokens per unit of time relative to plain decoding (`expected_gain`; 1 at k = 0).
`lookahead` decides how many draft tokens each sequence of a step verifies, for one sequence or a
batch alike: the step costs cost(N) for its N rows in all, and emits the sum of the sequences' E(k_i);
near a sequence's end it verifies every usable draft token when that finishes it sooner
(`finishing_pays`). Under passes that cost about the same for 1 and 17 rows, a step may also verify other
drafts beside a sequence's own, each in a fork of its cache, and keep the one accepted furthest:
`reach` gives P(at least i tokens of a draft accepted), and `alternative_gain` what another draft adds to the
expected tokens of those already verified. A fractional k (a mean lookahead) is the mix of its two neighbouring integers
with that mean: E and the cost are interpolated linearly between them. `MAX_K` is the most draft
tokens any step verifies.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from assistgen.backends.base import LONG_K, MAX_K  # noqa: F401 - re-exported: the most draft tokens a step verifies


def expected_tokens(rates: list[float], k: float) -> float:
    """E(k): tokens one step emits when it verifies k draft tokens."""
    low = math.floor(k)
    chains = reach(rates, low)
    total, chain = 1.0 + sum(chains), chains[-1] if chains else 1.0
    if k == low:
        return total
    return total + (k - low) * chain * rates[min(low, len(rates) - 1)]  # mixed with E(low + 1)


def step_cost(curve: list[float], k: float, c: float = 0.0, first: float = 0.0) -> float:
    """k*c + v[k] (+ `first` when k > 0: what a drafter's first pass costs beyond c, e.g. the rows it must feed
    before drafting): what a step verifying k draft tokens costs, in plain steps (k within the curve)."""
    low = math.floor(k)
    v = curve[low] if k == low else curve[low] + (k - low) * (curve[low + 1] - curve[low])
    return k * c + v + (first if k > 0 else 0.0)


def expected_gain(rates: list[float], k: float, curve: list[float], c: float = 0.0, first: float = 0.0) -> float:
    """Expected tokens per unit of time relative to plain decoding: E(k) / (k*c + v[k] + first)."""
    return expected_tokens(rates, k) / step_cost(curve, k, c, first)


def best_draft_length(rates: list[float], curve: list[float], c: float, k_max: int,
                      first: float = 0.0) -> tuple[int, float]:
    """The k in 1..k_max (and within the curve) with the highest expected gain, and that gain, even
    below 1; ties go to the smaller k; (0, 0.0) when no k >= 1 is possible."""
    best, best_gain = 0, 0.0
    for k in range(1, min(k_max, len(curve) - 1) + 1):
        gain = expected_gain(rates, k, curve, c, first)
        if gain > best_gain:
            best, best_gain = k, gain
    return best, best_gain


def best_lookahead(rates: list[float], curve: list[float], c: float, k_max: int,
                   first: float = 0.0) -> tuple[int, float]:
    """How many tokens to ask one drafter costing c per token (and `first` more for its first pass) for: the k in
    0..k_max with the highest expected gain; k = 0 (plain decoding, gain 1) unless drafting beats it."""
    k, gain = best_draft_length(rates, curve, c, k_max, first)
    return (k, gain) if gain > 1.0 else (0, 1.0)


def lookahead(rates: list[list[float] | None], drafted: list[int], cost: Callable[[int], float], fixed_rows: int,
              rooms: list[int | None] | None = None, curve: list[float] | tuple[float, ...] = ()) -> list[int]:
    """How many of its `drafted[i]` draft tokens each sequence of one step verifies (drafting is paid already).

    The step's cost is cost(N) = t(N) / t(1) for its N rows in all: `fixed_rows` (every other row of the step,
    each sequence's own last token included) plus the verified draft tokens; it emits sum E_i(k_i). A sequence
    whose `rates[i]` is None (a fixed rule) verifies its whole draft. For the others, a sequence's j-th draft
    token adds E_i(j) - E_i(j-1) = prod_{l<j} rates_i[l] expected tokens, which shrinks with j; taking draft
    tokens in order of what they add (ties: earlier sequences first), the best prefix of that order wins (ties
    to fewer rows), so a step is never planned slower per token than verifying no draft at all. For one
    sequence that is the k maximising E(k) / v[k]. Then, near its end (`rooms[i]`: the draft tokens it can
    still use, when its whole draft is that long), a sequence verifies them all when `finishing_pays` on its own
    `curve` (v[k], given with `rooms`)."""
    n = len(rates)
    k = [d if r is None else 0 for r, d in zip(rates, drafted, strict=True)]
    fixed_rows += sum(k)
    adds = []  # (expected tokens it adds, sequence) for every draft token that could be verified
    for i, (r, limit) in enumerate(zip(rates, drafted, strict=True)):
        if r is None:
            continue
        chain = 1.0
        for j in range(limit):
            chain *= r[min(j, len(r) - 1)]
            adds.append((chain, i))
    order = sorted(range(len(adds)), key=lambda a: -adds[a][0])  # stable: a sequence's tokens stay in order
    tokens = float(n)
    best, best_rate = 0, tokens / cost(fixed_rows)
    for m, a in enumerate(order, start=1):
        tokens += adds[a][0]
        rate = tokens / cost(fixed_rows + m)
        if rate > best_rate:
            best, best_rate = m, rate
    for a in order[:best]:
        k[adds[a][1]] += 1
    if rooms is not None:
        for i, (r, room) in enumerate(zip(rates, rooms, strict=True)):
            if r is not None and room is not None and k[i] < room <= drafted[i]:
                gain = expected_gain(r, k[i], curve) if k[i] else 1.0
                if finishing_pays(r, curve, k[i], gain, room):
                    k[i] = room
    return k


def finishing_pays(rates: list[float], curve: list[float], k: int, gain: float, room: int) -> bool:
    """Near the end of a generation, whether verifying all `room` usable draft tokens (which ends it
    if all are accepted) is expected to finish sooner than the best per-step choice `k`.

    Expected time to the end, in plain steps: this step's verification, then the tokens still
    missing at the best rate `gain` per step, but at least one more step for whatever is left.
    """
    wanted = room + 1  # tokens until the generation ends

    def time_to_finish(n: int) -> float:
        left = max(0.0, wanted - expected_tokens(rates, n))
        return step_cost(curve, min(n, len(curve) - 1)) + (max(left / gain, min(left, 1.0)) if left > 1e-9 else 0.0)

    return time_to_finish(room) <= time_to_finish(k)


def reach(rates: list[float], k: int) -> list[float]:
    """P(at least i of a draft's first k tokens are accepted), for i = 1..k: the chain of `rates`."""
    out, chain = [], 1.0
    for i in range(k):
        chain *= rates[min(i, len(rates) - 1)]
        out.append(chain)
    return out


def alternative_gain(best: list[float], other: list[float], shared: int = 0) -> float:
    """The expected tokens another draft adds to a step that already verifies drafts whose longest accepted run
    reaches i tokens with probability best[i-1]: E[max] - E[best's], the two taken as independent past the `shared`
    tokens the other draft begins with (its first `shared` tokens are those of a draft already verified, so they
    add nothing). `other`: its own `reach`."""
    return sum(merged_reach(best, other, shared)) - sum(best)


def merged_reach(best: list[float], other: list[float], shared: int = 0) -> list[float]:
    """`best` once `other` is verified too: at each length, reached by either (independent past `shared`)."""
    size = max(len(best), len(other))
    out = []
    for i in range(size):
        b = best[i] if i < len(best) else 0.0
        o = other[i] if i < len(other) and i >= shared else 0.0
        out.append(1.0 - (1.0 - b) * (1.0 - o))
    return out
