"""Shared test helpers: tiny randomly initialised models (built from configs, no downloads), a character
tokenizer, transformers' greedy decoding and a cache-less loop as references, a small BPE tokenizer, the
deliberately wrong verification rule the probability tests must catch, the one-sequence verification
length the loop's optimizer picks, a stand-in model for the policy's tests (`PricedModel`), and the near-tie
tolerant comparison the GPU tests use. Test modules import from here and from `reference.py` (the library's rules
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


def start_serve_command(*flags: str, timeout: float = 120):
    """`assistgen serve` started as a user starts it, on a free 127.0.0.1 port, once it answers /health.
    Returns (process, port); its output is piped to `process.stdout`."""
    import subprocess
    import sys
    import time

    import httpx

    port = free_port()
    command = [sys.executable, "-m", "assistgen.cli.main", "serve", *flags, "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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


def serve_smollm2_with_tools():
    """`assistgen serve` on SmolLM2 (llama.cpp, prompt lookup) with TOOLS_TEMPLATE; yields its URL (a fixture's
    body)."""
    process, port = start_serve_command("--model", "smollm2-135m", "--backend", "llama.cpp", "--lookup",
                                        "--chat-template", str(TOOLS_TEMPLATE))
    yield f"http://127.0.0.1:{port}"
    process.terminate()
    process.wait(30)


def openai_client(url: str, key: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, timeout=120, max_retries=0)


def assert_400(response, param: str, words: str) -> None:
    """A 400 whose OpenAI error body names `param` and says `words`."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def fuzz_for_5xx(url: str, bodies, base: dict, examples: int) -> dict:
    """POST `examples` bodies drawn from the hypothesis strategy `bodies` (over `base`) to `url`: each answer must be
    a 200 or a 4xx with an error message. Returns how many were answered and how many refused."""
    import httpx
    from hypothesis import HealthCheck, given, settings

    seen = {"ok": 0, "refused": 0}
    with httpx.Client(timeout=120) as http:
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(bodies)
        def check(body):
            response = http.post(url, json={**base, **body})
            assert response.status_code < 500, (body, response.text)
            if response.status_code == 200:
                seen["ok"] += 1
            else:
                assert response.json()["error"]["message"], body
                seen["refused"] += 1

        check()
    return seen


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


def start(model, engine_settings=None, name: str = "smollm2-135m", **server_settings) -> Live:
    """The real app over `model` (prompt lookup) in uvicorn on a free 127.0.0.1 port, in a thread, once it answers
    /health."""
    import socket
    import threading
    import time

    import httpx
    import uvicorn

    from assistgen.api import default_schedule, drafter_factory
    from assistgen.serving.batching import BatchEngine
    from assistgen.serving.server import ServerSettings, create_app

    engine = BatchEngine(model, drafter_factory(model, lookup=True), default_schedule(), engine_settings)
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
