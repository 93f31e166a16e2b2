"""Admission: what a request needs checked and prepared before it joins the loop, done once per request.

Contract: `admit(target, prompt_ids, config, drafter_context)` finds, once, everything about a request that does not
change while it runs: the context it may grow to (`context_limit`: the target's and its drafter's, the shorter), the
room its prompt leaves, the prompt's check (`check_prompt`: not empty, shorter than the context, every id in the
target's vocabulary; a `PromptError`), its EOS tokens and, under a structure, its grammar compiled for the target's
tokenizer and those EOS tokens (`constraint.compiled`: a ConfigError naming what does not compile). The
`Admission` it returns is what `engine.begin` starts a generation from; nothing there checks or compiles again. It
runs on the caller's thread (the serving engine's `submit`: a bad request is refused there, never on the engine
thread) and reads no state of a running generation, so it may run beside the loop. The config checked itself when it
was built (`GenerationConfig.__post_init__`).
"""

from __future__ import annotations

from dataclasses import dataclass

from assistgen.backends.base import LanguageModel
from assistgen.config import ConfigError, GenerationConfig
from assistgen.core.constraint import Grammar, compiled

UNBOUNDED = 1 << 62  # the context of a target and drafter that declare none


class PromptError(ConfigError):
    """The prompt itself cannot run: empty, as long as the context or longer, or with ids outside the vocabulary."""


@dataclass(frozen=True)
class Admission:
    """One request, admitted: its prompt and config, and what was found from them once."""

    prompt_ids: list[int]
    config: GenerationConfig
    context: int  # the longest the sequence may grow (the target's context and its drafter's)
    eos: frozenset[int]  # the tokens that end it (the config's, else the target's)
    grammar: Grammar | None = None  # config.structure compiled for the target with `eos`; None: free text

    @property
    def room(self) -> int:
        """Positions the prompt leaves in the context for new tokens."""
        return self.context - len(self.prompt_ids)


def admit(target: LanguageModel, prompt_ids: list[int], config: GenerationConfig,
          drafter_context: int | None = None) -> Admission:
    """The request checked and prepared for `target` and a drafter whose context is `drafter_context` (None: no
    bound of its own); raises PromptError (the prompt) or ConfigError (a structure that does not compile)."""
    context = context_limit(target, drafter_context)
    check_prompt(prompt_ids, target, context)
    check_token_ids(config, target.vocab_size)
    eos = frozenset(config.eos_token_ids if config.eos_token_ids is not None else target.eos_token_ids)
    grammar = None if config.structure is None else compiled(target, config.structure, eos)
    return Admission(list(prompt_ids), config, context, eos, grammar)


def check_token_ids(config: GenerationConfig, vocab: int) -> None:
    """logit_bias's and bad_words' token ids must be the model's (ConfigError naming the first that is not)."""
    for name, ids in (("logit_bias", [t for t, _ in config.logit_bias]),
                      ("bad_words", [t for word in config.bad_words for t in word])):
        outside = [t for t in ids if t >= vocab]
        if outside:
            raise ConfigError(f"{name}: token id {outside[0]} is not in the model's vocabulary (0 to {vocab - 1}).")


def context_limit(target: LanguageModel, drafter_context: int | None) -> int:
    """The longest a sequence may grow: the shorter of the target's and the drafter's declared contexts."""
    limits = [c for c in (target.context_length, drafter_context) if c]
    return min(limits) if limits else UNBOUNDED


def check_prompt(prompt_ids: list[int], target: LanguageModel, context: int) -> None:
    if len(prompt_ids) == 0:
        raise PromptError("The prompt is empty: give at least one token of text.")
    if len(prompt_ids) >= context:
        raise PromptError(
            f"The prompt has {len(prompt_ids)} tokens but the context length is {context}: "
            "shorten the prompt so that at least one new token fits."
        )
    vocab = target.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise PromptError(f"Prompt token ids {bad[:5]} are outside the model's vocabulary (0..{vocab - 1}).")
