"""The grammar as a drafter: the continuation a grammar forces, proposed for the target to verify.

Contract: `GrammarDrafter(constraint)` proposes, after the tokens emitted so far, the tokens of the string
that the generation's grammar (`core.constraint.Constraint`) forces from its state: the rest of a JSON key,
its quotes and colon, a closing bracket. They are a draft like any other, q one-hot, verified by the masked
target, because the model's own tokenization of a forced string can differ from the longest-match one
proposed; the grammar's state is the generation's, kept in step by the loop, so this drafter holds nothing
of its own. The loop puts it first, ahead of the user's drafters, whenever the output is constrained.
"""

from __future__ import annotations

from assistgen.core.constraint import Constraint
from assistgen.spec.drafts import Draft, Drafter
from assistgen.spec.sampling import Sampler


class GrammarDrafter(Drafter):
    name = "grammar"
    context_length = None
    model = None
    acceptance_prior = None

    def __init__(self, constraint: Constraint):
        self.constraint = constraint

    def propose(self, ids: list[int], k: int, sampler: Sampler, min_confidence: float = 0.0) -> Draft:
        return Draft(self.constraint.jump_forward()[:k])
