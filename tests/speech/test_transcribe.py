"""Transcripts on the embedded Whisper models: every drafter gives transformers' own greedy transcript."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from assistgen.config import ConfigError
from assistgen.policy.rules import Constant
from assistgen.speech.audio import AudioError, read_audio
from assistgen.speech.transcribe import transcribe


@functools.cache  # (the same speech model and clip give the same transcript: computed once per session)
def reference(speech, path, language="en") -> list[int]:
    """transformers' generate() on the same features: greedy, short-form, no timestamps."""
    features = speech.features(read_audio(path))
    kwargs = {"language": language, "task": "transcribe"} if speech.multilingual else {}
    with torch.inference_mode():
        out = speech.hf.generate(features, **kwargs)[0].tolist()
    return [t for t in out if t < speech.generation.eos_token_id]  # its text tokens


def spoken(window, speech) -> list[int]:
    assert window.token_ids[-1] == speech.generation.eos_token_id  # it ended by itself
    return window.token_ids[:-1]


DRAFTERS = {
    "plain": {},
    "lookup": {"lookup": True},
    "ngram": {"ngram_cache": True},
    "early-exit": {"early_exit": 3},
    "assistant (universal)": {"assistant": "whisper-tiny-en"},
    "assistant (universal, float)": {"assistant": "whisper-tiny-en", "draft_weights": "float"},
    "assistant (same tokenizer)": {"assistant": "whisper-base"},  # (its own int8 copy, its own encoder)
    "self-draft int8": {"self_draft": True},
    "self-draft int4": {"self_draft": True, "draft_weights": "int4"},
}


# Every kind of drafter on a forced schedule (its verification path runs); on the adaptive one, two of them in
# `make test`, and the rest in `make test-slow` (the same transcript through the same loop, nine more Whisper runs:
# the adaptive ones, and the float universal assistant and the int4 self-draft, variants of kinds tested here).
ADAPTIVE_FAST = ("plain", "lookup")
FORCED_SLOW = ("assistant (universal, float)", "self-draft int4")
CASES = [pytest.param(name, forced, id=f"{'k=3' if forced else 'adaptive'}-{name}",
                      marks=() if (name not in FORCED_SLOW if forced else name in ADAPTIVE_FAST) else pytest.mark.slow)
         for forced in (False, True) for name in DRAFTERS]


@pytest.mark.parametrize("name, forced", CASES)
def test_every_drafter_gives_the_reference_transcript(whisper_base, whisper_tiny_en, clip, repeated_clip, name,
                                                      forced):
    drafted = 0
    for path in (clip, repeated_clip):
        kwargs = dict(DRAFTERS[name], schedule=Constant(k=3)) if forced else DRAFTERS[name]
        out = transcribe(whisper_base, path, language="en", **kwargs)
        assert len(out.windows) == 1
        assert spoken(out.windows[0], whisper_base) == reference(whisper_base, path)
        drafted += out.stats.drafted_tokens
    if forced and name != "plain":
        assert drafted > 0  # the verification path ran (the n-gram cache: on the repeated clip, whatever ran before)


def test_drafts_are_accepted_where_the_speech_repeats(whisper_base, repeated_clip):
    out = transcribe(whisper_base, repeated_clip, language="en", lookup=True, schedule=Constant(k=3))
    assert out.text.lower().count("please") == 3
    assert out.stats.accepted_tokens >= 6


def test_the_universal_assistant_is_accepted(whisper_base, clip):
    out = transcribe(whisper_base, clip, language="en", assistant="whisper-tiny-en", schedule=Constant(k=3))
    assert out.stats.accepted_tokens >= out.stats.drafted_tokens // 2  # tiny.en hears what base hears


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_the_self_draft_runs_the_quantized_decoder_and_is_accepted(whisper_base, clip, scheme):
    from assistgen.backends.torch.quantized_layers import QuantizedLinear

    out = transcribe(whisper_base, clip, language="en", self_draft=True, draft_weights=scheme, schedule=Constant(k=3))
    copy = whisper_base.drafting[scheme]
    layers = copy.hf.model.decoder.layers
    assert all(isinstance(layer.fc1, QuantizedLinear) and isinstance(layer.self_attn.qkv, QuantizedLinear)
               and layer.self_attn.q_proj is None for layer in layers)  # the drafts came from quantized weights
    # (query, key and value in one product, the attention's scale folded into the query's weights)
    assert all(layer.self_attn.scaling == layer.encoder_attn.scaling == 1.0 for layer in layers)
    assert not any(isinstance(m, QuantizedLinear) for m in whisper_base.hf.modules())  # the target's are untouched
    assert whisper_base.hf.model.decoder.layers[0].self_attn.scaling == 64 ** -0.5
    assert copy.hf.model.encoder.layers[0].fc1.weight is whisper_base.hf.model.encoder.layers[0].fc1.weight  # shared
    assert out.stats.accepted_tokens >= 0.8 * out.stats.drafted_tokens > 0  # its own decoder: it agrees


