"""Structured outputs on the embedded real models, both backends: grammar-constrained speculation gives plain
constrained decoding's tokens for every drafter (the grammar's own jump-forward drafts among them), the output
follows the schema, and logprobs under speculation are plain decoding's. (The sampled case is tested exactly,
by enumeration, in test_rejection_exact.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from assistgen import ConfigError, EarlyExitDrafter, NGramCache, Structure, generate, load_model
from assistgen.core.constraint import Constraint

pytestmark = pytest.mark.integration

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}}, "required": ["name", "age", "city"]}
PROMPT = ("Reply in JSON with the person's name, age and city. Text: Maria Lopez is 34 and lives in Madrid. "
          "Maria Lopez works as a nurse in Madrid.")
N = 40


@pytest.fixture(scope="module", params=["llama.cpp", "torch"])
def model(request):
    return load_model("smollm2-135m", backend=request.param)


def drafting(model, name: str) -> dict:
    if name == "ngram-cache":
        cache = NGramCache()
        cache.add(list(model.tokenizer(PROMPT)["input_ids"]) + list(model.tokenizer(
            '{"name": "Maria Lopez", "age": 34, "city": "Madrid"}')["input_ids"]))
        return {"ngram_cache": cache}
    if name == "early-exit":
        return {"assistant": EarlyExitDrafter(model, layers=10)}
    return {"lookup": True}


def test_a_generation_compiles_its_grammar_once(model, monkeypatch):
    """A request's admission compiles its grammar, with its EOS tokens; the generation starts from that."""
    from assistgen.core import constraint

    compiled = []
    original = constraint.compile_structure
    monkeypatch.setattr(constraint, "compile_structure", lambda *a, **k: compiled.append(a[3]) or original(*a, **k))
    out = generate(model, PROMPT, lookup=True, json_schema=PERSON, max_new_tokens=4)
    assert len(out.token_ids) == 4 and compiled == [tuple(sorted(model.eos_token_ids))]


def masked_margin(model, prompt: list[int], tokens: list[int], position: int, structure: Structure) -> float:
    """The gap between the two most likely allowed tokens at `position` of a constrained output (teacher forced)."""
    constraint = Constraint.begin(model, structure, set(model.eos_token_ids))
    constraint.advance(tokens[:position])
    constraint.check([])
    cache = model.new_cache()
    logits = cache.feed(prompt + tokens[:position])[-1:]
    top = constraint.mask(logits)[0].topk(2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize("drafter", ["lookup", "ngram-cache"])
def test_constrained_speculation_gives_plain_constrained_decodings_tokens(model, drafter):
    check_constrained_speculation(model, drafter)


def test_constrained_early_exit_gives_plain_constrained_decodings_tokens():
    check_constrained_speculation(load_model("smollm2-135m", backend="torch"), "early-exit")  # (torch only)


def check_constrained_speculation(model, drafter: str) -> None:
    structure = Structure("json_schema", json.dumps(PERSON))
    plain = generate(model, PROMPT, chat=True, max_new_tokens=N, structure=structure)
    ours = generate(model, PROMPT, chat=True, max_new_tokens=N, structure=structure, **drafting(model, drafter))
    assert plain.stats.drafted_tokens == 0 and ours.stats.drafted_tokens > 0
    assert "grammar" in ours.stats.notes["acceptance_estimate"]  # the grammar's own drafts were verified too
    if ours.token_ids != plain.token_ids:  # the torch backend: only where the masked target is a near-tie
        assert not hasattr(model, "lib"), "llama.cpp's rows are bitwise: no near-tie excuse"
        i = next(i for i, (a, b) in enumerate(zip(ours.token_ids, plain.token_ids, strict=False)) if a != b)
        assert masked_margin(model, plain.prompt_ids, plain.token_ids, i, structure) < 1e-3
        return
    value = json.loads(plain.text)
    assert set(value) == set(PERSON["properties"]) and isinstance(value["age"], int)


def test_logprobs_under_constrained_speculation_are_plain_decodings(model):
    plain = generate(model, PROMPT, chat=True, max_new_tokens=N, json_schema=PERSON, logprobs=2)
    ours = generate(model, PROMPT, chat=True, max_new_tokens=N, json_schema=PERSON, logprobs=2, lookup=True)
    assert ours.stats.drafted_tokens > 0
    n = next((i for i, (a, b) in enumerate(zip(ours.token_ids, plain.token_ids, strict=False)) if a != b),
             len(plain.token_ids))
    assert n == len(plain.token_ids) or not hasattr(model, "lib")
    for a, b in zip(ours.logprobs[:n], plain.logprobs[:n], strict=True):
        assert a.token == b.token and abs(a.logprob - b.logprob) < 2e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top] or min(abs(x - y) for (_, x), (_, y) in
                                                                      zip(a.top, b.top, strict=True)) < 2e-4
    masked = [lp for lp in plain.logprobs if lp.top[1][1] == -9999.0]
    assert masked, "somewhere the grammar allows one token only: its alternatives have probability 0"


