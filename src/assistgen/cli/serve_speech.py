"""`assistgen serve`'s speech options: the Whisper that /v1/audio/transcriptions uses, its drafter, and the limits.

Contract: `add_arguments(p)` declares --speech-model, --speech-assistant, --speech-early-exit, --speech-self-draft,
--speech-draft-weights, --speech-lookup, --max-upload and --max-audio-seconds; `check(args)` refuses, before any
model loads, the other options without --speech-model and a speech model on Ray replicas (not served there);
`speech_service(args)` loads the speech model(s) into the server's `SpeechService` (None without --speech-model),
drafting with the command's --schedule; `limits(args)` gives the `ServerSettings` fields the options set (only those
given: no default re-declared here).
"""

from __future__ import annotations

import argparse

from assistgen.cli.options import add_layers
from assistgen.config import ConfigError

DEPENDENT = ("speech_assistant", "speech_early_exit", "speech_self_draft", "speech_draft_weights", "speech_lookup",
             "max_upload", "max_audio_seconds")


def add_arguments(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("speech recognition (POST /v1/audio/transcriptions)")
    group.add_argument("--speech-model", metavar="MODEL",
                       help="serve this Whisper beside the text model: whisper-base, whisper-tiny-en, a transformers "
                            "folder or a hub id (clients name it, or whisper-1, as the request's model)")
    drafter = group.add_mutually_exclusive_group()
    drafter.add_argument("--speech-assistant", metavar="MODEL",
                         help="an assistant Whisper that drafts for the speech model (another tokenizer switches to "
                              "universal mode: whisper-tiny-en for whisper-base)")
    add_layers(drafter, "--speech-early-exit", "the speech model's first LAYERS decoder layers draft (calibrated if "
                                               "omitted)")
    drafter.add_argument("--speech-self-draft", action="store_true",
                         help="the speech model's own decoder in quantized weights drafts (on the CPU)")
    group.add_argument("--speech-draft-weights", choices=("auto", "int8", "int4", "float"),
                       help="the weights a speech drafter runs in (default auto: int8 on the CPU)")
    group.add_argument("--speech-lookup", action="store_true",
                       help="prompt-lookup drafting over the transcript so far (no second model)")
    group.add_argument("--max-upload", metavar="BYTES", help="the largest audio file a request may upload "
                       "(e.g. 50MB; default 25 MiB, OpenAI's limit)")
    group.add_argument("--max-audio-seconds", type=float, metavar="S",
                       help="the longest audio a request may send (default 600)")


def check(args: argparse.Namespace) -> None:
    if args.speech_model is None:
        given = [f"--{n.replace('_', '-')}" for n in DEPENDENT if getattr(args, n) not in (None, False)]
        if given:
            raise ConfigError(f"{', '.join(given)} set(s) how transcriptions run: add --speech-model whisper-base.")
    elif args.replicas is not None or args.ray_address:
        raise ConfigError("--speech-model is served by the one-process server only: leave out --replicas and "
                          "--ray-address, or serve speech from a server of its own.")
    elif args.speech_self_draft and args.speech_draft_weights == "float":
        raise ConfigError("--speech-self-draft needs quantized drafting weights: give --speech-draft-weights int8 or "
                          "int4, or leave it at auto.")


def speech_service(args: argparse.Namespace):
    """The `SpeechService` of --speech-model and its drafter (None without --speech-model)."""
    if args.speech_model is None:
        return None
    from assistgen.serving.speech_service import SpeechService
    from assistgen.speech.transcribe import load_speech_model

    model = load_speech_model(args.speech_model, args.device)
    assistant = load_speech_model(args.speech_assistant, args.device) if args.speech_assistant else None
    return SpeechService(args.speech_model, model, assistant=assistant, lookup=args.speech_lookup,
                         early_exit=args.speech_early_exit or False, self_draft=args.speech_self_draft,
                         draft_weights=args.speech_draft_weights or "auto", schedule=args.schedule)


def limits(args: argparse.Namespace) -> dict:
    """ServerSettings' max_upload_bytes and max_audio_seconds, those given."""
    from assistgen.backends.budget import parse_budget

    out = {}
    if args.max_upload is not None:
        out["max_upload_bytes"] = parse_budget(args.max_upload, "--max-upload")
    if args.max_audio_seconds is not None:
        if not args.max_audio_seconds > 0:
            raise ConfigError(f"--max-audio-seconds must be above 0, got {args.max_audio_seconds:g}.")
        out["max_audio_seconds"] = args.max_audio_seconds
    return out
