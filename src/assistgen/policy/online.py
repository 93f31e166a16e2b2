"""The target's pass costs as its passes run: one fit of t(n), from which the step is priced and drafters timed.

Contract: `OnlineCosts(measured, decay)` follows a generation's passes (`observe(shape, seconds, context)`: the
pass's (sequences, rows, draft rows), its time, and the tokens before it) with one model of a pass's time,
    t = a + b * x,    x = the measured cost of the pass's shape at its context, in measured plain steps
                      (`PassCosts.at`, `batch`, `unit_at`),
fitted by least squares over the recent passes (each older one weighing `decay` times less), its slope b drawn
towards the measured plain-step time t(1) with the weight of one row's spread (`ridge`): while the passes' rows do
not spread, the fit reads the passes' extra time as a fixed cost per pass (a = mean t - t(1) mean x); once they do,
the slope is the passes' own (a pass that also costs more per row than measured is priced so). Then
    unit_s(c)   the time of a plain step after c tokens (a + b unit_at(c)), in which drafters' times are counted;
    fixed()     the fixed cost per pass beyond one plain step's worth, in steps of b (f = max(0, a / b - 1));
                below that the measured curve stands (noise, or a machine uniformly slower, changes no choice);
    costs(c)    the measured costs at c with that fixed cost in every pass: v'[k] = (v[k] + f) / (1 + f), and a further
                sequence's or batched draft row's cost shrunk by 1 / (1 + f) (`with_fixed_cost`).
Where the measured costs carry no seconds (a curve given by hand), b is fitted alone (t = b x) and the curve stands.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from assistgen.spec.costs import CONTEXT_BUCKET, PassCosts, plain_seconds


def with_fixed_cost(costs: PassCosts, f: float) -> PassCosts:
    """`costs` when every pass also takes a fixed f measured plain steps: (v + f) / (1 + f) for the curve and the
    wider points, a further sequence's or draft row's cost scaled by 1 / (1 + f)."""
    if f <= 0:
        return costs
    scale = 1.0 / (1.0 + f)
    return PassCosts(tuple((v + f) * scale for v in costs.curve), tuple((n, (v + f) * scale) for n, v in costs.points),
                     costs.sequence * scale, costs.batch_row * scale, costs.record)


@dataclass
class OnlineCosts:
    measured: PassCosts
    decay: float = 0.8
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # weight, x, x^2, t, x*t (decayed)
    _fit: tuple[float, float] | None = field(default=None, init=False)
    _priced: dict = field(default_factory=dict, init=False)  # costs() by context bucket, until the next pass

    def observe(self, shape: tuple[int, int, int], seconds: float, context: int = 0) -> None:
        """One pass over `shape` (sequences, rows, draft rows), after `context` tokens, that took `seconds`."""
        x = self.measured.at(context).batch(*shape) * self.measured.unit_at(context)
        self.sums = [self.decay * s for s in self.sums]
        for i, value in enumerate((1.0, x, x * x, seconds, x * seconds)):
            self.sums[i] += value
        self._fit = None
        self._priced.clear()

    @property
    def ridge(self) -> float:
        """The spread of x, per pass, that weighs as much as the prior slope: one row's, (v[-1] - 1) / (len(v) - 1)
        squared."""
        curve = self.measured.curve
        return ((curve[-1] - curve[0]) / max(1, len(curve) - 1)) ** 2

    def fit(self) -> tuple[float, float] | None:
        """(a, b) of t = a + b x, or None before any pass."""
        if self._fit is None:
            w, x, xx, t, xt = self.sums
            if w <= 0:
                return None
            mx, mt = x / w, t / w
            sxx, sxt = xx - w * mx * mx, xt - w * mx * mt  # (weighted sums of squares about the means)
            t1 = plain_seconds(self.measured)
            if t1 is None:
                self._fit = (0.0, xt / xx)
            else:
                lam = w * self.ridge
                b = max(1e-3 * t1, (sxt + lam * t1) / (max(0.0, sxx) + lam)) if sxx + lam > 0 else t1
                self._fit = (mt - b * mx, b)
        return self._fit

    def unit_s(self, context: int = 0) -> float | None:
        """The time of a plain step after `context` tokens, by the fit (None before any pass)."""
        fit = self.fit()
        return None if fit is None else max(fit[0] + fit[1] * self.measured.unit_at(context), 1e-12)

    def fixed(self) -> float:
        fit = self.fit()
        if fit is None or fit[1] <= 0 or plain_seconds(self.measured) is None:
            return 0.0
        a, b = fit
        return max(0.0, a / b - 1.0)

    def costs(self, context: int = 0) -> PassCosts:
        """The measured costs at `context` (`PassCosts.at`) with the fixed cost per pass, in plain steps there."""
        bucket = context // CONTEXT_BUCKET
        priced = self._priced.get(bucket)
        if priced is None:
            priced = self._priced[bucket] = with_fixed_cost(self.measured.at(context),
                                                            self.fixed() / self.measured.unit_at(context))
        return priced
