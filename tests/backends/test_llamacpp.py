"""The llama.cpp backend on the embedded GGUF models: plain decoding against llama-cpp-python's own greedy loop,
every drafter token-identical to plain decoding, caches (crop, fork, batched feeds) bitwise, the batched
engine, mixed-backend pairs, and the errors a user meets. llama-cpp-python is part of `make test`: a missing
install fails here, it does not skip."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from helpers import start_serve_command
from reference import first_divergence

from assistgen import ConfigError, ModelLoadError, generate, load_model, stream
from assistgen.api import encode_prompt
from assistgen.backends.llamacpp.loading import CHECK_TEXT, check_tokenizer, llama_tokenize
from assistgen.backends.llamacpp.model import LlamaModel
from assistgen.backends.llamacpp.settings import LlamaCapacityError
from assistgen.backends.loader import LoadSettings, choose_backend
from assistgen.cli.main import main
from assistgen.config import GenerationConfig
from assistgen.policy.costs import known_costs
from assistgen.policy.rules import Constant
from assistgen.serving.batching import BatchEngine

pytestmark = pytest.mark.integration

PROMPTS = [
    "Write a Python function that reverses a string.",
    "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog.",
    "List three facts about the Moon.",
]


@pytest.fixture(scope="module")
def smol():
    model = load_model("smollm2-135m", backend="llama.cpp")
    assert isinstance(model, LlamaModel) and known_costs(model) is not None  # prepared: its cost curve measured
    return model


@pytest.fixture(scope="module")
def gemma():
    return load_model("gemma3-270m", backend="llama.cpp")


@pytest.fixture(scope="module")
def smol_torch():
    return load_model("smollm2-135m", backend="torch", fast_linear=False)


def llama_cpp_python_greedy(model: LlamaModel, ids: list[int], n: int) -> list[int]:
    """llama-cpp-python's own high-level greedy loop on the same file and kernels (its own context)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(model.path), n_ctx=1024, n_threads=model.settings.thread_count(),
                flash_attn=model.settings.flash_attention, verbose=False)
    out: list[int] = []
    for token in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0):
        out.append(token)  # an end-of-generation token is kept, as generate() keeps it
        if len(out) == n or token in model.eos_token_ids:
            break
    llm.close()
    return out


def chat_ids(model, text: str) -> list[int]:
    return encode_prompt(model, text, chat=getattr(model.tokenizer, "chat_template", None) is not None)


@pytest.mark.parametrize("text", PROMPTS[:2])
def test_plain_decoding_is_llama_cpp_pythons_own_greedy_output(smol, text):
    ids = chat_ids(smol, text)
    ours = generate(smol, ids, max_new_tokens=32)
    assert ours.token_ids == llama_cpp_python_greedy(smol, ids, 32)
    assert ours.stats.drafted_tokens == 0


def test_the_tokenizer_gives_llama_cpps_ids(smol, gemma):
    for model in (smol, gemma):
        assert list(model.tokenizer(CHECK_TEXT, add_special_tokens=False)["input_ids"]) == \
            llama_tokenize(model, CHECK_TEXT)
    wrong = LlamaModel.__new__(LlamaModel)  # smollm2's llama.cpp vocabulary with gemma's tokenizer
    wrong.__dict__.update(smol.__dict__, tokenizer=gemma.tokenizer)
    with pytest.raises(ModelLoadError, match="differs from llama.cpp's own.*--backend torch"):
        check_tokenizer(wrong)


def test_rows_in_a_verification_batch_are_bitwise_the_rows_decoded_alone(smol, gemma):
    """The guarantee the README states: with the default settings on `make llamacpp`'s build a row's logits do not
    depend on how many rows share its pass (every count up to 17: SmolLM2's Q4_1, Gemma-3's Q4_K/Q5_0/Q6_K/Q8_0)."""
    for model, counts in ((smol, range(2, 18)), (gemma, range(2, 18))):
        assert model.row_exact
        ids = chat_ids(model, PROMPTS[0])
        alone = model.new_cache()
        rows, logits = [], alone.feed(ids)
        start = alone.fork()  # after the prompt
        single = []  # logits of each row decoded alone, one token per pass
        for _ in range(max(counts)):
            rows.append(int(logits[0].argmax()))
            logits = alone.feed(rows[-1:])
            single.append(logits[0])
        for n in counts:
            batch = start.fork()
            got = batch.feed(rows[:n], logits_to_keep=n)
            for j in range(n):
                assert torch.equal(got[j], single[j]), (model.name, n, j)


