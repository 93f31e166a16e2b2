"""Prompt sets in the Spec-Bench / MT-bench JSONL format.

Contract: one JSON object per line with "question_id", "category", "turns" (a non-empty list of
strings) and optionally "reference" and "schema" (a JSON schema the answer must follow: the prompt then runs
under structured output). `read_prompts` raises `DatasetError` naming the file and line
of the first bad record; `select` filters by category and draws a reproducible random subset.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path


class DatasetError(ValueError):
    """A prompt file is malformed; the message names the file, the line and the problem."""


@dataclass(frozen=True)
class Prompt:
    question_id: str
    category: str
    turns: tuple[str, ...]
    reference: tuple[str, ...] | None = None
    schema: str | None = None  # JSON text of the schema the answer must follow, or None


def default_suite() -> Path:
    return Path(str(files("assistgen").joinpath("data/suite.jsonl")))


def extraction_suite() -> Path:
    """Input-grounded extraction prompts, each with the JSON schema of its answer (structured-output benchmark)."""
    return Path(str(files("assistgen").joinpath("data/extraction.jsonl")))


def read_prompts(path: str | Path) -> list[Prompt]:
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"Prompt file not found: {path}")
    prompts, seen = [], set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path.name} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: not valid JSON ({e.msg} at column {e.colno}).") from e
        if not isinstance(record, dict):
            raise DatasetError(f"{where}: expected a JSON object with question_id, category and turns.")
        missing = [k for k in ("question_id", "category", "turns") if k not in record]
        if missing:
            raise DatasetError(f"{where}: missing {', '.join(missing)}.")
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise DatasetError(f"{where}: 'turns' must be a non-empty list of non-empty strings.")
        qid = str(record["question_id"])
        if qid in seen:
            raise DatasetError(f"{where}: duplicate question_id {qid!r}.")
        seen.add(qid)
        reference = record.get("reference")
        schema = record.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise DatasetError(f"{where}: 'schema' must be a JSON schema object.")
        prompts.append(Prompt(qid, str(record["category"]), tuple(turns),
                              tuple(map(str, reference)) if isinstance(reference, list) else None,
                              json.dumps(schema) if schema is not None else None))
    if not prompts:
        raise DatasetError(f"{path} holds no prompts.")
    return prompts


def select(prompts: list[Prompt], categories: list[str] | None = None, n: int | None = None,
           seed: int = 0) -> list[Prompt]:
    """Keep `categories` (all when None), then a reproducible random subset of n prompts (in file order)."""
    if categories:
        known = sorted({p.category for p in prompts})
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise DatasetError(f"Unknown categories {unknown}; the prompt set has {known}.")
        prompts = [p for p in prompts if p.category in categories]
    if n is not None and n < len(prompts):
        keep = set(random.Random(seed).sample(range(len(prompts)), n))
        prompts = [p for i, p in enumerate(prompts) if i in keep]
    return prompts