def test_regex_and_grammar_structures(model):
    digits = generate(model, "Maria Lopez is", max_new_tokens=8, structure=Structure("regex", " [0-9]{2} years"))
    assert digits.text[1:3].isdigit() and digits.text.endswith("years")
    yes_no = generate(model, "Is Madrid in Spain? Answer:", max_new_tokens=4, lookup=True,
                      structure=Structure("grammar", 'root ::= " yes" | " no"'))
    assert yes_no.text in (" yes", " no") and yes_no.finish_reason == "eos"
    with pytest.raises(ConfigError, match="does not compile"):
        generate(model, PROMPT, max_new_tokens=2, structure=Structure("regex", "[a-"))
    with pytest.raises(ConfigError, match="does not compile"):
        generate(model, PROMPT, max_new_tokens=2, json_schema={"type": "objekt"})
    with pytest.raises(ConfigError, match="json_schema"):
        generate(model, PROMPT, max_new_tokens=2, json_schema=3)


def test_masked_rows_are_copies(model):
    """Masking never writes into the backend's logits, and masks each row by its own position's mask, whatever
    the layout of the logits (the torch backend's can come transposed)."""
    constraint = Constraint.begin(model, Structure("json_object"), set(model.eos_token_ids))

    def allowed(row: int) -> torch.Tensor:  # [vocab] bool
        bits = constraint.masks[row].numpy().view("uint8")
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: model.vocab_size].astype(bool))

    constraint.check([])
    first = int(allowed(0).nonzero()[0])
    assert constraint.check([first]) == (1, None)
    logits = torch.randn(model.vocab_size, 2).T  # [2, vocab], strides (1, 2)
    before = logits.clone()
    masked = constraint.mask(logits)
    assert torch.equal(logits, before)
    for row in (0, 1):
        keep = allowed(row)
        assert torch.equal(torch.isfinite(masked[row]), keep) and 0 < int(keep.sum()) < model.vocab_size
        assert torch.equal(masked[row, keep], logits[row, keep])
    assert not torch.equal(allowed(0), allowed(1))


def test_the_command_line_takes_a_schema_file(tmp_path, capsys):
    from assistgen.cli.main import main

    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    assert main(["generate", "--chat", "--lookup", "--json-schema", str(schema), "--max-new-tokens", str(N),
                 "--quiet-stats", "--logprobs", "1", PROMPT]) == 0
    out = capsys.readouterr()
    assert set(json.loads(out.out)) == set(PERSON["properties"])
    assert "log-probabilities" in out.err
    (tmp_path / "bad.json").write_text("{bad")
    assert main(["generate", "--json-schema", str(tmp_path / "bad.json"), "x"]) == 2
    assert "bad.json: not valid JSON" in capsys.readouterr().err
    assert main(["generate", "--regex", "[a-", "x"]) == 2
    err = capsys.readouterr().err
    assert "does not compile" in err and ".cc:" not in err
