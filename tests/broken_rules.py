"""Deliberately wrong verification rules, shared by the exact and the chi-squared tests to show they can fail."""

from __future__ import annotations


def broken_residual_from_p(p, q, draft, sampler):
    """A classic bug: on rejection draw from p instead of the residual norm(max(p - q, 0))."""
    for i, x in enumerate(draft):
        if sampler.uniform() < min(1.0, float(p[i, x]) / float(q[i, x])):
            continue
        return i, sampler.draw(p[i])
    return len(draft), sampler.draw(p[len(draft)])