def test_crop_fork_and_feed_together(smol):
    ids = chat_ids(smol, PROMPTS[1])
    a = smol.new_cache()
    first = a.feed(ids, logits_to_keep=3)
    b = a.fork()
    a.feed([5, 6, 7])
    a.crop(len(ids))  # a rejected draft rolled back
    assert len(a) == len(ids) and a.tokens == ids == b.tokens
    nxt = int(first[-1].argmax())
    one, two = smol.feed_together([(a, [nxt], 1), (b, [nxt, 11], 2)])
    assert torch.equal(one[0], two[0])  # the same sequence, in two caches, in one pass
    c = smol.new_cache()
    again = c.feed(ids + [nxt], logits_to_keep=2)
    assert torch.equal(again[1], one[0]) and torch.equal(again[0], first[-1])
    assert c.sync(ids + [99], keep_last=1) == [99] and len(c) == len(ids)


@pytest.mark.parametrize("text", PROMPTS[:2] + [pytest.param(PROMPTS[2], marks=pytest.mark.slow)])
def test_every_drafter_gives_plain_decodings_tokens(smol, smol_torch, text):
    ids = chat_ids(smol, text)
    plain = generate(smol, ids, max_new_tokens=40).token_ids
    cases = [{"lookup": True, "schedule": Constant(4)},
             {"ngram_cache": f"llama-{text[:8]}", "schedule": Constant(3)},
             {"assistant": smol, "schedule": Constant(3)},  # a llama.cpp assistant
             {"assistant": smol_torch, "schedule": Constant(3)},  # a torch assistant for a llama.cpp target
             {"suffix": True, "schedule": Constant(4)},
             {"lookup": True}]  # the adaptive policy
    for kwargs in cases:
        ours = generate(smol, ids, max_new_tokens=40, **kwargs)
        assert ours.token_ids == plain, kwargs
        if "assistant" in kwargs:
            assert ours.stats.drafted_tokens > 0 and ours.stats.mode == "assistant"
    lookup = generate(smol, ids, max_new_tokens=40, lookup=True, schedule=Constant(4))
    if text.startswith("Repeat"):
        assert lookup.stats.accepted_tokens > 0


def test_a_llama_cpp_assistant_drafts_for_a_torch_target(smol, smol_torch):
    ids = chat_ids(smol_torch, PROMPTS[0])
    plain = generate(smol_torch, ids, max_new_tokens=32)
    ours = generate(smol_torch, ids, assistant=smol, max_new_tokens=32, schedule=Constant(3))
    assert ours.stats.mode == "assistant" and ours.stats.accepted_tokens > 0
    d = first_divergence(smol_torch, ids, plain.token_ids, ours.token_ids)
    assert d is None or d.near_tie


