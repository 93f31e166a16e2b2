"""How many of each draft one step verifies: the one optimizer, for one sequence or a batch.

Contract: `verified_lengths(runs, drafts, drafter_names, rooms, costs, prefill_rows)` returns, for each decoding
sequence of a step, how many of its draft's tokens the step feeds the target: `gain.lookahead` over the runs'
acceptance estimates (`ScheduleRun.rates`) and the step's pricing `costs` (the prompt rows in the pass counted);
a run without an estimate (a fixed rule) verifies its whole draft; never more than a sequence's room.
"""

from __future__ import annotations

from assistgen.policy.gain import lookahead
from assistgen.spec.costs import PassCosts
from assistgen.spec.drafts import Draft
from assistgen.spec.steps import ScheduleRun


def verified_lengths(runs: list[ScheduleRun], drafts: list[Draft], drafter_names: list[str], rooms: list[int],
                     costs: PassCosts | None, prefill_rows: int = 0) -> list[int]:
    """How many of each draft one step verifies: `gain.lookahead`, the one optimizer, for one sequence or a batch,
    priced with `costs` (the step's: `prefill_rows` prompt rows are in the pass too) and the runs' acceptance
    estimates; a run without one (a fixed rule) verifies its whole draft. Never more than a sequence's room."""
    rates = [run.rates(d, name) for run, d, name in zip(runs, drafts, drafter_names, strict=True)]
    drafted = [len(d.tokens) for d in drafts]
    if costs is None or all(r is None for r in rates):
        chosen = drafted
    else:
        sequences, base = len(drafts) + (1 if prefill_rows else 0), len(drafts) + prefill_rows
        near_end = any(room <= d for room, d in zip(rooms, drafted, strict=True))  # (the end rule's curve, only
        # where a draft could finish its sequence: most steps need no curve past MAX_K)
        chosen = lookahead(rates, drafted, lambda rows: costs.batch(sequences, base, rows - base), base,
                           rooms=rooms if near_end else None, curve=costs.extended(max(drafted)) if near_end else ())
    return [max(0, min(n, room)) for n, room in zip(chosen, rooms, strict=True)]
