"""The target's pass costs as its passes run: one fit of t(n), from which the step is priced and drafters timed.

Contract: `OnlineCosts(measured, decay)` follows a generation's passes (`observe(shape, seconds)`: the pass's
(sequences, rows, draft rows) and its time) with one model of a pass's time,
    t = a + b * x,    x = the measured cost of the pass's shape in measured plain steps (`PassCosts.batch`),
fitted by least squares over the recent passes (each older one weighing `decay` times less), its slope b drawn
towards the measured plain-step time t(1) with the weight of one row's spread (`ridge`): while the passes' rows do
not spread, the fit reads the passes' extra time as a fixed cost per pass (a = mean t - t(1) mean x); once they do,
the slope is the passes' own (a pass that also costs more per row than measured is priced so). A fixed cost is never
negative: where the line would cross zero above one row (recent passes all wide, their noise tilting it), it is
fitted through the origin. Then
    unit_s()    the time of a plain step now (a + b), in which drafters' times are counted;
    fixed()     the fixed cost per pass beyond one plain step's worth, in steps of b (f = max(0, a / b - 1));
                below that the measured curve stands (noise, or a machine uniformly slower, changes no choice);
    costs()     the measured costs with that fixed cost in every pass: v'[k] = (v[k] + f) / (1 + f), and a further
                sequence's or batched draft row's cost shrunk by 1 / (1 + f) (`with_fixed_cost`).
Where the measured costs carry no seconds (a curve given by hand), b is fitted alone (t = b x) and the curve stands.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from assistgen.spec.costs import PassCosts, plain_seconds


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
    _priced: PassCosts | None = field(default=None, init=False)

    def observe(self, shape: tuple[int, int, int], seconds: float) -> None:
        """One pass over `shape` (sequences, rows, draft rows) that took `seconds`."""
        x = self.measured.batch(*shape)
        self.sums = [self.decay * s for s in self.sums]
        for i, value in enumerate((1.0, x, x * x, seconds, x * seconds)):
            self.sums[i] += value
        self._fit = self._priced = None

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
                a = mt - b * mx
                if a < 0:  # (no pass has a negative fixed cost: wide passes' noise tilted the line, whose value at
                    # few rows would fall below 0, even below 0 at one: fitted through the origin instead, t = b x)
                    a, b = 0.0, max(1e-3 * t1, (xt + lam * t1) / (xx + lam))
                self._fit = (a, b)
        return self._fit

    def unit_s(self) -> float | None:
        """The time of a plain step now, by the fit (None before any pass)."""
        fit = self.fit()
        return None if fit is None else max(sum(fit), 1e-12)

    def fixed(self) -> float:
        fit = self.fit()
        if fit is None or fit[1] <= 0 or plain_seconds(self.measured) is None:
            return 0.0
        a, b = fit
        return max(0.0, a / b - 1.0)

    def costs(self) -> PassCosts:
        if self._priced is None:
            self._priced = with_fixed_cost(self.measured, self.fixed())
        return self._priced