def test_universal_gemma3_on_llama_cpp_drafted_by_smollm2(gemma, smol):
    ids = encode_prompt(gemma, "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    plain = generate(gemma, ids, max_new_tokens=32)
    ours = generate(gemma, ids, assistant=smol, max_new_tokens=32, schedule=Constant(3))
    assert ours.stats.mode == "universal" and ours.stats.draft_forward_passes > 0
    d = first_divergence(gemma, ids, plain.token_ids, ours.token_ids)
    assert d is None or d.near_tie, d


def test_stream_stop_strings_sampling_and_stats(smol):
    ids = chat_ids(smol, PROMPTS[0])
    chunks = list(stream(smol, ids, lookup=True, max_new_tokens=24))
    whole = generate(smol, ids, lookup=True, max_new_tokens=24)
    assert "".join(c.text for c in chunks) == whole.text and chunks[-1].stats.new_tokens == len(whole.token_ids)
    stop = whole.text[10:14]
    cut = generate(smol, ids, max_new_tokens=24, stop=stop)
    assert cut.finish_reason == "stop" and stop not in cut.text and whole.text.startswith(cut.text)
    a = generate(smol, ids, lookup=True, max_new_tokens=16, temperature=0.8, seed=3)
    b = generate(smol, ids, lookup=True, max_new_tokens=16, temperature=0.8, seed=3)
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0  # seeded sampling repeats


def test_the_batched_engine_steps_requests_together_with_their_single_outputs(smol):
    from functools import partial

    from assistgen.api import default_schedule, make_drafter

    prompts = [f"{w} one, {w} two, {w} one, {w} two, {w} one," for w in ("red", "blue", "green", "cat", "dog")]
    singles = [generate(smol, p, lookup=True, max_new_tokens=20).token_ids for p in prompts]
    engine = BatchEngine(smol, partial(make_drafter, smol, lookup=True), default_schedule())
    config = GenerationConfig(max_new_tokens=20)
    requests = [engine.submit(list(smol.tokenizer(p)["input_ids"]), config) for p in prompts]
    engine.start()
    try:
        got = [[t for chunk in r for t in chunk.tokens] for r in requests]
    finally:
        engine.shutdown(timeout=30)
    assert got == singles
    assert engine.largest_batch >= 2


def test_a_request_after_others_gets_a_fresh_processs_output(smol):
    """Regression: a finished request's cells were given back only when it was garbage collected, so the next
    request's rows landed below the freed ones and llama.cpp computed them differently (0.43 in a logit)."""
    from functools import partial

    from assistgen.api import default_schedule, make_drafter

    prompts = [f"{w} one, {w} two, {w} one, {w} two, {w} one," for w in ("sun", "red", "sun")]
    alone = generate(smol, prompts[0], max_new_tokens=16).token_ids
    engine = BatchEngine(smol, partial(make_drafter, smol), default_schedule()).start()
    try:
        config = GenerationConfig(max_new_tokens=16)
        got = [[t for chunk in engine.submit(list(smol.tokenizer(p)["input_ids"]), config) for t in chunk.tokens]
               for p in prompts]
    finally:
        engine.shutdown(timeout=30)
    assert got[0] == got[2] == alone


def test_capacity_errors_are_clear_and_leave_the_context_usable():
    model = load_model("smollm2-135m", backend="llama.cpp", context=256, sequences=2, fast_linear=False)
    assert model.context_length == 256
    with pytest.raises(LlamaCapacityError, match="exceed the llama.cpp context.*--context"):
        model.new_cache().feed(list(range(10, 300)))
    a, b = model.new_cache(), model.new_cache()
    with pytest.raises(LlamaCapacityError, match="more than 2 sequences.*--sequences"):
        model.new_cache()
    a.feed(list(range(10, 200)))
    with pytest.raises(LlamaCapacityError, match="no room.*KV cells"):  # 190 + 100 cells > 256 shared
        b.feed(list(range(10, 110)))
    assert len(b) == 0
    del a
    assert b.feed(list(range(10, 110))).shape == (1, model.vocab_size)  # a's cells were given back
    with pytest.raises(ConfigError, match="prompt"):
        generate(model, "word " * 400, max_new_tokens=4)


def test_choosing_the_backend():
    def chosen(spec, backend="auto", **options):
        return choose_backend(spec, LoadSettings.parse(backend, **options))

    assert chosen("smollm2-135m") == "llama.cpp"
    assert chosen("model.gguf") == "llama.cpp"
    assert chosen("smollm2-135m", quantize="int4") == "torch"
    assert chosen("smollm2-135m", device="cuda") == "torch"
    assert chosen("someone/model") == "torch"
    assert chosen("someone/model", quantize="q4_k_m") == "llama.cpp"  # a GGUF type: converted for llama.cpp
    assert chosen("someone/model", context=512) == "llama.cpp"  # an option only llama.cpp takes
    assert chosen("smollm2-135m", "torch") == "torch"
    with pytest.raises(ModelLoadError, match="Unknown backend"):
        chosen("smollm2-135m", "onnx")


def test_loading_options_are_parsed_once_into_settings_that_say_what_was_given():
    settings = LoadSettings.parse("auto", max_memory="1.5GB", dtype="bfloat16", context=512, sequences=None)
    assert settings.max_memory == 1_500_000_000 and settings.dtype is torch.bfloat16
    assert settings.given == {"max_memory", "dtype", "context"}  # None: the backend's default, not given
    llama = settings.llama_settings()
    assert llama.context == 512 and llama.max_memory == 1_500_000_000 and llama.repack is False  # (file-backed)
    smaller = settings.with_budget(10**9)
    assert smaller.max_memory == 10**9 and settings.max_memory == 1_500_000_000  # frozen: a new object
    assert "max_memory" not in settings.with_budget(None).given
    with pytest.raises(ModelLoadError, match="Unknown loading option contxt"):
        LoadSettings.parse(contxt=512)
    with pytest.raises(ConfigError, match="max_memory must be"):
        LoadSettings.parse(max_memory="lots")
    with pytest.raises(ModelLoadError, match="dtype must be"):
        LoadSettings.parse(dtype="float8")
    with pytest.raises(ConfigError, match="either as keywords or as settings"):
        load_model("smollm2-135m", settings=settings, context=256)


def test_bad_input_names_the_fix(tmp_path, smol, capsys):
    with pytest.raises(ModelLoadError, match="neither a model folder, a .gguf file"):
        load_model("no-such-model", backend="llama.cpp")
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model(str(tmp_path), backend="llama.cpp")
    with pytest.raises(ModelLoadError, match="quantize belong to the torch backend.*GGUF file requantized"):
        load_model("smollm2-135m", backend="llama.cpp", quantize="q4_k_x")
    with pytest.raises(ModelLoadError, match="GGUF type.*backend='llama.cpp'"):
        load_model("smollm2-135m", backend="torch", quantize="q4_k_m")
    with pytest.raises(ModelLoadError, match="quantize belong to the torch backend"):
        load_model("smollm2-135m", backend="llama.cpp", quantize="int4")
    with pytest.raises(ModelLoadError, match="context belong to the llama.cpp backend"):
        load_model("smollm2-135m", backend="torch", context=512)
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "missing.gguf"), backend="llama.cpp")
    with pytest.raises(ConfigError, match="early exit.*--backend torch"):
        generate(smol, "hi", early_exit=True)
    bad = tmp_path / "unknown-arch.gguf"
    write_gguf_with_architecture(bad, "no-such-architecture")
    with pytest.raises(ModelLoadError, match="llama.cpp could not load.*--backend torch"):
        load_model(str(bad), backend="llama.cpp")
    assert main(["generate", "--model", "smollm2-135m", "--backend", "llama.cpp", "--early-exit", "4", "hi"]) == 2
    assert "--backend torch" in capsys.readouterr().err
    assert main(["generate", "--model", "smollm2-135m", "--backend", "llama.cpp", "--dtype", "bfloat16", "hi"]) == 2
    assert "torch backend" in capsys.readouterr().err


