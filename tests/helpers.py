"""Shared test helpers: tiny randomly initialised models (built from configs, no downloads), a character
tokenizer, transformers' greedy decoding and a cache-less loop as references, a small BPE tokenizer, the
deliberately wrong verification rule the probability tests must catch, the one-sequence verification
length the loop's optimizer picks, a stand-in model for the policy's tests (`PricedModel`), the near-tie
tolerant comparison the GPU tests use, and the server's: started as a user starts it (`serve`), replies with tool
calls read whole or streamed (`tool_reply`) and checked (`assert_valid_calls`), bounded fuzzing (`fuzz_for_5xx`,
`tool_bodies`). Test modules import from here and from `reference.py` (the library's rules
and checks kept out of the package), never from each other or conftest."""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from pathlib import Path

import torch
from reference import first_divergence
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from assistgen.backends.base import Capabilities
from assistgen.backends.torch.model import Model
from assistgen.backends.torch.reference import hf_generate
from assistgen.backends.torch.transforms import untransformed
from assistgen.policy.costs import enter
from assistgen.policy.lengths import verified_lengths
from assistgen.spec.costs import PassCosts

CHARS = string.ascii_letters + string.digits + " .,;:!?'\"-\n()"
SPECIALS = ["<bos>", "<eos>", "<pad>"]


def char_tokenizer(chars: str = CHARS) -> PreTrainedTokenizerFast:
    """One token per character; ids 0..2 are <bos>, <eos>, <pad>."""
    vocab = {t: i for i, t in enumerate(SPECIALS + list(chars))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<pad>"
    )


TOKENIZER = char_tokenizer()
VOCAB = len(TOKENIZER)


SMALL_TOKENIZER = char_tokenizer("abcdefgh")  # 11 tokens: for distribution tests


def _finish(hf: torch.nn.Module, name: str, scale: float, tokenizer=TOKENIZER) -> Model:
    # Larger weights than the default init give peaked, well-separated logits (no argmax ties).
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0.0, scale)
    hf.generation_config.eos_token_id = None  # random models: run to max_new_tokens unless a test sets EOS
    hf.generation_config.pad_token_id = 2
    return Model(hf.eval(), tokenizer, name)


def tiny_llama(seed: int = 0, layers: int = 2, hidden: int = 64, scale: float = 0.3, tokenizer=TOKENIZER) -> Model:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
    )
    return _finish(LlamaForCausalLM(cfg), f"tiny-llama-{seed}", scale, tokenizer)


def tiny_gpt2(seed: int = 0, layers: int = 2, hidden: int = 64, scale: float = 0.3) -> Model:
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=4, n_positions=512,
                     bos_token_id=0, eos_token_id=1)
    return _finish(GPT2LMHeadModel(cfg), f"tiny-gpt2-{seed}", scale)


def tiny_gemma3(seed: int = 0, layers: int = 3, hidden: int = 64, window: int = 16, scale: float = 0.3) -> Model:
    """Gemma-3 layout: sliding-window layers (window 16 here) with a global layer every third."""
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
        sliding_window=window, layer_types=["sliding_attention", "sliding_attention", "full_attention"][:layers],
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )
    return _finish(Gemma3ForCausalLM(cfg), f"tiny-gemma3-{seed}", scale)


def encode(text: str) -> list[int]:
    return TOKENIZER(text)["input_ids"]


def hf_greedy(model: Model, ids: list[int], n: int, stop_at_eos: bool = False) -> list[int]:
    """transformers' own greedy decoding on the model as it is: the reference for exactness (runs all n tokens
    unless stop_at_eos)."""
    tokens, _ = hf_generate(model, ids, n, min_new_tokens=None if stop_at_eos else n, untransform=False)
    return tokens


@torch.inference_mode()
def naive_greedy(model: Model, ids: list[int], n: int) -> list[int]:
    """A plain autoregressive loop without any cache: full forward pass, argmax, append."""
    seq, device = list(ids), model.device
    for _ in range(n):
        seq.append(int(model.hf(torch.tensor([seq], device=device)).logits[0, -1].argmax()))
    return seq[len(ids):]


def small_tokenizer(pieces: list[str], merges: list[tuple[str, str]]) -> PreTrainedTokenizerFast:
    """A BPE tokenizer over `pieces` (ids from 3; 0..2 are <unk>, <s>, </s>) with the given merges."""
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"] + pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def broken_residual_from_p(p, q, draft, sampler, rejected=None):
    """A classic bug, shared by the exact and the chi-squared tests to show they can fail: on rejection draw from
    p instead of the residual norm(max(p - q, 0))."""
    for i, x in enumerate(draft):
        if sampler.uniform() < min(1.0, float(p[i, x]) / float(q[i, x])):
            continue
        return i, sampler.draw(p[i])
    return len(draft), sampler.draw(p[len(draft)])


