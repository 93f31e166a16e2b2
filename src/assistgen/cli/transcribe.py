"""`assistgen transcribe FILE`: speech to text with a Whisper target and any drafter, then statistics.

Contract: parses arguments into `speech.transcribe`'s (unset options are not passed), prints the transcript on
standard output (text; with --timestamps each segment as `[start --> end] text`; with --json the segments, windows
and statistics) and the statistics on standard error.
"""

from __future__ import annotations

import argparse
import json
import sys

from assistgen.cli.options import add_drafting
from assistgen.speech.transcribe import transcribe


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="an audio file (flac, mp3, mp4, m4a, ogg, wav, webm, ...; '-' reads standard input)")
    p.add_argument("--model", "-m", default="whisper-base",
                   help="a Whisper: whisper-base, whisper-tiny-en, a transformers folder or a hub id")
    p.add_argument("--language", help="ISO 639-1 code of the speech (default: detected)")
    p.add_argument("--prompt", help="earlier text the transcript continues (names, spelling)")
    p.add_argument("--translate", action="store_true", help="translate into English instead of transcribing")
    drafter = add_drafting(p, ("lookup", "ngram_cache", "assistant", "early_exit"),
                           ngram_cache="draft from n-grams of earlier transcripts too",
                           assistant="an assistant Whisper (another tokenizer switches to universal mode: "
                                     "whisper-tiny-en)",
                           early_exit="self-drafting with the target's first LAYERS decoder layers (calibrated if "
                                      "omitted: --early-exit clip.wav is calibrated early exit on clip.wav)")
    drafter.add_argument("--self-draft", action="store_true",
                         help="self-drafting with the target's own decoder in quantized weights (on the CPU)")
    p.add_argument("--draft-weights", choices=("auto", "int8", "int4", "float"),
                   help="the weights a drafting model runs in (default auto: int8 on the CPU)")
    p.add_argument("--timestamps", action="store_true",
                   help="decode with timestamps and print the segments (always so for audio over 30 s)")
    p.add_argument("--condition-on-previous", action="store_true",
                   help="with timestamps, each 30 s window continues the text before it (transformers' "
                        "condition_on_prev_tokens)")
    p.add_argument("--temperature", type=float, help="0 (default) is greedy")
    p.add_argument("--seed", type=int)
    p.add_argument("--json", action="store_true", help="print the segments, windows and statistics as JSON")
    p.add_argument("--quiet-stats", action="store_true", help="do not print statistics")


def run_command(args: argparse.Namespace) -> int:

    audio = sys.stdin.buffer.read() if args.file == "-" else args.file
    options = {k: v for k in ("language", "prompt", "assistant", "draft_weights", "temperature", "seed")
               if (v := getattr(args, k)) is not None}
    out = transcribe(args.model, audio, lookup=args.lookup, ngram_cache=args.ngram_cache,
                     early_exit=args.early_exit or False, self_draft=args.self_draft,
                     task="translate" if args.translate else "transcribe", timestamps=args.timestamps,
                     condition_on_previous=args.condition_on_previous, **options)
    stats = out.stats
    if args.json:
        print(json.dumps({"text": out.text, "language": out.language, "duration": round(out.duration_s, 3),
                          "segments": [{"start": round(g.start_s, 3), "end": round(g.end_s, 3), "text": g.text,
                                        "tokens": g.token_ids} for g in out.segments],
                          "windows": [{"start": w.start_s, "end": w.end_s, "text": w.text, "tokens": w.token_ids}
                                      for w in out.windows],
                          "stats": {"steps": stats.steps, "drafted": stats.drafted_tokens,
                                    "accepted": stats.accepted_tokens, "decoder_s": round(stats.total_s, 4)}}))
    elif out.timestamps:  # (asked for, or audio over 30 s)
        for g in out.segments:
            print(f"[{g.start_s:.2f} --> {g.end_s:.2f}] {g.text.strip()}")
    else:
        print(out.text)
    if not args.quiet_stats:
        print(f"\n--- statistics ({out.duration_s:.1f} s of audio, {len(out.windows)} window(s), language "
              f"{out.language or 'en (English-only model)'}) ---", file=sys.stderr)
        print(stats.summary(), file=sys.stderr)
    return 0