def test_the_self_draft_starts_from_its_measured_agreement(whisper_base, clip):
    from assistgen import Adaptive
    from assistgen.speech.audio import read_audio
    from assistgen.speech.drafting import self_drafter

    out = transcribe(whisper_base, clip, language="en", self_draft=True)  # the cost-aware policy chooses k
    assert out.stats.accepted_tokens > 0
    measured = whisper_base.agreement["int8"]
    assert 0.8 < measured <= 1.0  # measured once: the int8 decoder agrees with the float one
    heard = whisper_base.listen(whisper_base.features(read_audio(clip)), begin=4)
    drafter = self_drafter(heard, "int8")
    assert drafter.acceptance_prior == measured
    run = Adaptive().prepare(heard, [drafter])
    assert run.estimate(drafter.name).estimate()[0] == pytest.approx(measured)  # the policy starts from it


def test_a_draft_ends_at_the_end_token(whisper_base, clip):
    from assistgen.config import GenerationConfig
    from assistgen.spec.sampling import Sampler
    from assistgen.speech.drafting import self_drafter

    plain = transcribe(whisper_base, clip, language="en").windows[0]
    heard = whisper_base.listen(whisper_base.features(read_audio(clip)), begin=len(plain.prompt_ids))
    draft = self_drafter(heard, "int8").propose(plain.prompt_ids + plain.token_ids[:-3], 16,
                                                 Sampler(GenerationConfig()))
    assert draft.tokens[-1] == whisper_base.generation.eos_token_id  # the transcript's end, drafted
    assert len(draft.tokens) <= 3  # and nothing after it: it would never be emitted


