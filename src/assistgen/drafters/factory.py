"""What a server makes its requests' drafters with, and what it knows of them before it makes one.

Contract: a `DrafterFactory` makes a fresh drafter per request (`factory(**given)`: drafters hold per-request state,
caches and estimates; `given` are the options a request's own drafter changes, e.g. its API key's n-gram cache) and
declares, without making one, what a server's start-up needs: `models`, the backend models its drafters run besides
the target (an assistant: the serving engine measures their pass costs while idle), and `context_length`, the
shortest context among its drafters (None: none bounds the sequence), from which every request's context is found at
admission. `api.drafter_factory` builds one from the drafting options; `DrafterFactory.of` takes a plain callable
too, which declares nothing, so one drafter it makes is read once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from assistgen.drafters.base import drafters_of
from assistgen.spec.drafts import Drafter


@dataclass(frozen=True)
class DrafterFactory:
    make: Callable[..., Drafter]
    models: tuple = ()  # backend models its drafters run, besides the target (`backends.base.LanguageModel`)
    context_length: int | None = None  # the shortest context of its drafters; None: unbounded

    def __call__(self, **given) -> Drafter:
        return self.make(**given)

    @classmethod
    def of(cls, make: DrafterFactory | Callable[..., Drafter]) -> DrafterFactory:
        """`make` when it is a factory; a plain callable declares nothing, so the drafter it makes first is read (a
        drafter that cannot be made now declares nothing: its requests fail with its message)."""
        if isinstance(make, DrafterFactory):
            return make
        try:
            drafter = make()
        except Exception:  # noqa: BLE001
            return cls(make)
        models = tuple(d.model for d in drafters_of(drafter) if d.model is not None)
        return cls(make, models, drafter.context_length)
