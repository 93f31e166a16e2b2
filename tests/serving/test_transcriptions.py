"""POST /v1/audio/transcriptions end to end: `assistgen serve --speech-model whisper-base --speech-assistant
whisper-tiny-en` started as a user starts it (one server for the module), spoken to with the official `openai` client
and httpx on 127.0.0.1; its transcripts compared with `assistgen.transcribe` in this process; no mocks."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from helpers import SENTENCE, openai_client, scrape, silent_wav, speak, start, start_serve_command, stop, tiny_llama

from assistgen import transcribe

pytestmark = pytest.mark.integration

SPEECH = "whisper-base"
TEXT = "smollm2-135m"
LIMIT_S = 20  # the server's --max-audio-seconds
UPLOAD = 1_000_000  # its --max-upload (1MB)
REQUESTS = "assistgen:transcription_requests_total"


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> str:
    return speak(SENTENCE, tmp_path_factory.mktemp("speech") / "sentence.wav")


@pytest.fixture(scope="module")
def served():
    """The server, drafting with tiny.en in universal mode, k = 3 (so that every request drafts)."""
    process, port = start_serve_command("--model", TEXT, "--speech-model", SPEECH, "--speech-assistant",
                                        "whisper-tiny-en", "--schedule", "constant:3", "--max-audio-seconds",
                                        str(LIMIT_S), "--max-upload", "1MB", timeout=300)
    yield f"http://127.0.0.1:{port}"
    process.terminate()
    assert process.wait(60) == 0
    assert f"serving {TEXT} and {SPEECH} at" in process.stdout.read()


@pytest.fixture(scope="module")
def expected(clip):
    """The library's own greedy transcript of the clip, plain decoding, in this process."""
    return transcribe(SPEECH, clip, logprobs=True)


@pytest.fixture(scope="module")
def expected_timed(clip):
    """The same with timestamps (what verbose_json, srt and vtt decode)."""
    return transcribe(SPEECH, clip, logprobs=True, timestamps=True)


def transcribed(client: openai.OpenAI, clip: str, **kwargs):
    with open(clip, "rb") as f:
        return client.audio.transcriptions.create(file=f, **kwargs)


def test_every_format_gives_the_librarys_transcript_and_the_metrics_count_it(served, clip, expected, expected_timed):
    client = openai_client(served, "key")
    before = scrape(served)
    as_json = transcribed(client, clip, model=SPEECH)
    as_text = transcribed(client, clip, model="whisper-1", response_format="text")  # (clients' default name)
    verbose = transcribed(client, clip, model=SPEECH, response_format="verbose_json", language="en", temperature=0,
                          timestamp_granularities=["segment"])
    srt = transcribed(client, clip, model=SPEECH, response_format="srt")
    vtt = transcribed(client, clip, model=SPEECH, response_format="vtt")
    after = scrape(served)

    assert expected.text.lower().startswith("the quick brown fox")
    assert as_json.text == as_text == expected.text
    assert verbose.text == expected_timed.text and expected_timed.text.lower().startswith("the quick brown fox")
    assert verbose.language == "english" and verbose.duration == pytest.approx(expected.duration_s, abs=1e-3)
    timed, (window,) = expected_timed.segments, expected_timed.windows
    assert len(verbose.segments) == len(timed) >= 2  # the model's own segments, between its timestamps
    first = 50364  # <|0.00|>: the timestamps, left out of a segment's tokens
    for i, (segment, want) in enumerate(zip(verbose.segments, timed, strict=True)):
        assert (segment.id, segment.seek, segment.temperature) == (i, 0, 0.0)
        assert (segment.start, segment.end) == (round(want.start_s, 3), round(want.end_s, 3))
        assert segment.text == want.text and segment.tokens == [t for t in want.token_ids if t < first]
        # (as Whisper gives them: its window's, every token it generated)
        assert segment.avg_logprob == pytest.approx(window.avg_logprob, abs=1e-4) and segment.avg_logprob < 0
        assert 0 < segment.compression_ratio < 2.4 and segment.no_speech_prob is None
    assert 0 == verbose.segments[0].start < verbose.segments[0].end <= verbose.segments[1].start
    assert verbose.segments[-1].end <= expected.duration_s + 0.02
    cues = srt.strip().split("\n\n")
    assert len(cues) == len(timed) and cues[0].startswith("1\n00:00:00,000 --> 00:00:0")
    assert cues[1].split("\n")[2] == timed[1].text.strip()
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> ") and timed[-1].text.strip() in vtt
    stats = as_json.model_extra["assistgen"]
    timed_stats = verbose.model_extra["assistgen"]
    assert stats["drafted"] > 0 and 0 < stats["accepted"] <= stats["drafted"] and stats["exact"]
    assert stats["acceptance_rate"] == pytest.approx(stats["accepted"] / stats["drafted"])
    assert stats["new_tokens"] == len(expected.windows[0].token_ids) and stats["steps"] > 0 and stats["decoder_s"] > 0
    assert timed_stats["new_tokens"] == sum(len(w.token_ids) for w in expected_timed.windows)
    assert timed_stats["drafted"] > 0  # the timestamped windows were drafted too
    assert as_json.usage.seconds == pytest.approx(expected.duration_s, abs=1e-3)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta(f"{REQUESTS}[200]") == 5
    assert delta("assistgen:transcription_audio_seconds_total") == pytest.approx(5 * expected.duration_s, abs=1e-3)
    for name, key in [("spec_decode_num_draft_tokens", "drafted"), ("spec_decode_num_accepted_tokens", "accepted"),
                      ("spec_decode_num_drafts", "draft_steps"), ("generation_tokens", "new_tokens")]:
        # (greedy: each format's requests draft the same; srt and vtt decode as verbose_json does)
        assert delta(f"assistgen:transcription_{name}_total") == 2 * stats[key] + 3 * timed_stats[key], name
    assert delta("assistgen:transcription_seconds_count") == 5
    listed = [m["id"] for m in httpx.get(f"{served}/v1/models", timeout=10).json()["data"]]
    assert listed == [TEXT, SPEECH] and client.models.retrieve(SPEECH).model_extra["max_model_len"] == 448


