"""xgrammar against llguidance on one tokenizer: tokenizer set-up, JSON-schema compile time, mask time per token.

Both engines follow the same token sequence (a schema-valid JSON document tokenized by the model's tokenizer,
xgrammar's layout: ", " and ": " and no other whitespace) and fill one bitmask per token; the masks of the two are
compared row by row (allowed sets may differ where the engines tokenize differently; the figure is the share of
rows that agree). Prints a table; decides nothing by itself.

    python benchmarks/grammar_engines.py [--model smollm2-135m] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", "poetry"],
            "address": {"city": "London", "zip": "W1"}, "active": True}


def timed(fn, repeat):
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def xgrammar_run(tokenizer, vocab, tokens, repeat):
    import xgrammar as xgr

    setup, compiler = timed(lambda: xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer,
                                                                                          vocab_size=vocab),
                                                        cache_enabled=False), 1)
    compile_s, compiled = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False),
                                repeat)
    masks = xgr.allocate_token_bitmask(len(tokens) + 1, vocab).numpy()

    def walk():
        import torch
        matcher = xgr.GrammarMatcher(compiled)
        view = torch.from_numpy(masks)
        for i, t in enumerate(tokens):
            matcher.fill_next_token_bitmask(view, i)
            assert matcher.accept_token(t), f"xgrammar refused token {i}"

    walk_s, _ = timed(walk, repeat)
    return setup, compile_s, walk_s / len(tokens), masks.copy()


def llguidance_run(tokenizer, vocab, tokens, repeat):
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lln

    setup, lltok = timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab), 1)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    compile_s, matcher = timed(lambda: llguidance.LLMatcher(lltok, grammar, log_level=0), repeat)
    assert not matcher.is_error(), matcher.get_error()
    masks = lln.allocate_token_bitmask(len(tokens) + 1, vocab)

    def walk():
        m = llguidance.LLMatcher(lltok, grammar, log_level=0)
        for i, t in enumerate(tokens):
            lln.fill_next_token_bitmask(m, masks, i)
            assert m.consume_token(t), f"llguidance refused token {i}: {m.get_error()}"

    walk_s, _ = timed(walk, repeat)
    return setup, compile_s, walk_s / len(tokens), masks.copy()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    from assistgen import load_model

    model = load_model(args.model, backend="torch")
    tokenizer, vocab = model.tokenizer, model.vocab_size
    text = json.dumps(DOCUMENT, separators=(", ", ": "))
    tokens = tokenizer.encode(text, add_special_tokens=False)
    rows = {}
    for name, run in (("xgrammar", xgrammar_run), ("llguidance", llguidance_run)):
        try:
            rows[name] = run(tokenizer, vocab, tokens, args.repeat)
        except ImportError as e:
            print(f"{name}: not installed ({e})")
    print(f"model {args.model}, vocabulary {vocab}, {len(tokens)} tokens of a schema-valid document")
    print("| engine | tokenizer set-up (s) | schema compile (ms) | mask per token (us) |")
    print("|---|---:|---:|---:|")
    for name, (setup, compile_s, per_token, _) in rows.items():
        print(f"| {name} | {setup:.2f} | {compile_s * 1e3:.2f} | {per_token * 1e6:.0f} |")
    if len(rows) == 2:
        a, b = rows["xgrammar"][3][:len(tokens)], rows["llguidance"][3][:len(tokens)]
        def bits(m):
            return np.unpackbits(m.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)

        x, y = bits(a), bits(b)  # [rows, vocab] allowed
        print(f"rows whose allowed sets agree: {int((x == y).all(axis=1).sum())} of {len(tokens)}")
        print(f"allowed by xgrammar only: {int((x & ~y).sum())} token-rows; by llguidance only: {int((y & ~x).sum())}")
        special = sorted(set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {})))
        print(f"  of xgrammar's extra, special or added tokens: {int((x & ~y)[:, special].sum())}")


if __name__ == "__main__":
    main()
