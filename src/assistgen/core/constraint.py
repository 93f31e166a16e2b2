"""Grammar-constrained decoding under speculation, through xgrammar.

Contract: `Constraint.begin(target, structure, eos)` compiles a `config.Structure` for the target's tokenizer
(a spec that does not compile raises ConfigError naming the problem) and holds one generation's grammar
state, which always stands after the tokens emitted so far. Each step the loop calls:
    check(draft) -> (m, forbidden)   how many leading draft tokens the grammar allows, and the token after
                             them that it forbids (None when there is none, or when token m ended the
                             structure with an EOS); it fills the masks of the m + 1 positions that
                             verifying them reads (rows 0..m) and rolls itself back;
    mask(logits)             logits [n+1, vocab], n <= m -> a copy with every token the grammar forbids at
                             each position set to -inf, so that greedy and sampled choices (and logprobs)
                             come from the masked target distribution;
    advance(tokens)          the tokens the step emitted (all drawn from masked rows, so always allowed);
    jump_forward()           tokens of the continuation the grammar forces from its state (e.g. the next key
                             of a JSON object and its quotes), in xgrammar's longest-match tokenization, which
                             the model's own may differ from: `drafters.grammar` proposes them as a draft.
A draft token the grammar forbids has target probability 0 after masking: cutting the draft there loses
nothing when the loop treats it as a rejection at that position (`engine.constrain`). The grammar
finishes with the generation's EOS tokens, which it allows only where the structure is complete.
"""

from __future__ import annotations

import re

import torch

from assistgen.config import ConfigError, Structure

_COMPILERS: dict[tuple[int, int], tuple[object, object]] = {}  # (id(tokenizer), vocab) -> (tokenizer, compiler)


def xgrammar():
    """The xgrammar module, imported on first use (its import takes seconds)."""
    try:
        import xgrammar as xgr
    except ImportError as e:
        raise ConfigError("Structured output needs xgrammar: pip install 'assistgen[structured]' (on a CPU-only "
                          "machine `pip install --no-deps xgrammar==0.2.9` skips triton, which only its GPU "
                          "kernels use).") from e
    return xgr


def compiler_for(tokenizer, vocab_size: int):
    """The xgrammar compiler of a tokenizer (built once per tokenizer: reading a vocabulary takes ~0.3 s per
    50k tokens); it caches what it compiles."""
    key = (id(tokenizer), vocab_size)
    if key not in _COMPILERS:
        xgr = xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        _COMPILERS[key] = (tokenizer, xgr.GrammarCompiler(info))  # (the tokenizer kept alive: its id is the key)
    return _COMPILERS[key][1]


def xgrammar_detail(e: Exception) -> str:
    """The line of an xgrammar error that says what is wrong (without its time and C++ source line)."""
    detail = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", detail)


def compile_structure(tokenizer, vocab_size: int, structure: Structure):
    """The compiled grammar of `structure`; JSON is laid out with ", " and ": " between items and no other
    whitespace, so that a model cannot spend its tokens on blank lines inside the value."""
    compiler = compiler_for(tokenizer, vocab_size)
    try:
        if structure.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if structure.kind == "json_schema":
            return compiler.compile_json_schema(structure.spec, any_whitespace=False)
        if structure.kind == "regex":
            return compiler.compile_regex(structure.spec)
        if structure.kind == "structural_tag":
            return compiler.compile_structural_tag(structure.spec)
        return compiler.compile_grammar(structure.spec)
    except (RuntimeError, ValueError, TypeError) as e:
        what = {"json_schema": "JSON schema", "regex": "regular expression", "grammar": "grammar",
                "structural_tag": "tool or structural tag"}[structure.kind]
        detail = xgrammar_detail(e)
        raise ConfigError(f"The {what} does not compile: {detail}. Fix it (xgrammar's syntax) and retry.") from e


class Constraint:
    def __init__(self, compiled, vocab_size: int, eos: set[int]):
        xgr = xgrammar()
        self.xgr = xgr
        self.vocab_size = vocab_size
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(eos))
        self.masks = xgr.allocate_token_bitmask(1, vocab_size)  # [rows, ceil(vocab / 32)] int32 bits

    @classmethod
    def begin(cls, target, structure: Structure, eos: set[int]) -> Constraint:
        return cls(compile_structure(target.tokenizer, target.vocab_size, structure), target.vocab_size, eos)

    def check(self, draft: list[int]) -> tuple[int, int | None]:
        """(m, forbidden): the leading draft tokens the grammar allows and the one after them that it forbids;
        the masks of rows 0..m are kept for `mask`."""
        self.masks = self.xgr.allocate_token_bitmask(len(draft) + 1, self.vocab_size)  # (all allowed)
        if self.matcher.is_terminated():  # (the structure ended with an EOS: nothing after it is emitted)
            return 0, None
        allowed, forbidden = 0, None
        for token in draft:
            self.matcher.fill_next_token_bitmask(self.masks, allowed)
            if not self.matcher.accept_token(token):
                forbidden = token
                break
            allowed += 1
            if self.matcher.is_terminated():  # (an EOS: whatever follows is never emitted)
                break
        else:
            self.matcher.fill_next_token_bitmask(self.masks, allowed)
        self.matcher.rollback(allowed)
        return allowed, forbidden

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [n+1, vocab] -> float32 copy, -inf wherever the grammar forbids the token at that row."""
        masked = logits.to(torch.float32, copy=True, memory_format=torch.contiguous_format)  # (xgrammar's kernel
        # reads rows as contiguous: the torch backend's logits may come transposed)
        self.xgr.apply_token_bitmask_inplace(masked, self.masks[: len(masked)].to(masked.device),
                                             vocab_size=self.vocab_size)
        return masked

    def jump_forward(self) -> list[int]:
        return list(self.matcher.find_jump_forward_tokens())

    def advance(self, tokens: list[int]) -> None:
        for token in tokens:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(token):
                raise RuntimeError(f"token {token} was emitted where the grammar forbids it")