def test_transcriptions_wait_their_turn_off_the_event_loop(served, clip, expected):
    """Two at once: both the library's transcript, one after the other on the speech thread, while the event loop
    keeps answering (health, a text completion)."""
    client = openai_client(served, "key")
    with ThreadPoolExecutor(2) as pool:
        replies = [pool.submit(transcribed, client, clip, model=SPEECH) for _ in range(2)]
        time.sleep(0.5)
        health = httpx.get(f"{served}/health", timeout=10)
        completion = client.completions.create(model=TEXT, prompt="The cat sat on the", max_tokens=2)
        answered_meanwhile = not all(r.done() for r in replies)
        texts = [r.result(timeout=300).text for r in replies]
    assert health.json()["status"] == "ok" and completion.usage.completion_tokens == 2 and answered_meanwhile
    assert texts == [expected.text] * 2


PARAGRAPH = ("Once upon a time there was a little village at the foot of a mountain. Every morning the baker opened "
             "his shop and sold fresh bread to the people of the village, and the children walked to school.")


def test_a_client_that_goes_away_stops_its_transcription(served, tmp_path, expected, clip):
    long_clip = speak(PARAGRAPH, tmp_path / "paragraph.wav")  # (about 12 s: seconds of decoding on this CPU)
    before = scrape(served)
    with open(long_clip, "rb") as f, httpx.Client(timeout=httpx.Timeout(60, read=0.3)) as http:
        with pytest.raises(httpx.ReadTimeout):  # a client that gives up waiting, once its upload is sent
            http.post(f"{served}/v1/audio/transcriptions", data={"model": SPEECH}, files={"file": f})
    deadline = time.monotonic() + 60
    while scrape(served).get(f"{REQUESTS}[499]", 0) == before.get(f"{REQUESTS}[499]", 0):
        assert time.monotonic() < deadline, "the abandoned transcription was never stopped"
        time.sleep(0.1)
    after = scrape(served)
    assert after.get(f"{REQUESTS}[200]", 0) == before.get(f"{REQUESTS}[200]", 0)  # stopped, not finished
    assert transcribed(openai_client(served, "key"), clip, model=SPEECH).text == expected.text  # the next one runs


def test_a_full_queue_is_429(served, clip):
    """More transcriptions at once than the service queues (8 behind the running one): some refused, with OpenAI's
    error body, never a 5xx; the others transcribed."""
    audio = Path(clip).read_bytes()
    with ThreadPoolExecutor(14) as pool:
        responses = list(pool.map(lambda _: post(served, {"model": SPEECH}, ("sentence.wav", audio)), range(14),
                                  timeout=300))
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 429} and codes.count(429) >= 1, codes
    for r in responses:
        if r.status_code == 429:
            error = r.json()["error"]
            assert error["type"] == "rate_limit_error" and "try again" in error["message"], error