def test_cli_generate_on_llama_cpp(capsys):
    assert main(["generate", "--model", "smollm2-135m", "--backend", "llama.cpp", "--lookup", "--chat",
                 "--max-new-tokens", "12", "Name a colour."]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "tok/s" in err
    assert main(["calibrate", "--model", "smollm2-135m", "--backend", "llama.cpp"]) == 0
    assert "k=0:1.00" in capsys.readouterr().out


def write_gguf_with_architecture(path, arch: str) -> None:
    """A minimal GGUF v3 file (metadata only) that names an architecture llama.cpp does not know."""
    def string(s: str) -> bytes:
        raw = s.encode()
        return struct.pack("<Q", len(raw)) + raw

    body = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + string("general.architecture") + struct.pack("<I", 8) + string(arch)
    path.write_bytes(body)


def test_the_server_on_llama_cpp_answers_concurrent_streams_like_single_requests():
    """`assistgen serve --backend llama.cpp` as a user starts it, spoken to with the official client: four
    concurrent streams each give their single request's text. (Not compared with a fresh process's output: once
    sequences have come and gone, a new one's KV cells need not lie in position order in the shared buffer, and
    flash attention sums them in cell order: docs/benchmarks.md.)"""
    import signal
    from concurrent.futures import ThreadPoolExecutor

    import openai

    process, port = start_serve_command("--model", "smollm2-135m", "--backend", "llama.cpp", "--lookup")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", timeout=60, max_retries=0)
        prompts = [f"{w} one, {w} two, {w} one, {w} two, {w} one," for w in ("red", "blue", "cat", "sun")]
        singles = [client.completions.create(model="smollm2-135m", prompt=p, max_tokens=16).choices[0].text
                   for p in prompts]

        def streamed(prompt: str) -> str:
            events = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=16, stream=True)
            return "".join(e.choices[0].text for e in events)

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(streamed, prompts, timeout=120)) == singles
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert all(singles)