def verified(run, draft, drafter_name: str, room: int = 1 << 30) -> int:
    """How many of `draft`'s tokens the generation loop verifies for one sequence under the schedule run `run`."""
    return verified_lengths([run], [draft], [drafter_name], [room], run.costs)[0]


@dataclass(eq=False)
class PricedModel:
    """A model as the policy reads it, without a forward pass: its weight bytes, start-up and capabilities, and the
    `cache_key` and `fingerprint` the cost book keys it by; `costs`, when given, are entered in the book as its
    measured ones (and kept here for the test to compare with)."""

    costs: PassCosts | None = None
    weight_bytes: int = 0
    startup_s: float = 0.0
    capabilities: Capabilities = field(default_factory=Capabilities)
    cache_key = None

    def __post_init__(self):
        if self.costs is not None:
            enter(self, self.costs)

    def fingerprint(self, *extra: str) -> str:
        return "priced"


def free_port() -> int:
    """A port on 127.0.0.1 nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve_command(*flags: str, timeout: float = 120, env: dict | None = None):
    """`assistgen serve` started as a user starts it (in `env`, default this process's environment), on a free
    127.0.0.1 port, once it answers /health. Returns (process, port); its output is piped to `process.stdout`."""
    import subprocess
    import sys
    import time

    import httpx

    port = free_port()
    command = [sys.executable, "-m", "assistgen.cli.main", "serve", *flags, "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None or time.monotonic() >= deadline:
            process.kill()
            raise AssertionError("the server did not start")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process, port
        except httpx.TransportError:
            time.sleep(0.2)



def stop_serve_command(process) -> str:
    """SIGTERM to a server `start_serve_command` started; asserts it exits 0 and returns what it printed."""
    import signal

    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0
    return process.stdout.read()


NEAR_TIE = {torch.float32: 1e-3, torch.bfloat16: 0.5}  # top-1 minus top-2 logit below which a swap is a tie
# (bfloat16 logits carry 8 bits of mantissa: two kernels that sum in another order can swap tokens whose logits
# are a few units in the last place apart, 0.125 at a logit of 16..32)


def transformers_greedy(model: Model, ids: list[int], n: int) -> list[int]:
    """transformers' own greedy decoding on the model as it ships (its own attention), to EOS or n tokens."""
    with untransformed(model.hf):
        return hf_greedy(model, ids, n, stop_at_eos=True)


def assert_exact_or_near_tie(model: Model, prompt: list[int], reference: list[int], ours: list[int]) -> None:
    """`ours` equals `reference`, or first differs where the target's top two logits are a near-tie."""
    d = first_divergence(model, prompt, reference, ours)
    if d is None:
        assert ours == reference
    else:
        tie = NEAR_TIE[model.hf.dtype]
        assert d.margin < tie, f"divergence at new token {d.position} with margin {d.margin:.3e} (tie: < {tie})"


# --- the server with tools (tests/chat/test_tools.py, tests/serving/test_responses.py) ------------------------------

TOOLS_TEMPLATE = Path(__file__).resolve().parent / "data" / "hermes_tools.jinja"  # (SmolLM2's own template
# renders no tools: a Hermes-style one that does)
GEMMA_TOOLS_TEMPLATE = Path(__file__).resolve().parent / "data" / "gemma_tools.jinja"  # (the shipped Gemma-3-270M
# has no chat template: Gemma-3's turns with Hermes-style calls)


def serve_smollm2_with_tools():
    """`assistgen serve` on SmolLM2 (llama.cpp, prompt lookup) with TOOLS_TEMPLATE; yields its URL (a fixture's
    body)."""
    yield from serve("smollm2-135m", "--lookup", "--chat-template", str(TOOLS_TEMPLATE))


def serve(model: str, *flags: str, timeout: float = 120):
    """`assistgen serve` on `model` (llama.cpp) with `flags`; yields its URL (a fixture's body), then stops it."""
    process, port = start_serve_command("--model", model, "--backend", "llama.cpp", *flags, timeout=timeout)
    yield f"http://127.0.0.1:{port}"
    process.terminate()
    process.wait(30)


def steps_of(tokenizer, text: str, seed: int) -> list:
    """The text's tokens as a stream would emit them (`core.state.Chunk`s), 1 to 17 accepted tokens a step, each
    chunk's text what became decodable with it (as the server's stream decodes: special tokens skipped); the last
    chunk finishes."""
    import random

    from assistgen.core.state import Chunk

    ids, rng, chunks, shown, at = tokenizer.encode(text, add_special_tokens=False), random.Random(seed), [], "", 0
    while at < len(ids):
        n = rng.randint(1, 17)
        decoded = tokenizer.decode(ids[: at + n], skip_special_tokens=True)
        chunks.append(Chunk(ids[at: at + n], decoded[len(shown):]))
        shown, at = decoded, at + n
    chunks[-1].finish_reason = "eos"
    return chunks


@dataclass
class ToolReply:
    """A chat reply with tools as the openai client gives it, streamed or not: its content, its calls as
    [name, arguments], its finish reason and the tokens it chose (from its logprobs, where asked)."""

    content: str
    calls: list[list[str]]
    finish: str | None
    tokens: list[str]
    accepted: int = field(default=0, compare=False)  # draft tokens the server accepted for it (its metrics)


def accepted_drafts(metrics: dict | None) -> int:
    return (metrics or {}).get("speculative_decoding", {}).get("num_accepted_draft_tokens", 0)


def tool_reply(client, stream: bool, **request) -> ToolReply:
    """One chat request (`request`: the create call's arguments), its reply read whole or from its stream."""
    if not stream:
        whole = client.chat.completions.create(**request)
        choice = whole.choices[0]
        calls = [[c.function.name, c.function.arguments] for c in choice.message.tool_calls or []]
        tokens = [t.token for t in choice.logprobs.content] if choice.logprobs else []
        return ToolReply(choice.message.content or "", calls, choice.finish_reason, tokens,
                         accepted_drafts(whole.model_extra.get("metrics")))
    reply = ToolReply("", [], None, [])
    for event in client.chat.completions.create(**request, stream=True):
        reply.accepted += accepted_drafts((event.model_extra or {}).get("metrics"))
        if not event.choices:  # (the usage event)
            continue
        choice = event.choices[0]
        reply.content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:  # a call starts: index, id, type and name once, then its arguments' fragments
                assert delta.index == len(reply.calls) and delta.type == "function"
                reply.calls.append([delta.function.name, ""])
            reply.calls[delta.index][1] += delta.function.arguments or ""
        reply.tokens += [t.token for t in choice.logprobs.content] if choice.logprobs else []
        reply.finish = choice.finish_reason or reply.finish
    return reply


def assert_valid_calls(reply: ToolReply, choice, parallel: bool, schemas: dict[str, dict]) -> None:
    """The reply honours `tool_choice` and `parallel_tool_calls`: no calls with "none"; with "required" or a
    function, calls only (of that function), ending the reply unless the token limit cut the last; one at most
    without `parallel`; every finished call's arguments valid for its tool's schema."""
    import json

    import jsonschema

    named = choice["function"]["name"] if isinstance(choice, dict) else None
    if choice == "none":
        assert not reply.calls and reply.finish in ("stop", "length"), reply
        return
    if choice != "auto":
        assert reply.calls and not reply.content.strip() and reply.finish in ("tool_calls", "length"), reply
    assert len(reply.calls) <= 1 or parallel, reply
    finished = reply.calls[:-1] if reply.finish == "length" else reply.calls
    for name, arguments in finished:
        assert name in schemas and named in (None, name), reply
        jsonschema.validate(json.loads(arguments), schemas[name])
    if reply.calls and reply.finish != "length":
        assert reply.finish == "tool_calls", reply


def openai_client(url: str, key: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, timeout=120, max_retries=0)


def assert_400(response, param: str, words: str) -> None:
    """A 400 whose OpenAI error body names `param` and says `words`."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def fuzz_for_5xx(url: str, bodies, base: dict, examples: int, seconds: float | None = None,
                 named: bool = False) -> dict:
    """POST `examples` bodies drawn from the hypothesis strategy `bodies` (over `base`) to `url`, for `seconds` at
    most (the rest drawn and not sent): each answer must be a 200 or a 4xx with an error message (`named`: and the
    field at fault in its `param`). Returns how many were answered and how many refused."""
    import time

    import httpx
    from hypothesis import HealthCheck, given, settings

    seen = {"ok": 0, "refused": 0}
    deadline = None if seconds is None else time.monotonic() + seconds
    with httpx.Client(timeout=120) as http:
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(bodies)
        def check(body):
            if deadline is not None and time.monotonic() > deadline:
                return
            response = http.post(url, json={**base, **body})
            assert response.status_code < 500, (body, response.text)
            if response.status_code == 200:
                seen["ok"] += 1
            else:
                error = response.json()["error"]
                assert error["message"] and (error["param"] or not named), (body, error)
                seen["refused"] += 1

        check()
    return seen


TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}


def schemas_of(tools: list[dict]) -> dict[str, dict]:
    """Each OpenAI tool's parameter schema, by its function's name."""
    return {t["function"]["name"]: t["function"]["parameters"] for t in tools}


def tool_bodies(tools: list[dict], ask: list[dict]):
    """A hypothesis strategy of chat bodies whose `tools`, `tool_choice`, `parallel_tool_calls`, `stream` and messages
    (with calls and tool results) are anything a client may send: well-formed (`tools`, `ask`) or junk."""
    from hypothesis import strategies as st

    junk = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=8),
                     st.lists(st.integers(), max_size=2))
    schema = st.recursive(
        st.fixed_dictionaries({}, optional={
            "type": st.sampled_from(["string", "integer", "number", "boolean", "null", "array", "object", "nope"]),
            "enum": st.lists(st.one_of(st.text(max_size=4), st.integers()), max_size=3),
            "pattern": st.sampled_from(["[a-z]+", "(unclosed", "^x$"]), "minLength": st.integers(-1, 3),
            "$ref": st.sampled_from(["#/nowhere", "#"])}),
        lambda inner: st.fixed_dictionaries({}, optional={
            "type": st.sampled_from(["object", "array"]),
            "properties": st.dictionaries(st.text(max_size=4), inner, max_size=3), "items": inner,
            "required": st.lists(st.text(max_size=4), max_size=2), "anyOf": st.lists(inner, max_size=2),
            "additionalProperties": st.one_of(st.booleans(), inner)}),
        max_leaves=6)
    names = st.one_of(st.sampled_from([t["function"]["name"] for t in tools] + ["f"]), st.text(max_size=10))
    tool = st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["function", "function", "web_search"]),
                               "function": st.fixed_dictionaries({"name": names}, optional={
                                   "parameters": st.one_of(schema, junk),
                                   "description": st.one_of(st.text(max_size=8), junk)})}),
        st.sampled_from(tools), junk)
    call = st.one_of(st.fixed_dictionaries({"id": st.text(max_size=4), "type": st.just("function"), "function":
                                            st.fixed_dictionaries({"name": names, "arguments": st.one_of(
                                                st.sampled_from(['{"city": "Oslo"}', "{}", "{bad", "[1]", '"x"']),
                                                junk)})}), junk)
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "assistant", "tool", "system", "developer", "function",
                                  "wizard"])},
        optional={"content": st.one_of(st.text(max_size=12), st.none(), st.lists(
            st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=6)}),
            max_size=2)), "tool_calls": st.one_of(
            st.lists(call, max_size=2), st.integers(), st.booleans(), st.text(max_size=4),
            st.dictionaries(st.text(max_size=3), junk, max_size=2)), "tool_call_id": st.one_of(
                st.text(min_size=1, max_size=4), st.text(min_size=1, max_size=4), junk)})
    return st.fixed_dictionaries(
        {"messages": st.one_of(st.lists(message, min_size=1, max_size=4),
                               st.lists(message, max_size=3).map(lambda more: ask + more))},
        optional={"tools": st.one_of(st.lists(tool, max_size=3), junk),
                  "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", "any"]), st.fixed_dictionaries(
                      {"type": st.just("function"), "function": st.fixed_dictionaries({"name": names})}), junk),
                  "parallel_tool_calls": junk, "stream": st.booleans()})


@dataclass
class Live:
    url: str
    app: object
    engine: object  # the BatchEngine
    server: object  # the uvicorn.Server
    thread: object  # the thread it runs in

    @property
    def client(self):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="test", timeout=60, max_retries=0)


def start(model, engine_settings=None, name: str = "smollm2-135m", schedule=None, **server_settings) -> Live:
    """The real app over `model` (prompt lookup, drafted as `schedule` decides: None, the cost-aware default) in
    uvicorn on a free 127.0.0.1 port, in a thread, once it answers /health."""
    import socket
    import threading
    import time

    import httpx
    import uvicorn

    from assistgen.api import default_schedule, drafter_factory
    from assistgen.serving.batching import BatchEngine
    from assistgen.serving.server import ServerSettings, create_app

    engine = BatchEngine(model, drafter_factory(model, lookup=True), schedule or default_schedule(), engine_settings)
    app = create_app(engine, ServerSettings(model_name=name, **server_settings))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # a free port, bound before uvicorn starts: no race for it
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    live = Live(f"http://127.0.0.1:{port}", app, engine, server, thread)
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    assert httpx.get(f"{live.url}/health", timeout=5).json()["status"] == "ok"
    return live


def stop(live: Live) -> None:
    live.server.should_exit = True
    live.thread.join(30)
    assert not live.thread.is_alive()
    assert live.engine.thread is None or not live.engine.thread.is_alive()  # the lifespan shut the engine down


def scrape(live: Live | str) -> dict[str, float]:
    """The /metrics samples by name (labels appended in brackets) of a live server or the one at a URL."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    url = live if isinstance(live, str) else live.url
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {s.name + "".join(f"[{v}]" for v in s.labels.values()): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# --- speech clips (tests/serving/test_transcriptions.py) ---------------------------------------------------------

SENTENCE = "The quick brown fox jumps over the lazy dog. Speculative decoding makes generation faster."


def speak(text: str, path) -> str:
    """`text` spoken by espeak-ng (installed by the Makefile) into the WAV file `path`; returns the path."""
    import shutil
    import subprocess

    import pytest

    if shutil.which("espeak-ng") is None:
        pytest.fail("espeak-ng is missing: `make install` installs it (apt-get install espeak-ng).")
    subprocess.run(["espeak-ng", "-w", str(path), text], check=True, capture_output=True)
    return str(path)


def silent_wav(seconds: float, rate: int = 16000) -> bytes:
    """A mono 16-bit WAV file of silence."""
    import io
    import wave

    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\0\0" * int(rate * seconds))
    return out.getvalue()


LONG = "the cat sat on the mat. " * 8 + "the cat sat on the"  # (greedy, it goes on repeating: long streams)


def read_stream(url: str, model: str, max_tokens: int, out: dict, first) -> None:
    """One streamed greedy completion of LONG read to its end (for shutdown tests): its status, its events, whether
    [DONE] came, and the error of a dropped connection (what a drain must never cause); `first` is set at the first
    event."""
    import json

    import httpx

    events, done = [], False
    body = {"model": model, "prompt": LONG, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    try:
        with httpx.stream("POST", f"{url}/completions", json=body, timeout=120) as response:
            out["status"] = response.status_code
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    first.set()
    except httpx.HTTPError as e:
        out["error"] = repr(e)
    out["events"], out["done"] = events, done


def final_reasons(outs: list[dict]) -> list[str]:
    """Each stream's finish reason, asserting that every stream ended well: status 200, no dropped connection,
    exactly one final chunk, then [DONE]."""
    reasons = []
    for out in outs:
        assert "error" not in out and out.get("status") == 200 and out["done"], out
        last = [e["choices"][0]["finish_reason"] for e in out["events"] if e["choices"][0]["finish_reason"]]
        assert len(last) == 1, out["events"][-3:]
        reasons.append(last[0])
    return reasons


def sigterm_mid_streams(process, url: str, model: str, late_after: float | None, wait: float) -> list[str]:
    """Three streams of LONG (two running, one waiting under --max-batch 2), SIGTERM once two have begun; with
    `late_after`, a request sent that many seconds later must be 503. Asserts the exit status is 0 and every stream
    ended well (`final_reasons`), which it returns; the process is killed if it is still alive."""
    import signal
    import threading
    import time

    import httpx

    try:
        outs = [{} for _ in range(3)]
        firsts = [threading.Event() for _ in outs]
        threads = [threading.Thread(target=read_stream, args=(url, model, 300, out, first))
                   for out, first in zip(outs, firsts, strict=True)]
        for thread in threads:
            thread.start()
        assert firsts[0].wait(wait) and firsts[1].wait(wait)
        process.send_signal(signal.SIGTERM)
        if late_after is not None:
            time.sleep(late_after)
            late = httpx.post(f"{url}/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2}, timeout=30)
            assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable"
        for thread in threads:
            thread.join(wait + 60)
        assert process.wait(wait + 60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    return final_reasons(outs)  # every stream: one final chunk, then [DONE]


def assert_error(response, status: int, param: str | None = None) -> None:
    """An httpx response is an error of `status` with OpenAI's error body, naming `param` when given."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
