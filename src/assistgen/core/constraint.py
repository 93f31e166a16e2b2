"""Grammar-constrained decoding under speculation, through llguidance.

Contract: `grammar_of(structure)` is the llguidance grammar of a `config.Structure` (JSON laid out with ", " and
": " and no other whitespace; a GBNF or Lark grammar; a regular expression) and `compile_structure(tokenizer,
vocab_size, structure)` checks it against the target's tokenizer (a spec that does not compile raises ConfigError
naming the problem). `compiled(target, structure, eos)` is that check for the target and the generation's EOS tokens,
kept as a `Grammar` (the grammar's text, llguidance's view of the tokenizer and the matcher compiled from them,
`compile_structure` being the one place a grammar is compiled): a request's admission (`core.admission`) makes it
once. `Constraint.of(grammar, eos)` (a copy of that matcher; or `Constraint.begin(target, structure, eos)`, which
compiles first) holds one generation's grammar state, which always stands after the tokens emitted so far. Each
step the loop calls:
    check(draft) -> (m, forbidden)   how many leading draft tokens the grammar allows, and the token after
                             them that it forbids (None when there is none, or when token m ended the
                             structure with an EOS); it fills the masks of the m + 1 positions that
                             verifying them reads (rows 0..m) and rolls itself back;
    mask(logits)             logits [n+1, vocab], n <= m -> a copy with every token the grammar forbids at
                             each position set to -inf, so that greedy and sampled choices (and logprobs)
                             come from the masked target distribution;
    advance(tokens)          the tokens the step emitted (all drawn from masked rows, so always allowed);
    jump_forward()           tokens of the continuation the grammar forces from its state (e.g. the next key
                             of a JSON object and its quotes), in llguidance's canonical tokenization, which
                             the model's own may differ from: `core.grammar` proposes them as a draft.
A draft token is allowed exactly when its bit is set in the mask of its row: the same rows mask the target, so a
forbidden draft token has target probability 0 after masking and cutting the draft there loses nothing when the
loop treats it as a rejection at that position (`engine.constrain`). The grammar allows the generation's EOS
tokens only where the structure is complete; an emitted EOS ends it (never fed to the matcher, which would stop).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from assistgen.config import ConfigError, Structure

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # as chat templates'
# `tojson` writes JSON: a model cannot spend its tokens on blank lines inside a value
_TOKENIZERS: dict[tuple[int, int, tuple[int, ...]], tuple[object, object]] = {}  # (id, vocab, eos) -> (tok, lltok)
_SHIFTS = torch.arange(32, dtype=torch.int32)


def llguidance():
    """The llguidance module (a dependency of assistgen: no other requirement, no GPU code)."""
    try:
        import llguidance
        import llguidance.gbnf_to_lark
        import llguidance.hf
    except ImportError as e:
        raise ConfigError("Structured output needs llguidance: pip install 'llguidance>=1.9,<2' (a dependency of "
                          "assistgen; reinstall assistgen if it is missing).") from e
    return llguidance


def grammar_tokenizer(tokenizer, vocab_size: int, eos: tuple[int, ...]):
    """llguidance's view of a tokenizer with the generation's EOS tokens (built once per tokenizer and EOS set:
    reading a vocabulary takes ~0.4 s per 50k tokens). A fast tokenizer is read whole (its byte-level or
    SentencePiece decoder); any other from its vocabulary, each token's text as its bytes."""
    key = (id(tokenizer), vocab_size, eos)
    if key not in _TOKENIZERS:
        llg = llguidance()
        from llguidance.hf import from_tokenizer  # (named so: `.hf` reads as a model's internals to the layer test)

        try:
            made = from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos) or None)
        except ValueError:  # (a slow tokenizer, or a decoder llguidance does not read)
            made = llg.LLTokenizer(llg.TokenizerWrapper(Vocabulary(tokenizer, vocab_size)), n_vocab=vocab_size,
                                   eos_token=list(eos) or None)
        _TOKENIZERS[key] = (tokenizer, made)  # (the tokenizer kept alive: its id is the key)
    return _TOKENIZERS[key][1]


