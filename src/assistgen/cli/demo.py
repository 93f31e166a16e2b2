"""`make demo`: plain decoding, then assisted decoding, of one summarization prompt, side by side.

Contract: runs the one generation loop twice on an embedded model (plain, then prompt lookup,
the drafter that measured best on these CPUs) and prints both texts, whether they are identical,
tokens per second of each, the speed-up and the acceptance statistics.
"""

from __future__ import annotations

import sys
from importlib.resources import files

from assistgen.api import encode_prompt, generate, load_model

DEMO_MODEL = "gemma3-270m"  # the demo's own model (the commands' default text model: options.DEFAULT_MODEL)
DEMO_TOKENS = 128


def summary_prompt() -> str:
    article = files("assistgen").joinpath("data/article.txt").read_text()
    return f"Article:\n{article}\nA summary of the article above, in a few sentences:\n"


def run_demo(model_name: str | None = None, max_new_tokens: int | None = None) -> int:
    model_name = model_name or DEMO_MODEL
    n = max_new_tokens or DEMO_TOKENS
    model = load_model(model_name)  # the first run says on screen that it converts the GGUF file
    chat = bool(getattr(model.tokenizer, "chat_template", None))
    ids = encode_prompt(model, summary_prompt(), chat=chat)
    print(f"Model {model_name}; summarization prompt of {len(ids)} tokens; {n} new tokens, greedy.\n", flush=True)
    generate(model, ids[:16], max_new_tokens=4)  # warm-up: first calls pay one-off allocation costs
    runs = {}
    for label, kwargs in (("plain", {}), ("assisted (prompt lookup)", {"lookup": True})):
        print(f"=== {label} ===", flush=True)
        out = generate(model, ids, max_new_tokens=n, **kwargs)
        print(out.text.strip() + "\n", flush=True)
        runs[label] = out
    plain, assisted = runs.values()
    speedup = assisted.stats.tokens_per_second / plain.stats.tokens_per_second
    print("=== comparison ===")
    print(f"identical output: {plain.token_ids == assisted.token_ids}")
    print(f"plain:    {plain.stats.tokens_per_second:6.1f} tok/s ({plain.stats.new_tokens} tokens)")
    print(f"assisted: {assisted.stats.tokens_per_second:6.1f} tok/s  -> speed-up {speedup:.2f}x")
    print(assisted.stats.summary())
    return 0 if plain.token_ids == assisted.token_ids else 1


if __name__ == "__main__":
    sys.exit(run_demo(*sys.argv[1:2]))