def test_a_long_prompt_keeps_its_end_as_whisper_does(clip):
    out = transcribe(SPEECH, clip, prompt="word " * 1000, language="en", max_new_tokens=2)
    prompt = out.windows[0].prompt_ids
    assert len(prompt) == 1 + 223 + 4  # <|startofprev|>, the prompt's last 223 tokens, sot, language, task, no ts


def post(url: str, data: dict, file: tuple | list | None) -> httpx.Response:
    """A multipart form with `data`'s fields and `file` as its file (a list: the parts as they are)."""
    files = {"file": file} if isinstance(file, tuple) else file
    return httpx.post(f"{url}/v1/audio/transcriptions", data=data, files=files, timeout=60)


def assert_refused(response: httpx.Response, status: int, param: str, words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"], error


PNG = bytes.fromhex("89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c4890000000d49444154789c636000"
                    "0002000154a24f5d0000000049454e44ae426082")  # a 1x1 image: FFmpeg opens it, and finds no audio


def test_bad_requests_are_refused_naming_the_problem(served, clip):
    audio = ("sentence.wav", Path(clip).read_bytes())
    ok = {"model": SPEECH}
    cases = [  # (form fields, file, status, the field named, words of the message)
        (ok, ("empty.wav", b""), 400, "file", "is empty"),
        (ok, ("notes.txt", b"not audio at all"), 400, "file", "not audio in a format"),
        (ok, ("image.png", PNG), 400, "file", "no audio stream"),
        (ok, ("header.wav", audio[1][:44]), 400, "file", "holds no samples"),
        (ok, ("long.wav", silent_wav(LIMIT_S + 5)), 400, "file", f"over the limit of {LIMIT_S} s"),
        (ok, ("big.wav", bytes(UPLOAD + 1)), 413, "file", f"at most {UPLOAD:,} bytes"),
        (ok, ("huge.wav", bytes(3 * UPLOAD)), 413, "file", f"at most {UPLOAD:,} bytes"),  # (refused unread)
        (ok, [("prompt", (None, b"Hello."))], 400, "file", "upload the audio"),
        (ok, [("file", (None, b"not a file part"))], 400, "file", "as a file part"),
        ({}, audio, 400, "model", f"give the speech model's name, {SPEECH}"),
        ({"model": "gpt-4o-transcribe"}, audio, 404, "model", f"transcribes with '{SPEECH}'"),
        ({"model": TEXT}, audio, 404, "model", "is this server's text model"),
        ({**ok, "response_format": "xml"}, audio, 400, "response_format", "json, text, verbose_json, srt, vtt"),
        ({**ok, "response_format": "verbose_json", "timestamp_granularities[]": "word"}, audio, 400,
         "timestamp_granularities[]", "word timestamps are not computed"),
        ({**ok, "timestamp_granularities[]": "segment"}, audio, 400, "timestamp_granularities[]",
         "needs response_format=verbose_json"),
        ({**ok, "response_format": "verbose_json", "timestamp_granularities[]": ["segment", "segment"]}, audio, 400,
         "timestamp_granularities[]", "more than once"),
        ({**ok, "response_format": "verbose_json", "timestamp_granularities[]": "sentence"}, audio, 400,
         "timestamp_granularities[]", "give segment"),
        ({**ok, "include[]": "logprobs"}, audio, 400, "include[]", "not returned"),
        ({**ok, "stream": "true"}, audio, 400, "stream", "not supported"),
        ({**ok, "speed": "2"}, audio, 400, "speed", "not a field of this endpoint"),
        ({**ok, "temperature": "2"}, audio, 400, "temperature", "from 0 (greedy) to 1"),
        ({**ok, "temperature": "hot"}, audio, 400, "temperature", "from 0 (greedy) to 1"),
        ({**ok, "language": "xx"}, audio, 400, "language", "does not know the language 'xx'"),
        ({"model": [SPEECH, SPEECH]}, audio, 400, "model", "given 2 times"),
    ]
    before = scrape(served)
    for data, file, status, param, words in cases:
        assert_refused(post(served, data, file), status, param, words)
    not_a_form = httpx.post(f"{served}/v1/audio/transcriptions", json={"model": SPEECH}, timeout=30)
    assert_refused(not_a_form, 400, "file", "Send the audio as multipart/form-data")
    client = openai_client(served, "key")
    with pytest.raises(openai.BadRequestError, match="word timestamps are not computed"):
        transcribed(client, clip, model=SPEECH, response_format="verbose_json", timestamp_granularities=["word"])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        transcribed(client, clip, model="gpt-4o-transcribe")
    after = scrape(served)
    refused = sum(after.get(f"{REQUESTS}[{s}]", 0) - before.get(f"{REQUESTS}[{s}]", 0) for s in (400, 404, 413))
    assert refused == len(cases) + 3
    assert after.get(f"{REQUESTS}[200]", 0) == before.get(f"{REQUESTS}[200]", 0)


def fuzz_cases(audio: bytes, rng: random.Random) -> list[tuple[dict, tuple | None]]:
    """Random blobs, truncated and corrupted WAVs, and wrong fields: (form fields, file) pairs."""
    def corrupted() -> bytes:
        data = bytearray(audio[:3000])
        for _ in range(6):
            data[rng.randrange(44)] = rng.randrange(256)  # (the header's bytes: most still decode, as noise)
        return bytes(data)

    ok = {"model": SPEECH}
    cases = [(ok, ("blob", rng.randbytes(rng.randrange(1, 4000)))) for _ in range(10)]
    cases += [(ok, ("cut.wav", audio[:rng.randrange(44)])) for _ in range(8)]
    cases += [(ok, ("bad.wav", corrupted())) for _ in range(3)]
    cases += [(ok, ("noise.wav", audio[:44] + rng.randbytes(rng.randrange(2, 3000)))) for _ in range(2)]
    wrong = [{"model": ""}, {"model": "whisper-2"}, {"model": "\x00"}, {"response_format": "xml"},
             {"response_format": ""}, {"temperature": "nan"}, {"temperature": "1e999"}, {"temperature": ""},
             {"language": "EN"}, {"language": ""}, {"language": "e" * 300}, {"prompt": rng.randbytes(64).hex()},
             {rng.randbytes(6).hex(): "x"}, {"timestamp_granularities": "segment"}, {"chunking_strategy": "auto"}]
    cases += [({**ok, **rng.choice(wrong)}, ("cut.wav", audio[:rng.randrange(44)])) for _ in range(13)]
    return cases


def test_fuzzed_uploads_never_get_a_5xx(served, clip):
    cases = fuzz_cases(Path(clip).read_bytes(), random.Random(7))
    seen = {"ok": 0, "refused": 0}
    for data, file in cases:
        response = post(served, data, file)
        assert response.status_code < 500, (data, file[0] if file else None, response.text)
        if response.status_code == 200:
            seen["ok"] += 1
        else:
            assert response.json()["error"]["message"], data
            seen["refused"] += 1
    assert seen["refused"] >= 30 and sum(seen.values()) == len(cases) == 36
    assert httpx.get(f"{served}/health", timeout=10).json()["speech_model"] == SPEECH  # (still up)


def test_a_server_without_a_speech_model_says_how_to_serve_one():
    live = start(tiny_llama(), name="tiny")
    try:
        response = post(live.url, {"model": "whisper-1"}, ("a.wav", silent_wav(1)))
        assert_refused(response, 404, "model", "--speech-model whisper-base")
        assert [m["id"] for m in httpx.get(f"{live.url}/v1/models", timeout=10).json()["data"]] == ["tiny"]
    finally:
        stop(live)


@pytest.mark.parametrize("argv, words", [
    (["serve", "--speech-assistant", "whisper-tiny-en"], "--speech-assistant set(s) how transcriptions run"),
    (["serve", "--max-audio-seconds", "60"], "add --speech-model"),
    (["serve", "--speech-self-draft"], "--speech-self-draft set(s) how transcriptions run"),
    (["serve", "--speech-model", SPEECH, "--speech-self-draft", "--speech-draft-weights", "float"],
     "needs quantized drafting weights"),
    (["serve", "--speech-model", SPEECH, "--replicas", "2"], "one-process server only"),
    (["serve", "--speech-model", SPEECH, "--max-audio-seconds", "0"], "--max-audio-seconds must be above 0"),
])
def test_speech_options_are_checked_before_any_model_loads(capsys, argv, words):
    from assistgen.cli.main import main

    assert main(argv) == 2
    assert words in capsys.readouterr().err


def test_schema_generated_forms_never_get_a_5xx(served):
    """Schemathesis cases for the endpoint's multipart form (its OpenAPI schema), sent to the live server."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_dict(httpx.get(f"{served}/openapi.json", timeout=10).json())
    operation = schema["/v1/audio/transcriptions"]["POST"]
    seen = []

    @given(case=operation.as_strategy())
    @settings(max_examples=20, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def check(case):
        response = case.call(base_url=served, timeout=60)
        assert response.status_code < 500, (case.body, response.text)
        if response.status_code >= 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        seen.append(response.status_code)

    check()
    assert len(seen) >= 20 and 400 in seen  # (past the model's check: the file's and fields' refusals)
