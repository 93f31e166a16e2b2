"""How fast can prompt lookup be on these outputs at best? The ceiling that acceptance allows.

Reads an `assistgen bench` results file. For every greedy plain record it replays the target's own
output against the lookup drafter (`drafters.lookup_continuation`, n-grams 3..1, up to MAX_K tokens)
and counts, at each step, how many draft tokens the target would accept (a). Two ceilings follow
per category, both for the decode phase (after the prefill):
  - free verification: tokens per step, mean(a + 1): the speed-up if verifying were free;
  - oracle policy: sum(a + 1) / sum(v[a]) with the target's measured verification costs v (`gain.step_cost`): a policy
    that knew in advance how many tokens would be accepted and verified exactly those (0: a plain
    step). No schedule can beat it with this drafter on this machine.
  - replayed schedule: the same replay with the default `Adaptive` policy choosing how many draft
    tokens to verify (as in the generation loop, with the same costs; the lookup drafter costs nothing,
    so no timing enters): the policy's share of the oracle.
Where the file also has lookup records, their measured decode-phase speed-up is set against the
oracle-policy ceiling. Prints a table and one JSON line.

    python benchmarks/lookup_ceiling.py docs/results/lookup-ceiling-smollm2-135m.jsonl [--method lookup]

With `--conversations FILE --model M` it first decodes the multi-turn conversations of FILE (benchmarks/
conversations.json, as benchmarks/conversations.py replays them: each turn the whole conversation so far through the
chat template, greedy, plain decoding, `--max-tokens` each) and gives the same ceilings for first turns and later
turns apart, priced with M's measured verification costs on this machine.

    python benchmarks/lookup_ceiling.py --conversations benchmarks/conversations.json --model qwen2.5-coder-1.5b

`--decoded FILE` keeps the decoded turns (written on the first run, read on later ones: a replay of the policy
without decoding again); `--dataset FILE` names the prompt set a results file was made on (default: the suite).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from assistgen import load_model
from assistgen.api import encode_prompt
from assistgen.bench.dataset import default_suite, read_prompts
from assistgen.drafters.lookup import lookup_continuation, lookup_draft
from assistgen.policy.adaptive import Adaptive
from assistgen.policy.costs import measured_costs
from assistgen.policy.gain import MAX_K, step_cost
from assistgen.policy.lengths import verified_lengths
from assistgen.spec.drafts import Draft
from assistgen.spec.steps import StepOutcome


def accepted_lengths(prompt: list[int], output: list[int], max_k: int = MAX_K) -> list[int]:
    """Replay `output` step by step: the accepted length of each lookup draft (capped at the end)."""
    lengths, i = [], 0
    while i < len(output):
        room = len(output) - i - 1
        draft, _ = lookup_continuation(prompt + output[:i], min(max_k, room), 3, 1)
        a = 0
        while a < len(draft) and draft[a] == output[i + a]:
            a += 1
        lengths.append(a)
        i += a + 1
    return lengths


class _Lookup:
    """What the policy reads of a drafter (`drafters.Drafter`): prompt lookup runs no model."""

    name = "prompt-lookup"
    model = None
    acceptance_prior = None


def replay_schedule(schedule, prompt: list[int], output: list[int], costs: list[float]) -> tuple[int, float]:
    """Decode `output` again with lookup drafts and `schedule` choosing what to verify; (tokens, cost in steps)."""
    part = _Lookup()
    run = schedule.prepare(None, [part], len(prompt))  # steps carry no timings: lookup costs nothing
    tokens, cost, i = 0, 0.0, 0
    while i < len(output):
        room = len(output) - i - 1
        k = min(run.next_k(part), room)
        draft = lookup_draft(prompt + output[:i], k, 3, 1)
        draft_tokens = draft.tokens
        n = verified_lengths([run], [draft], [part.name], [room], run.costs)[0] if draft_tokens else 0
        accepted = 0
        while accepted < n and draft_tokens[accepted] == output[i + accepted]:
            accepted += 1
        token = output[i + accepted]
        run.update(StepOutcome(draft if n or draft_tokens else Draft(), part.name if draft_tokens else "", n, accepted,
                        token))
        cost += step_cost(costs, n)
        tokens += accepted + 1
        i += accepted + 1
    return tokens, cost


def conversation_turns(model, path: str, max_tokens: int) -> list[dict]:
    """Each turn of each conversation in `path` decoded greedily (plain) after the conversation so far: records with
    "category" ("first turns" / "later turns"), "prompt" and "tokens"."""
    from assistgen import generate
    from assistgen.chat.templates import encode_chat

    records = []
    for conversation in json.load(open(path, encoding="utf-8")):
        messages = []
        for turn, text in enumerate(conversation["turns"]):
            messages.append({"role": "user", "content": text})
            ids = encode_chat(model, messages)
            out = generate(model, ids, max_new_tokens=max_tokens)
            records.append({"category": "first turns" if turn == 0 else "later turns", "prompt": ids,
                            "tokens": list(out.token_ids)})
            messages.append({"role": "assistant", "content": out.text})
    return records


def decode_seconds(record: dict) -> float:
    return record["seconds"] - record["prefill_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", help="an `assistgen bench --out` file with greedy plain records")
    parser.add_argument("--method", default="lookup", help="the measured method to set against the ceiling")
    parser.add_argument("--conversations", help="decode these multi-turn conversations instead (conversations.json)")
    parser.add_argument("--model", help="with --conversations: the model that decodes them")
    parser.add_argument("--max-tokens", type=int, default=256, help="with --conversations: new tokens per turn")
    parser.add_argument("--decoded", help="with --conversations: keep the decoded turns here (read when it exists)")
    parser.add_argument("--dataset", help="the prompt set the results file was made on (default: the shipped suite)")
    args = parser.parse_args()
    if (args.results is None) == (args.conversations is None) or (args.conversations and not args.model):
        parser.error("give a results file, or --conversations FILE with --model")
    if args.decoded and not args.conversations:
        parser.error("--decoded keeps decoded conversations: give it with --conversations")
    if args.dataset and args.conversations:
        parser.error("--dataset names a results file's prompt set: give it with a results file, not --conversations")
    changed, measured_s = [], {}
    if args.conversations:
        model = load_model(args.model)
        if args.decoded and Path(args.decoded).is_file():
            turns = json.loads(Path(args.decoded).read_text(encoding="utf-8"))
        else:
            turns = conversation_turns(model, args.conversations, args.max_tokens)
            if args.decoded:
                Path(args.decoded).write_text(json.dumps(turns), encoding="utf-8")
        items = [(r["category"], r["prompt"], r["tokens"]) for r in turns]
    else:
        records = [json.loads(line) for line in open(args.results, encoding="utf-8") if line.strip()]
        records = [r for r in records if r["temperature"] == 0.0]
        prompts = {p.question_id: p for p in read_prompts(args.dataset or default_suite())}
        model = load_model(records[0]["model"])
        by = {(r["question_id"], r["method"]): r for r in records}
        items = []
        for r in records:
            if r["method"] != "plain":
                continue
            chat = r["key"].endswith("chat=True")
            ids = encode_prompt(model, prompts[r["question_id"]].turns[0], chat=chat)
            if len(ids) != r["prompt_tokens"]:
                changed.append(r["question_id"])  # the suite's prompt changed since the file was written
                continue
            items.append((r["category"], ids, r["tokens"]))
            measured = by.get((r["question_id"], args.method))
            if measured is not None and "prefill_s" in measured and "prefill_s" in r:
                measured_s[len(items) - 1] = (decode_seconds(r), decode_seconds(measured))
    costs = list(measured_costs(model).curve)
    rows: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for index, (category, ids, tokens) in enumerate(items):
        lengths = accepted_lengths(ids, tokens)
        replayed = replay_schedule(Adaptive(curve=costs), ids, tokens, costs)
        for name in (category, "overall"):
            row = rows[name]
            row["tokens"] += len(tokens)
            row["steps"] += len(lengths)
            row["cost"] += sum(step_cost(costs, a) for a in lengths)
            row["replay_cost"] += replayed[1]
            if index in measured_s:
                row["plain_decode_s"] += measured_s[index][0]
                row["method_decode_s"] += measured_s[index][1]
    out = {}
    if changed:
        print(f"skipped {len(changed)} prompts that changed since the file was written: {', '.join(changed)}")
    print(f"{'category':<14}{'free verif.':>12}{'oracle policy':>14}{'replayed':>10}{'share':>7}"
          f"{'measured':>10}{'share':>7}")
    for category, row in sorted(rows.items(), key=lambda kv: (kv[0] == "overall", kv[0])):
        free = row["tokens"] / row["steps"]
        oracle = row["tokens"] / row["cost"]
        replayed = row["tokens"] / row["replay_cost"]
        measured = row["plain_decode_s"] / row["method_decode_s"] if row["method_decode_s"] else None
        out[category] = {"free_verification": round(free, 3), "oracle_policy": round(oracle, 3),
                         "replayed_adaptive": round(replayed, 3),
                         "measured_decode": round(measured, 3) if measured else None}
        shown = f"{measured:9.2f}x{measured / oracle:7.0%}" if measured else f"{'-':>10}{'-':>7}"
        print(f"{category:<14}{free:11.2f}x{oracle:13.2f}x{replayed:9.2f}x{replayed / oracle:7.0%}{shown}")
    print(json.dumps({"benchmark": "lookup-ceiling", "results": args.results or args.conversations,
                      "model": model.name, "method": args.method,
                      "cost_curve": [round(v, 3) for v in costs], "categories": out}))


if __name__ == "__main__":
    main()