def test_a_transformers_folder_is_converted_quantized_and_cached_for_llama_cpp(tmp_path, monkeypatch, smol_torch):
    """A hub-format model (the torch backend's float32 folder of SmolLM2) on llama.cpp: llama.cpp's converter and
    quantizer make a Q4_K_M file once (cached, not made again), its tokenizer is the folder's (checked), it is
    row-exact, greedy assisted output is its plain output, and it writes what the float model writes."""
    from assistgen.backends.llamacpp import convert
    from assistgen.backends.torch.loading import converted_dir

    folder = converted_dir("smollm2-135m")
    assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors"))  # (made by `smol_torch`)
    monkeypatch.setenv("ASSISTGEN_CACHE", str(tmp_path))
    model = load_model(str(folder), quantize="q4_k_m")  # auto: a GGUF type picks llama.cpp
    assert isinstance(model, LlamaModel) and model.capabilities.exact and model.tokenizer.name_or_path == str(folder)
    [made] = list((tmp_path / "gguf" / "hub").glob("*.q4_k_m.gguf"))
    assert model.path == made and not list(made.parent.glob("*.tmp"))
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    assert made.stat().st_size < 0.23 * weights  # 4-bit (q8_0 would be 0.27)
    prompt = PROMPTS[1]
    plain = generate(model, prompt, max_new_tokens=24, chat=True)
    assisted = generate(model, prompt, lookup=True, max_new_tokens=24, chat=True)
    assert assisted.token_ids == plain.token_ids and assisted.stats.drafted_tokens > 0 and assisted.stats.exact
    reference = generate(smol_torch, prompt, max_new_tokens=24, chat=True)
    assert plain.token_ids[:8] == reference.token_ids[:8]  # the same model, at 4 bits

    def fail(*args, **kwargs):
        raise AssertionError("converted again although the file is cached")

    monkeypatch.setattr(convert, "run_converter", fail)
    again = load_model(str(folder), backend="llama.cpp", quantize="q4_k_m")
    assert again.path == made
    assert generate(again, prompt, max_new_tokens=24, chat=True).token_ids == plain.token_ids


def test_auto_measures_which_backend_runs_int8_faster_for_a_folder_once_and_info_says_why(tmp_path, monkeypatch,
                                                                                          smol_torch, capsys):
    """A hub-format model asked with quantize="int8" and backend auto: both candidates (torch's int8, llama.cpp's
    q8_0) are loaded and timed once, the faster is loaded (and recorded with both figures), a second load reads
    the record without timing anything, and `assistgen info` names the choice and its reason."""
    from assistgen.backends import choice
    from assistgen.backends.torch.loading import converted_dir
    from assistgen.backends.torch.model import Model

    folder = str(converted_dir("smollm2-135m"))  # (made by `smol_torch`)
    monkeypatch.setenv("ASSISTGEN_CACHE", str(tmp_path))
    model = load_model(folder, quantize="int8", calibration="later")
    [path] = list((tmp_path / "choices").glob("*.json"))
    record = json.loads(path.read_text())
    faster = min(record["seconds"], key=lambda b: record["seconds"][b][0])
    assert record["backend"] == faster and set(record["seconds"]) == {"torch", "llama.cpp"}
    assert all(len(s) == 2 and 0 < s[0] < 1 for s in record["seconds"].values())
    assert list((tmp_path / "gguf" / "hub").glob("*.q8_0.gguf")) and list((tmp_path / "quantized").iterdir())
    if faster == "llama.cpp":
        assert isinstance(model, LlamaModel) and model.path.name.endswith(".q8_0.gguf")
    else:
        assert isinstance(model, Model) and model.quantization == "int8"

    def fail(*args, **kwargs):
        raise AssertionError("measured again although the choice is recorded")

    monkeypatch.setattr(choice, "measure", fail)
    assert choose_backend(folder, LoadSettings.parse(quantize="int8")) == faster
    assert choose_backend(folder, LoadSettings.parse("torch", quantize="int8")) == "torch"
    assert main(["info"]) == 0
    said = capsys.readouterr().out
    assert f"{folder} int8: {faster}: {faster} decodes" in said and "tok/s" in said
