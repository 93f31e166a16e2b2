"""Pricing passes at the sequence's length or not: the same conversations decoded both ways in one process.

For each conversation of `--conversations` (benchmarks/conversations.json), each turn is first decoded greedily with
prompt lookup (its reply becomes the next turn's history, as a chat client sends it). Then every turn's prompt is
decoded again `--repeats` times under each of two pricings of the target's passes, alternating which goes first:
`context`, the measured costs priced at the sequence's length (`PassCosts.at`, the default policy), and `short`, the
same costs as measured after the short context at every length (`context_slopes` dropped). Both are entered in the
cost book for the model (`policy.costs.enter`); nothing else differs. Greedy output must be identical (it is
checked); the decode time (after the first token) is summed per turn kind (first turns, later turns). Prints the
machine, the measured context slopes, a table and one JSON line.

    python benchmarks/context_pricing.py --model qwen2.5-coder-1.5b --first 4 --max-new-tokens 160 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from assistgen import generate, load_model
from assistgen.backends.machine import cpu_flags, cpu_name
from assistgen.chat.templates import encode_chat
from assistgen.policy.costs import calibrate, enter

HERE = Path(__file__).resolve().parent


def machine() -> str:
    flags = cpu_flags()
    widest = next((name for flag, name in (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))
                   if flag in flags), "no AVX2")
    return f"{cpu_name()} ({widest}), {len(os.sched_getaffinity(0))} cores"


def turn_prompts(model, conversations: list[dict], tokens: int) -> list[tuple[bool, list[int]]]:
    """(later turn?, the prompt's ids) of every turn, each turn's history holding the greedy replies before it."""
    prompts = []
    for conversation in conversations:
        messages = []
        for turn, text in enumerate(conversation["turns"]):
            messages.append({"role": "user", "content": text})
            ids = encode_chat(model, messages)
            prompts.append((turn > 0, ids))
            reply = generate(model, ids, lookup=True, max_new_tokens=tokens)
            messages.append({"role": "assistant", "content": reply.text})
    return prompts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--backend", default="llama.cpp")
    parser.add_argument("--conversations", type=Path, default=HERE / "conversations.json")
    parser.add_argument("--first", type=int, help="only the first N conversations")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--context", type=int, default=16384, help="the model's context (llama.cpp)")
    args = parser.parse_args(argv)

    model = load_model(args.model, backend=args.backend, context=args.context)
    measured = calibrate(model)
    pricings = {"context": measured, "short": replace(measured, context_slopes=(), _at={})}
    conversations = json.loads(args.conversations.read_text())[: args.first]
    enter(model, measured)
    prompts = turn_prompts(model, conversations, args.max_new_tokens)
    seconds = {(name, later): 0.0 for name in pricings for later in (False, True)}
    tokens = {later: 0 for later in (False, True)}
    for repeat in range(args.repeats):
        for i, (later, ids) in enumerate(prompts):
            order = list(pricings) if (i + repeat) % 2 == 0 else list(reversed(pricings))
            outputs = []
            for name in order:
                enter(model, pricings[name])
                result = generate(model, ids, lookup=True, max_new_tokens=args.max_new_tokens)
                seconds[name, later] += result.stats.total_s - result.stats.prefill_s
                outputs.append(result.token_ids)
            if outputs[0] != outputs[1]:
                raise SystemExit(f"turn {i}: the two pricings gave different greedy outputs")
            if repeat == 0:
                tokens[later] += len(outputs[0]) - 1
        print(f"round {repeat + 1} of {args.repeats} done", file=sys.stderr, flush=True)
    print(f"{args.model} on {args.backend}, {len(conversations)} conversations, {args.max_new_tokens} tokens a turn, "
          f"{args.repeats} repeats, on {machine()}")
    print(f"context slopes (rows, t(1) per context token past {measured.base_context}): {measured.context_slopes}")
    rows = []
    print(f"{'turns':<8}{'tokens':>8}{'short tok/s':>13}{'context tok/s':>15}{'ratio':>8}")
    for later, label in ((False, "first"), (True, "later")):
        short = tokens[later] * args.repeats / seconds["short", later] if seconds["short", later] else 0.0
        context = tokens[later] * args.repeats / seconds["context", later] if seconds["context", later] else 0.0
        rows.append({"turns": label, "tokens": tokens[later], "short_tok_s": short, "context_tok_s": context})
        print(f"{label:<8}{tokens[later]:>8}{short:>13.2f}{context:>15.2f}{context / short if short else 0:>8.3f}")
    print(json.dumps({"model": args.model, "machine": machine(), "slopes": measured.context_slopes, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
