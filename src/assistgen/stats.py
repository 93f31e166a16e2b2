"""Statistics of one generation, filled in by the generation loop.

Contract: plain counters and timers; every derived figure (acceptance rate, mean accepted length,
tokens per second) is a property computed from them, so nothing can drift out of step. The loop keeps updating a
generation's `Stats` step by step; `snapshot()` is a copy it no longer touches (what another thread is handed).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class Stats:
    mode: str = "plain"
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's tokens, those whose keys and values a kept cache held (not fed again)
    new_tokens: int = 0  # emitted (after stop truncation)
    steps: int = 0  # verification steps = target forward passes after the prefill (whose last gives the first token)
    draft_steps: int = 0  # verification steps that checked at least one draft token
    target_forward_passes: int = 0  # including the prefill
    draft_forward_passes: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accept_histogram: list[int] = field(default_factory=list)  # [k+1]: steps that accepted 0..k draft tokens
    position_checks: list[int] = field(default_factory=list)  # [k]: steps whose target judged draft position i+1
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str = ""
    exact: bool = True  # the target's `capabilities.exact`: False, greedy output may differ from plain decoding
    notes: dict = field(default_factory=dict)  # drafter-specific figures (universal mode: vocab intersection)

    @staticmethod
    def combined(parts: list[Stats]) -> Stats:
        """The counters of several generations added up (histograms position by position)."""
        out = Stats(mode=parts[0].mode if parts else "plain", exact=all(part.exact for part in parts))
        for part in parts:
            for name in ("prompt_tokens", "cached_tokens", "new_tokens", "steps", "draft_steps",
                         "target_forward_passes", "draft_forward_passes", "drafted_tokens", "accepted_tokens",
                         "prefill_s", "draft_s", "verify_s", "total_s"):
                setattr(out, name, getattr(out, name) + getattr(part, name))
            for name in ("accept_histogram", "position_checks"):
                mine, theirs = getattr(out, name), getattr(part, name)
                mine.extend([0] * (len(theirs) - len(mine)))
                for i, v in enumerate(theirs):
                    mine[i] += v
        return out

    def snapshot(self) -> Stats:
        """A copy that later steps do not change (its lists and notes copied too)."""
        return replace(self, accept_histogram=list(self.accept_histogram),
                       position_checks=list(self.position_checks), notes=dict(self.notes))

    def record_step(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.target_forward_passes += 1
        self.draft_steps += drafted > 0
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        if len(self.accept_histogram) <= drafted:
            self.accept_histogram.extend([0] * (drafted + 1 - len(self.accept_histogram)))
        self.accept_histogram[accepted] += 1
        judged = min(drafted, accepted + 1)  # positions 1..accepted were accepted, the next one (if any) rejected
        if len(self.position_checks) < judged:
            self.position_checks.extend([0] * (judged - len(self.position_checks)))
        for i in range(judged):
            self.position_checks[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens produced per verification step: 1 + accepted / steps (1.0 when the prefill's token was the only
        one, 0.0 when nothing was emitted)."""
        return 1.0 + self.accepted_tokens / self.steps if self.steps else float(self.new_tokens > 0)

    @property
    def decoded_tokens(self) -> int:
        """The tokens after the prefill's pass (which gives the first): those `total_s - prefill_s` produced."""
        return max(0, self.new_tokens - 1)

    @property
    def other_s(self) -> float:
        return max(0.0, self.total_s - self.prefill_s - self.draft_s - self.verify_s)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def summary(self) -> str:
        lines = [
            f"mode {self.mode}; finish: {self.finish_reason}",
            f"new tokens {self.new_tokens} in {self.total_s:.2f} s = {self.tokens_per_second:.1f} tok/s "
            f"(prompt {self.prompt_tokens} tokens, {self.cached_tokens} of them cached)",
            f"target forward passes {self.target_forward_passes} (prefill + {self.steps} steps); "
            f"draft forward passes {self.draft_forward_passes}",
            f"drafted {self.drafted_tokens}, accepted {self.accepted_tokens}: acceptance rate "
            f"{self.acceptance_rate:.1%}, mean accepted length {self.mean_accepted_length:.2f}",
            f"acceptance histogram (0..k accepted): {self.accept_histogram}",
            f"time: prefill {self.prefill_s:.2f} s, drafting {self.draft_s:.2f} s, verifying {self.verify_s:.2f} s, "
            f"other {self.other_s:.2f} s",
        ]
        lines += [f"{key.replace('_', ' ')}: {value}" for key, value in self.notes.items()]
        if not self.exact:
            lines.append("exact: no (this model's passes are not row-exact: greedy output may differ from plain "
                         "decoding)")
        return "\n".join(lines)
