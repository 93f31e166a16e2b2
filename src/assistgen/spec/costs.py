"""What a forward pass costs: the value the loop, the drafters and the policy price steps with, below all of them.

Contract: `PassCosts` is one model's cost of one forward pass, in plain steps t(1) (the time of a pass over one new
token): `curve[k] = t(k+1) / t(1)` (v[k] in `policy.gain`; a step that verifies k draft tokens feeds k+1 rows, so it
costs v[k] plain steps, v[0] = 1), the cost of wider passes (`points`, `rows(n)`: linear between the row counts
measured and past the last), and of batched passes over several sequences (`sequence`: each further sequence's own
attention; `batch_row`: each further draft row; `batch(...)`). It is a frozen value: made from a measurement's saved
record (`of`) or from a curve given by hand (`from_curve`), it never measures and never changes. Who measures it,
when, and where it is kept is `policy.costs`'s (the cost book); `plain_seconds` reads the plain-step time a record
carries.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PassCosts:
    """A model's measured cost of one forward pass, in plain steps t(1)."""

    curve: tuple[float, ...]  # v[0..MAX_K]: one sequence verifying k draft tokens (k + 1 rows)
    points: tuple[tuple[int, float], ...]  # (rows, t(rows) / t(1)) of one sequence, rows ascending
    sequence: float  # each further sequence in a batched pass (its own attention)
    batch_row: float  # each further draft row in a batched pass
    record: dict = field(default_factory=dict, compare=False)  # the measurement as saved (step seconds, date)

    @classmethod
    def of(cls, record: dict) -> PassCosts:
        curve = tuple(record["verification_costs"])
        points = list(enumerate(curve, start=1))
        points += [(n, c) for n, c in zip(record["wide_rows"], record["wide_costs"], strict=True) if n > len(points)]
        return cls(curve, tuple(points), record["sequence_cost"], record["batch_row_cost"], record)

    @classmethod
    def from_curve(cls, curve: list[float], like: PassCosts | None = None) -> PassCosts:
        """A given curve v[0..k] (e.g. `Adaptive(curve=...)`), with `like`'s batch costs (none given: a further
        sequence costs nothing, a further draft row the curve's mean slope)."""
        curve = tuple(float(c) for c in curve)
        slope = (curve[-1] - curve[0]) / max(1, len(curve) - 1)
        return cls(curve, tuple(enumerate(curve, start=1)), like.sequence if like else 0.0,
                   like.batch_row if like else slope)

    def rows(self, rows: int) -> float:
        """One sequence, `rows` new tokens: the curve, linear between measured row counts and past the last."""
        if 1 <= rows <= len(self.curve):  # (the first points are the curve's: read, not searched, each step)
            return self.curve[rows - 1]
        points = self.points
        for (n0, c0), (n1, c1) in zip(points, points[1:], strict=False):
            if rows == n1:
                return c1
            if rows < n1:
                return c0 + (c1 - c0) * (rows - n0) / (n1 - n0) if rows > n0 else c0
        if len(points) == 1:
            return points[0][1] * rows
        (n0, c0), (n1, c1) = points[-2], points[-1]
        return c1 + (c1 - c0) * (rows - n1) / (n1 - n0)

    def extended(self, k: int) -> tuple[float, ...]:
        """v[0..k]: the curve, and past its end (a copy longer than MAX_K) one sequence's `rows` (the wide passes'
        measured costs, linear between them)."""
        return self.curve[: k + 1] + tuple(self.rows(n + 1) for n in range(len(self.curve), k + 1))

    def batch(self, sequences: int, rows: int, draft_rows: int = 0) -> float:
        """`sequences` sequences with `rows` rows in all (one per decoding sequence, prompt chunks) and `draft_rows`
        draft rows besides: the rows' cost, plus each further sequence's own attention and each draft row at their
        measured batch costs. One sequence: its curve."""
        if sequences <= 1:
            return self.rows(rows + draft_rows)
        return self.rows(rows) + (sequences - 1) * self.sequence + draft_rows * self.batch_row


def plain_seconds(costs: PassCosts | None) -> float | None:
    """The measured plain-step time t(1) in seconds (the record's), None for costs not measured in seconds."""
    seconds = costs.record.get("step_seconds") if costs is not None else None
    return seconds[0] if seconds else None