class Vocabulary:
    """A tokenizer as llguidance's TokenizerWrapper reads one: every id's bytes, the special ids, an encoder."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        known = len(tokenizer)
        self.tokens = [tokenizer.decode([i]).encode() if i < known else b"" for i in range(vocab_size)]
        self.special_token_ids = list(tokenizer.all_special_ids)

    def __call__(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def closed(schema):
    """The schema with `additionalProperties: false` wherever an object lists its properties and says nothing of
    others (as OpenAI's strict mode and xgrammar's read a schema: a model fills the properties named, not its own)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: closed(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and "unevaluatedProperties" not in out:
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not", "contains"):
        if key in out:
            out[key] = closed(out[key])
    for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
        if isinstance(out.get(key), list):
            out[key] = [closed(v) for v in out[key]]
    for key in ("$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {k: closed(v) for k, v in out[key].items()}
    return out


def json_grammar(schema: str | dict) -> str:
    """The Lark reference to a JSON schema's grammar in JSON_LAYOUT (`%json {...}`), for use inside a grammar;
    ValueError when the text is not a JSON object."""
    schema = json.loads(schema) if isinstance(schema, str) else schema
    if not isinstance(schema, dict):
        raise ValueError("the schema must be a JSON object")
    schema = closed(schema)
    return "%json " + json.dumps({**schema, "x-guidance": {**JSON_LAYOUT, **schema.get("x-guidance", {})}})


def grammar_of(structure: Structure) -> str:
    """The llguidance grammar of a structure; ValueError when its text does not parse."""
    llg = llguidance()
    if structure.kind in ("json_object", "json_schema"):
        schema = '{"type": "object"}' if structure.kind == "json_object" else structure.spec
        return llg.LLMatcher.grammar_from_lark(f"start: {json_grammar(schema)}")
    if structure.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(structure.spec)
    return llg.LLMatcher.grammar_from_lark(llg.gbnf_to_lark.any_to_lark(structure.spec))  # (GBNF or Lark)


def compile_structure(tokenizer, vocab_size: int, structure: Structure, eos: tuple[int, ...] = ()):
    """(the grammar of `structure`, an llguidance matcher compiled from it for the tokenizer, at its start): the one
    place a grammar is compiled; ConfigError naming what does not compile."""
    what = {"json_object": "JSON schema", "json_schema": "JSON schema", "regex": "regular expression",
            "grammar": "grammar"}[structure.kind]
    lltokenizer = grammar_tokenizer(tokenizer, vocab_size, eos)
    matcher = None
    try:
        grammar = grammar_of(structure)
        matcher = llguidance().LLMatcher(lltokenizer, grammar, log_level=1)
        error = matcher.get_error() if matcher.is_error() else ""
    except (ValueError, TypeError, RuntimeError) as e:  # (the text does not parse: JSON, GBNF)
        error = str(e)
    if error:
        raise ConfigError(f"The {what} does not compile: {error_line(error)}. Fix it and retry (JSON Schema; a GBNF "
                          "or Lark grammar; a regular expression in Rust's syntax).")
    return grammar, matcher


@dataclass(frozen=True)
class Grammar:
    """A structure compiled for a target's tokenizer and a generation's EOS tokens: what a `Constraint` starts from."""

    text: str  # llguidance's grammar
    lltokenizer: object  # llguidance's view of the tokenizer, with the EOS tokens
    vocab_size: int
    matcher: object = None  # llguidance's matcher compiled from it, never advanced: each generation copies it


def compiled(target, structure: Structure, eos: set[int] | frozenset[int]) -> Grammar:
    """`structure` compiled for `target` with these EOS tokens (ConfigError naming what does not compile)."""
    key = tuple(sorted(eos))
    text, matcher = compile_structure(target.tokenizer, target.vocab_size, structure, key)
    return Grammar(text, grammar_tokenizer(target.tokenizer, target.vocab_size, key), target.vocab_size, matcher)


def error_line(error: str) -> str:
    """The first line of an llguidance error (the rest repeats the grammar)."""
    return error.strip().splitlines()[0].rstrip(".:") if error.strip() else "unknown error"


def allowed_rows(masks: torch.Tensor, vocab: int) -> torch.Tensor:
    """masks [rows, ceil(vocab / 32)] int32 bits -> [rows, vocab] bool, True where the token is allowed."""
    bits = (masks.unsqueeze(-1) >> _SHIFTS) & 1  # [rows, words, 32]
    return bits.reshape(len(masks), -1)[:, :vocab].bool()


class Constraint:
    def __init__(self, matcher, vocab_size: int, eos: set[int]):
        """`matcher`: the generation's own llguidance matcher, at the grammar's start (`of`: a copy of a compiled
        grammar's)."""
        self.vocab_size = vocab_size
        self.eos = eos
        self.matcher = matcher
        self.words = (vocab_size + 31) // 32
        self.masks = torch.full((1, self.words), -1, dtype=torch.int32)  # [rows, words] bits, all allowed
        self.ended = False  # an EOS was emitted: nothing after it is

    @classmethod
    def of(cls, grammar: Grammar, eos: set[int] | frozenset[int]) -> Constraint:
        """A generation's state in a grammar compiled for its EOS tokens (`compiled`): a copy of its matcher (nothing
        compiled again)."""
        return cls(grammar.matcher.deep_copy(), grammar.vocab_size, set(eos))

    @classmethod
    def begin(cls, target, structure: Structure, eos: set[int]) -> Constraint:
        return cls.of(compiled(target, structure, eos), eos)

    def fill(self, row: int) -> None:
        view = self.masks[row]
        self.matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())

    def allows(self, row: int, token: int) -> bool:
        return 0 <= token < self.vocab_size and bool((int(self.masks[row, token // 32]) >> (token % 32)) & 1)

    def check(self, draft: list[int]) -> tuple[int, int | None]:
        """(m, forbidden): the leading draft tokens the grammar allows and the one after them that it forbids;
        the masks of rows 0..m are kept for `mask`."""
        self.masks = torch.full((len(draft) + 1, self.words), -1, dtype=torch.int32)  # (all allowed)
        if self.ended:
            return 0, None
        allowed, consumed = 0, 0
        for token in draft:
            self.fill(allowed)
            if not self.allows(allowed, token):
                self.matcher.rollback(consumed)
                return allowed, token
            allowed += 1
            if token in self.eos:  # (whatever follows an EOS is never emitted)
                break
            self.consume(token)
            consumed += 1
        else:
            self.fill(allowed)
        self.matcher.rollback(consumed)
        return allowed, None

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"token {token} was emitted where the grammar forbids it: "
                               f"{error_line(self.matcher.get_error())}")

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [n+1, vocab] -> float32 copy, -inf wherever the grammar forbids the token at that row."""
        masked = logits.to(torch.float32, copy=True)
        allowed = allowed_rows(self.masks[: len(masked)], self.vocab_size).to(masked.device)  # [n+1, vocab]
        masked[:, : self.vocab_size].masked_fill_(~allowed, float("-inf"))
        masked[:, self.vocab_size:] = float("-inf")
        return masked

    def jump_forward(self) -> list[int]:
        return [] if self.ended else list(self.matcher.compute_ff_tokens())

    def advance(self, tokens: list[int]) -> None:
        for token in tokens:
            if self.ended:
                return
            if token in self.eos:
                if not self.matcher.is_accepting():
                    raise RuntimeError(f"EOS token {token} was emitted before the structure was complete")
                self.ended = True
            else:
                self.consume(token)
