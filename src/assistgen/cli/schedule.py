"""The command line's form of a schedule: 'adaptive', 'adaptive:MAX_K[:ALTERNATIVES]', 'constant:K', 'heuristic',
'confidence:K:T'.

Contract: `parse_schedule(text)` returns the schedule (settings) the text names, or raises ValueError naming the
forms it takes (`schedule_argument`: the same as an argparse type, its error shown as it is). The library takes
schedule objects (`assistgen.Adaptive`, `Constant`, `Heuristic`, `confidence`); this text form is for `--schedule`
and `assistgen bench`'s `METHOD@SCHEDULE`.
"""

from __future__ import annotations

import argparse

from assistgen.policy.adaptive import Adaptive
from assistgen.policy.rules import Constant, Heuristic, confidence
from assistgen.spec.steps import Schedule


def parse_schedule(text: str) -> Schedule:
    """'adaptive', 'adaptive:MAX_K', 'adaptive:MAX_K:ALTERNATIVES', 'constant:K', 'heuristic', 'confidence:K:T'
    (CLI form)."""
    name, *args = text.split(":")
    try:
        if name == "adaptive":
            settings = {"max_k": int(args[0]), "long_k": int(args[0])} if args and args[0] else {}  # caps copies too
            if len(args) > 1:
                settings["alternatives"] = int(args[1])
            return Adaptive(**settings)
        if name == "constant":
            return Constant(k=int(args[0]) if args else 5)
        if name == "heuristic":
            return Heuristic()
        if name == "confidence":
            return confidence(int(args[0]) if args else 10, float(args[1]) if len(args) > 1 else 0.4)
    except (ValueError, IndexError) as e:
        raise ValueError(f"bad schedule {text!r}: {e}") from e
    raise ValueError(f"unknown schedule {text!r}; use adaptive[:MAX_K[:ALTERNATIVES]], constant:K, heuristic or "
                     "confidence:K:T")


def schedule_argument(text: str) -> Schedule:
    """`--schedule`'s value, its error shown by argparse as it is (`parse_schedule` names the forms it takes)."""
    try:
        return parse_schedule(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