def test_an_assistants_encoder_is_priced_before_it_runs(whisper_base, whisper_tiny_en, clip, monkeypatch):
    import assistgen.policy.costs
    from assistgen.speech.drafting import assistant_drafter
    from assistgen.speech.windows import expected_tokens

    def measured_again(*args, **kwargs):
        raise AssertionError("an assistant's passes measured again: the cost book keeps them for every window")

    samples = read_audio(clip)
    transcribe(whisper_base, clip, language="en", assistant=whisper_tiny_en, draft_weights="float",
               schedule=Constant(k=2))  # tiny.en's encoder has run, and been timed, and its passes too
    monkeypatch.setattr(assistgen.policy.costs, "calibrate", measured_again)  # kept in the cost book: not read
    # again, nor measured, for the next window
    features, spoken_frames = whisper_base.features(samples), -(-samples.size // 160)
    heard = whisper_base.listen(features, begin=4)
    drafter = assistant_drafter(heard, whisper_tiny_en, features, spoken_frames, "en")  # its encoder runs when it
    # first drafts
    pending = drafter.model.startup_s
    assert 0 < pending == pytest.approx(whisper_tiny_en.encoder_s_per_frame * drafter.model.encoded.frames_read)
    assert drafter.model.encoded.frames_read == -(-samples.size // 160) + 100  # the audio and a second of padding
    drafter.model.encoded.layers()
    assert drafter.model.startup_s == 0.0  # encoded: nothing left to pay
    assert expected_tokens(100) == 5  # what the policy prices it against: 4 tokens a second, and the end token


def test_the_assistant_drafts_in_int8_by_default(whisper_base, whisper_tiny_en, clip):
    from assistgen.backends.torch.quantized_layers import Int8Linear

    out = transcribe(whisper_base, clip, language="en", assistant=whisper_tiny_en, schedule=Constant(k=3))
    assert out.stats.drafted_tokens > 0
    assert isinstance(whisper_tiny_en.drafting["int8"].hf.model.decoder.layers[0].fc2, Int8Linear)


def test_the_english_only_model_transcribes_alone_and_as_its_own_reference(whisper_tiny_en, clip):
    out = transcribe(whisper_tiny_en, clip, lookup=True, schedule=Constant(k=3))
    assert spoken(out.windows[0], whisper_tiny_en) == reference(whisper_tiny_en, clip)
    assert out.language is None


def test_the_language_is_detected_as_transformers_does(whisper_base, clip):
    out = transcribe(whisper_base, clip)
    assert out.language == "en"
    features = whisper_base.features(read_audio(clip))
    detected = whisper_base.hf.detect_language(features)  # [batch] language token ids
    assert int(detected[0]) == whisper_base.languages["en"]


def long_form(speech, samples, **kwargs) -> tuple[list[int], list[tuple[float, float]], str]:
    """transformers' generate() with timestamps (long-form over 30 s, as its docs feed it: the features of the whole
    audio, uncut): its segments' tokens, their times, the text."""
    features = speech.long_features(samples) if samples.size > 16000 * 30 else speech.features(samples)
    with torch.inference_mode():
        out = speech.hf.generate(features, language="en", task="transcribe", return_timestamps=True,
                                 return_segments=True, **kwargs)
    segments = out["segments"][0]
    tokens = [t for segment in segments for t in segment["tokens"].tolist()]
    return tokens, [(float(s["start"]), float(s["end"])) for s in segments], \
        speech.tokenizer.decode(out["sequences"][0].tolist(), skip_special_tokens=True).strip()


def timestamped(out) -> tuple[list[int], list[tuple[float, float]], str]:
    return [t for s in out.segments for t in s.token_ids], [(s.start_s, s.end_s) for s in out.segments], out.text


LONG_DRAFTERS = ["early-exit", "assistant (universal)",  # (the other four in `make test-slow`; each drafted run is
                 # compared with transformers' own long-form output)
                 *(pytest.param(name, marks=pytest.mark.slow)
                   for name in ("plain", "lookup", "assistant (same tokenizer)", "self-draft int8"))]


@pytest.fixture(scope="module")
def long_reference(whisper_base, long_clip):
    samples = read_audio(long_clip)
    assert samples.size > 16000 * 30  # long-form
    return samples, long_form(whisper_base, samples)


@pytest.mark.parametrize("name", LONG_DRAFTERS)
def test_long_audio_is_decoded_as_transformers_long_form_does(whisper_base, whisper_tiny_en, long_reference, name):
    samples, reference_out = long_reference
    out = transcribe(whisper_base, samples, language="en", schedule=Constant(k=3), **DRAFTERS[name])
    assert timestamped(out) == reference_out  # the same segments' tokens, the same times, the same text
    assert len(out.windows) >= 2 and len(out.segments) >= 4
    assert 0 < out.windows[1].start_s < 30  # the second window starts where the first one's last segment ended
    first = whisper_base.generation.no_timestamps_token_id + 1
    assert all(s.token_ids[0] >= first for s in out.segments)  # every segment opens with a timestamp
    if name != "plain":
        assert out.stats.drafted_tokens > 0  # the verification path ran on the timestamped windows


def test_long_audio_conditioned_on_the_text_before(whisper_base, long_reference):
    samples, _ = long_reference
    reference_out = long_form(whisper_base, samples, condition_on_prev_tokens=True)
    out = transcribe(whisper_base, samples, language="en", condition_on_previous=True, self_draft=True,
                     schedule=Constant(k=3))  # (drafted: the conditioning and the verification path at once)
    assert timestamped(out) == reference_out
    assert out.windows[1].prompt_ids[0] == whisper_base.generation.prev_sot_token_id  # the text before it


def test_long_audio_with_a_prompt(whisper_base, long_reference):
    samples, _ = long_reference
    prompt = "A history of the harbor, its warehouses and its festival."
    prompt_ids = whisper_base.tokenizer.get_prompt_ids(prompt, return_tensors="pt")
    reference_out = long_form(whisper_base, samples, prompt_ids=prompt_ids)
    out = transcribe(whisper_base, samples, language="en", prompt=prompt, lookup=True)
    assert timestamped(out) == reference_out
    assert all(w.prompt_ids[1:1 + len(prompt_ids) - 1] == prompt_ids[1:].tolist() for w in out.windows)


def test_short_audio_with_timestamps(whisper_base, clip):
    samples = read_audio(clip)
    reference_out = long_form(whisper_base, samples)
    for kwargs in ({}, {"self_draft": True, "schedule": Constant(k=3)}):
        out = transcribe(whisper_base, clip, timestamps=True, **kwargs)  # (the language detected)
        assert timestamped(out) == reference_out and out.language == "en"
    assert len(out.segments) >= 2 and out.segments[-1].end_s <= samples.size / 16000


def test_thirty_seconds_and_less_than_a_frame_more_is_one_window(whisper_base, clip):
    samples = read_audio(clip)
    padded = np.concatenate([samples, np.zeros(16000 * 30 + 159 - len(samples), np.float32)])  # 3000 frames
    out = transcribe(whisper_base, padded, language="en", max_new_tokens=3)
    assert not out.timestamps and len(out.windows) == 1  # short-form, as transformers takes 3000 frames


@pytest.mark.parametrize("kwargs, words", [
    ({"language": "xx"}, "does not know the language"),
    ({"task": "summarize"}, "task must be one of"),
    ({"assistant": "whisper-tiny-en", "early_exit": True}, "Choose one model drafter"),
    ({"self_draft": True, "early_exit": 2}, "Choose one model drafter"),
    ({"self_draft": True, "draft_weights": "float"}, "self_draft needs quantized drafting weights"),
    ({"condition_on_previous": True}, "needs timestamp decoding"),
    ({"condition_on_previous": True, "timestamps": True, "temperature": 0.7}, "temperatures below 0.5"),
    ({"draft_weights": "int2"}, "draft_weights must be one of"),
    ({"max_new_tokens": 0}, "max_new_tokens must be in 1.."),
])
def test_bad_settings_name_the_fix(whisper_base, clip, kwargs, words):
    with pytest.raises(ConfigError, match=words):
        transcribe(whisper_base, clip, **kwargs)


def test_english_only_models_refuse_other_languages(whisper_tiny_en, clip):
    with pytest.raises(ConfigError, match="English-only"):
        transcribe(whisper_tiny_en, clip, language="fr")


@pytest.mark.parametrize("data, words", [(b"", "is empty"), (b"not audio at all", "not audio in a format")])
def test_bad_audio_names_the_problem(whisper_base, data, words):
    with pytest.raises(AudioError, match=words):
        transcribe(whisper_base, data)


def test_audio_over_the_limit_is_refused(whisper_base, clip):
    with pytest.raises(AudioError, match="over the limit of 2 s"):
        transcribe(whisper_base, clip, max_seconds=2)


def test_the_decoders_linear_routes_are_tuned_per_row_count(whisper_base):
    """Whether the small-row transform pays is this CPU's answer; the mechanism is tested on every CPU: where it was
    not applied no layer is swapped and no routes are recorded, and a model forced to take it tunes its routes."""
    from assistgen.backends.torch.small_rows import SmallRowsLinear, applied_routes
    from assistgen.speech.transcribe import load_speech_model

    model = whisper_base
    if model.routes is None:  # measured no faster here: off, then forced on a model of its own
        assert not any(isinstance(m, SmallRowsLinear) for m in model.hf.modules())
        model = load_speech_model("whisper-base")
        model.optimize("on")
    record = model.routes  # measured on this machine over a second of silence (or remembered from disk)
    assert record is not None and applied_routes(model.hf) == record["routes"]
    times = record["step_seconds"]
    for n in range(1, len(times["mkl"]) + 1):  # each row count on the route that measured fastest for it
        fastest = min(times, key=lambda route: times[route][n - 1])
        assert record["routes"][n] == fastest or times[record["routes"][n]][n - 1] == times[fastest][n - 1]
    head = model.hf.get_output_embeddings()
    assert isinstance(head, SmallRowsLinear) and head.routes == record["routes"]


def test_a_transcription_stops_when_its_caller_cancels(whisper_base, clip):
    from assistgen import Cancelled

    asked = []

    def cancelled() -> bool:  # asked before the window and after each step: it answers True on the fourth ask
        asked.append(True)
        return len(asked) >= 4

    with pytest.raises(Cancelled):
        transcribe(whisper_base, clip, language="en", cancelled=cancelled)
    assert len(asked) == 4  # it stopped at once: three steps decoded, not the whole transcript
    assert transcribe(whisper_base, clip, language="en", cancelled=lambda: False).text  # never cancelled: the text
    with pytest.raises(ConfigError, match="cancelled must be a callable"):
        transcribe(whisper_base, clip, language="en", cancelled=True)


def test_an_assistant_extracting_the_same_features_reads_the_targets(whisper_base, whisper_tiny_en, clip):
    from assistgen.speech.windows import Audio

    audio = Audio(whisper_base, whisper_tiny_en, read_audio(clip))
    assert audio.same  # (80 mel bins both)
    window = whisper_base.window_of(audio.features, 0)[0]
    assert torch.equal(audio.helper_window(0, window), window)
    assert audio.helper_features is None  # extracted once: the target's


def test_the_cli_prints_the_segments(long_clip, capsys):
    import json
    import subprocess
    import sys

    from assistgen.cli.main import main

    tiny = ["--model", "whisper-tiny-en"]  # (the CLI's printing is the point here: the smaller Whisper)
    run = subprocess.run([sys.executable, "-m", "assistgen.cli.main", "transcribe", long_clip, *tiny, "--self-draft",
                          "--language", "en", "--quiet-stats"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().split("\n")
    assert len(lines) >= 4 and lines[0].startswith("[0.00 --> ") and "harbor" in lines[0].lower()
    assert main(["transcribe", long_clip, *tiny, "--json", "--language", "en", "--quiet-stats"]) == 0  # (in this
    # process: the command's code, without a second interpreter's start)
    out = json.loads(capsys.readouterr().out)
    assert [s["text"].strip() for s in out["segments"]] == [line.split("] ", 1)[1] for line in lines]
    assert len(out["windows"]) >= 2 and out["segments"][-1]["end"] <= out["duration"]
