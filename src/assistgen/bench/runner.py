"""Running benchmark methods interleaved per prompt, with resumable results.

Contract: a method (`Method`, parsed from its text by `cli.bench.parse_method`) is `plain`, or drafting sources
joined by `+` (tried in that order): `lookup`,
`ngram` (the cross-request n-gram cache), `assistant`, `early-exit` (assistgen, optionally
`@schedule`, e.g. `lookup@constant:4`, `lookup+assistant`; the default schedule is the adaptive
policy), or `hf-plain`, `hf-lookup`, `hf-assistant` (transformers' `generate()` on the
unmodified model: prompt_lookup_num_tokens=10, assistant_model=..., and universal assisted
generation with tokenizer=/assistant_tokenizer= when the tokenizers differ). For each prompt and
temperature every method runs once, one after the other (A B C, A B C, ...; `repeats` times over),
so drift on a noisy machine hits all alike. Runs are timed with the target's clock (`LanguageModel.clock`:
a GPU is synchronized before it is read); transformers' methods run through the torch backend's
reference (`backends/torch/reference.py`). Each run becomes
one record (a dict) appended to the results file at once; a rerun with the same file skips the
records already there. A prompt with a JSON schema (its own, or the runner's `schema` for every prompt) runs
under structured output (assistgen's methods only: transformers' have no grammar), and its record says whether
the answer is valid JSON that follows the schema ("valid"). The n-gram cache learns across prompts in the order
they run, but never from an earlier run of the same prompt: each run drafts from a copy of what the previous
prompts taught it.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from assistgen.api import encode_prompt, generate
from assistgen.backends.base import LanguageModel
from assistgen.backends.torch.reference import ForwardCounter, hf_generate
from assistgen.bench.dataset import Prompt
from assistgen.config import Structure
from assistgen.drafters.assistant import same_tokenizer
from assistgen.drafters.ngram import NGramCache
from assistgen.spec.steps import Schedule

SOURCES = ("lookup", "ngram", "assistant", "early-exit")
HF_METHODS = ("plain", "lookup", "assistant")
HF_LOOKUP_TOKENS = 10


@dataclass(frozen=True)
class Method:
    spec: str
    engine: str  # "assistgen" or "hf"
    drafter: str  # plain, or sources joined by "+": lookup, ngram, assistant, early-exit
    schedule: Schedule | None = None  # the `@schedule` of its spec (`cli.bench.parse_method`); None: the default

    @property
    def sources(self) -> list[str]:
        return [] if self.drafter == "plain" else self.drafter.split("+")

    @property
    def needs_assistant(self) -> bool:
        return "assistant" in self.sources


@dataclass
class Runner:
    target: LanguageModel
    assistant: LanguageModel | None = None
    max_new_tokens: int = 128
    chat: bool = False
    turn: int = 1
    seed: int = 0
    # transformers' methods run on these when given (the unquantized models of a quantized run)
    hf_target: LanguageModel | None = None
    hf_assistant: LanguageModel | None = None
    schema: str | None = None  # a JSON schema (text) for every prompt without its own

    def __post_init__(self):
        self.ngram_cache = NGramCache()  # what the prompts run so far taught the n-gram drafter

    def learn(self, ids: list[int], tokens: list[int]) -> None:
        """After every method ran on a prompt: the n-gram cache remembers it for the next prompts."""
        self.ngram_cache.add(ids + tokens)

    def key(self, prompt: Prompt, method: Method, temperature: float, repeat: int = 0) -> str:
        assistant = self.assistant.name if self.assistant else "-"
        quantization = self.target.describe()["quantization"]  # (the torch backend's int8/int4)
        quantized = f"|q={quantization}" if quantization else ""
        again = f"|repeat={repeat}" if repeat else ""  # the first run keeps the key it always had
        schema = self.schema_of(prompt)
        structured = f"|schema={hashlib.sha256(schema.encode()).hexdigest()[:12]}" if schema else ""
        return (f"{self.target.name}{quantized}|{assistant}|{prompt.question_id}|{method.spec}|t={temperature}"
                f"|n={self.max_new_tokens}|turn={self.turn}|chat={self.chat}{again}{structured}")

    def schema_of(self, prompt: Prompt) -> str | None:
        return prompt.schema or self.schema

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        return encode_prompt(self.target, prompt.turns[self.turn - 1], chat=self.chat)

    def run(self, method: Method, ids: list[int], temperature: float, max_new_tokens: int,
            schema: str | None = None) -> dict:
        if method.needs_assistant and self.assistant is None:
            raise ValueError(f"Method {method.spec} needs --assistant.")
        if schema is not None and method.engine == "hf":
            raise ValueError(f"{method.spec}: transformers' generate() has no structured output; run assistgen's "
                             "methods on prompts with a JSON schema.")
        if method.engine != "hf":
            return self._run_ours(method, ids, temperature, max_new_tokens, schema)
        target, assistant = self.hf_target or self.target, self.hf_assistant or self.assistant
        counters = [ForwardCounter(target)] + ([ForwardCounter(assistant)] if assistant else [])
        try:
            record = self._run_hf(method, ids, temperature, max_new_tokens)
        finally:
            for c in counters:
                c.close()
        record["target_forward_passes"] = counters[0].count
        record["draft_forward_passes"] = counters[1].count if len(counters) > 1 else 0
        return record

    def _run_ours(self, method, ids, temperature, max_new_tokens, schema=None) -> dict:
        kwargs = {"lookup": "lookup" in method.sources,
                  "assistant": self.assistant if "assistant" in method.sources else None,
                  "early_exit": "early-exit" in method.sources,
                  "ngram_cache": self.ngram_cache.copy() if "ngram" in method.sources else False}
        if method.schedule is not None:
            kwargs["schedule"] = method.schedule
        if schema is not None:
            kwargs["structure"] = Structure("json_schema", schema)
        start = self.target.clock()
        out = generate(self.target, ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=self.seed,
                       **kwargs)
        seconds = self.target.clock() - start
        s = out.stats
        record = {"tokens": out.token_ids, "seconds": seconds, "mode": s.mode, "steps": s.steps,
                  "drafted": s.drafted_tokens, "accepted": s.accepted_tokens, "draft_s": s.draft_s,
                  "verify_s": s.verify_s, "prefill_s": s.prefill_s, "draft_calls": s.draft_forward_passes,
                  "notes": s.notes, "target_forward_passes": s.target_forward_passes,
                  "draft_forward_passes": s.draft_forward_passes}
        if schema is not None:
            record["valid"] = follows_schema(out.text, schema)
        return record

    def _run_hf(self, method, ids, temperature, max_new_tokens) -> dict:
        target, assistant = self.hf_target or self.target, self.hf_assistant or self.assistant
        helper = assistant if method.drafter == "assistant" else None
        tokens, seconds = hf_generate(target, ids, max_new_tokens, assistant=helper,
                                      universal=helper is not None and not same_tokenizer(target, helper),
                                      lookup_tokens=HF_LOOKUP_TOKENS if method.drafter == "lookup" else None,
                                      temperature=temperature, seed=self.seed)
        return {"tokens": tokens, "seconds": seconds, "mode": method.spec}


def follows_schema(text: str, schema: str) -> bool:
    """Whether `text` is JSON that the schema accepts (jsonschema's validator)."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), json.loads(schema))
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def load_done(path: Path | None) -> dict[str, dict]:
    if path is None or not path.exists():
        return {}
    done = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by an interrupted run: that record runs again
            done[record["key"]] = record
    return done


def run_bench(
    runner: Runner,
    prompts: list[Prompt],
    methods: list[Method],
    temperatures: list[float] = (0.0,),
    out: Path | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    repeats: int = 1,
) -> tuple[list[dict], int]:
    """Run every method on every prompt (interleaved), `repeats` times. Returns (all records, number of new runs)."""
    done = load_done(out)
    prompts = [p for p in prompts if len(p.turns) >= runner.turn]
    todo = [(p, t, r, m) for p in prompts for t in temperatures for r in range(repeats) for m in methods
            if runner.key(p, m, t, r) not in done]
    if todo:  # one short warm-up per method: first calls pay one-off allocation costs
        ids = runner.prompt_ids(todo[0][0])
        for m in methods:
            runner.run(m, ids, todo[0][1], max_new_tokens=4, schema=runner.schema_of(todo[0][0]))
    records = dict(done)
    teach = NGramTeacher(runner, prompts, records) if any("ngram" in m.sources for m in methods) else None
    for i, (prompt, temperature, repeat, method) in enumerate(todo):
        if progress:
            progress(i, len(todo), f"{prompt.question_id} {method.spec} t={temperature}")
        if teach:
            teach.before(prompt)
        ids = runner.prompt_ids(prompt)
        record = runner.run(method, ids, temperature, runner.max_new_tokens, runner.schema_of(prompt))
        record.update(key=runner.key(prompt, method, temperature, repeat), repeat=repeat, model=runner.target.name,
                      assistant=runner.assistant.name if runner.assistant else None,
                      question_id=prompt.question_id, category=prompt.category, method=method.spec,
                      temperature=temperature, max_new_tokens=runner.max_new_tokens, prompt_tokens=len(ids),
                      new_tokens=len(record["tokens"]))
        records[record["key"]] = record
        if out is not None:
            with out.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    if progress:
        progress(len(todo), len(todo), "done")
    wanted = {runner.key(p, m, t, r) for p in prompts for t in temperatures for r in range(repeats) for m in methods}
    return [r for k, r in records.items() if k in wanted], len(todo)


class NGramTeacher:
    """Feeds the runner's n-gram cache the greedy plain output of every prompt before the current one."""

    def __init__(self, runner: Runner, prompts: list[Prompt], records: dict[str, dict]):
        self.runner, self.prompts, self.records, self.taught = runner, prompts, records, set()

    def before(self, prompt: Prompt) -> None:
        plain = Method("plain", "assistgen", "plain")
        for earlier in self.prompts[: self.prompts.index(prompt)]:
            record = self.records.get(self.runner.key(earlier, plain, 0.0))
            if earlier.question_id not in self.taught and record is not None:
                self.runner.learn(self.runner.prompt_ids(earlier), record["tokens"])
                self.taught.add(earlier.question_id)


def terminal_progress(i: int, total: int, label: str) -> None:
    """A one-line progress bar on stderr, only when it is a terminal."""
    if not sys.stderr.isatty() or total == 0:
        return
    width = 30
    filled = int(width * i / total)
    end = "\n" if i == total else ""
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {i}/{total} {label[:60]:<60}{end}")
    sys.stderr.flush()
