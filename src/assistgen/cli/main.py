"""Command line: `assistgen generate`, `transcribe`, `models`, `calibrate`, `bench`, `demo` and `serve` (an
OpenAI-compatible server).

Contract: parses arguments into the API's objects (no defaults re-declared here: unset options are
simply not passed; shared options in `options.py`) and prints. Errors from bad input are printed as one
line, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from assistgen.api import stream
from assistgen.backends.embedded import EMBEDDED, SPEECH, ModelLoadError, is_installed
from assistgen.backends.settings import LoadSettings
from assistgen.backends.torch.loading import converted_dir, is_cached
from assistgen.bench.dataset import DatasetError
from assistgen.chat.templates import read_chat_template, use_chat_template
from assistgen.cli import serve_access, serve_speech
from assistgen.cli.options import (
    Parser,
    add_drafting,
    add_model,
    add_placement,
    add_quantize,
    add_sampling_set,
    add_structure,
    fast_linear,
    load_settings,
    load_target_and_assistant,
    settings_from,
)
from assistgen.cli.schedule import schedule_argument
from assistgen.config import ConfigError
from assistgen.core.processing import banned_sequences


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="assistgen", description="Exact assisted generation for causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text, streaming it, then print statistics")
    gen.add_argument("prompt", help="the prompt text ('-' reads it from standard input)")
    add_model(gen)
    add_drafting(gen, early_exit="self-drafting with the target's first LAYERS layers (chosen by calibration if "
                                 "omitted: --early-exit \"Hi\" is calibrated early exit on the prompt Hi)")
    gen.add_argument("--prediction", metavar="FILE",
                     help="Predicted Outputs: a file holding text the output is expected to repeat in large part (the "
                          "file being edited), drafted from where the output lines up with it; the output is the same")
    gen.add_argument("--schedule", type=schedule_argument,
                     help="adaptive[:MAX_K[:ALTERNATIVES]] (default: cost-aware, k may be 0; ALTERNATIVES: at most "
                          "this many other drafts verified beside one where passes cost the same for more rows, "
                          "default 3, 0: none) | constant:K | heuristic | confidence:K:T")
    gen.add_argument("--max-new-tokens", type=int)
    gen.add_argument("--temperature", type=float, help="0 (default) is greedy")
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--chat-template", metavar="FILE",
                     help="a Jinja chat template to use instead of the model's own (with --chat)")
    add_structure(gen)
    add_sampling_set(gen)
    gen.add_argument("--logprobs", type=int, metavar="N",
                     help="print each token's log-probability and its N most likely alternatives (on stderr)")
    gen.add_argument("--no-fast-linear", action="store_true", help="keep PyTorch's own linear layers")
    add_quantize(gen)
    add_placement(gen)
    gen.add_argument("--quiet-stats", action="store_true", help="do not print statistics")

    sub.add_parser("models", help="list the embedded models, text and speech, and whether each is installed and "
                                  "converted")
    info = sub.add_parser("info", help="versions, backends (is the llama.cpp build row-exact?), CPU and the cache")
    info.add_argument("--json", action="store_true", help="print it as one JSON object")

    cal = sub.add_parser("calibrate", help="show (or measure again) a model's verification costs and linear routes")
    add_model(cal)
    cal.add_argument("--refresh", action="store_true", help="measure again instead of reading the cached figures")
    add_quantize(cal)
    add_placement(cal)

    from assistgen.cli.bench import add_arguments

    add_arguments(sub.add_parser("bench", help="latency tables on a prompt set, side by side with transformers"))

    demo = sub.add_parser("demo", help="plain vs assisted decoding on an embedded model, side by side")
    demo.add_argument("--model", default=None)
    demo.add_argument("--max-new-tokens", type=int, default=None)

    from assistgen.cli.transcribe import add_arguments as add_transcribe

    add_transcribe(sub.add_parser("transcribe", help="speech to text with a Whisper target, assisted like generate"))

    add_serve(sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions; "
                                           "/v1/audio/transcriptions with --speech-model)"))
    return parser


def add_serve(p: argparse.ArgumentParser) -> None:
    add_model(p)
    add_drafting(p, suffix="suffix drafting: the longest earlier match of the text's tail, in the request and in "
                           "the same API key's earlier requests, continued by what most often followed it (no second "
                           "model)",
                 ngram_cache="draft from n-grams of earlier requests with the same API key (never across keys)",
                 assistant="assistant model (any tokenizer), shared by all requests")
    p.add_argument("--schedule", type=schedule_argument,
                   help="as for generate, for the text and the speech model (default: cost-aware adaptive)")
    p.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template to use instead of the model's own (e.g. one that renders tools)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--max-batch", type=int, help="requests generated together")
    p.add_argument("--max-queue", type=int, help="requests waiting to join; more are answered 429")
    p.add_argument("--max-tokens-limit", type=int, metavar="N",
                   help="the most new tokens a request may ask for (more: a 400); one that asks for none gets up to "
                        "N (default: no limit but the context, as OpenAI's)")
    p.add_argument("--prefill-budget", type=int,
                   help="prompt tokens fed per step over all joining requests, beside the running streams' rows")
    p.add_argument("--prefix-cache", metavar="BYTES",
                   help="finished requests' keys and values kept so that a request reuses its longest cached prefix "
                        "(e.g. 1GB; 0: none; default 256MiB, or one full context where that is more)")
    p.add_argument("--share-prefix-cache", action="store_true",
                   help="kept prefixes serve every request (default: only requests with the same API key, and the "
                        "chat template's opening every request)")
    p.add_argument("--calibration", choices=("now", "later"), default="now",
                   help="now (default): where this machine has no record of the model's pass costs, measure them "
                        "before listening (once; cached), so that the first request's drafts are priced right; "
                        "later: listen at once on a provisional curve from a few passes, the full measurement while "
                        "the server is idle")
    p.add_argument("--request-timeout", type=float, metavar="SECONDS",
                   help="the most a request may take, queued or running; then it ends with what it has, finish reason "
                        "timeout (default: no limit)")
    p.add_argument("--shutdown-grace", type=float, metavar="SECONDS",
                   help="on SIGTERM/SIGINT: new requests get 503 while the running ones have this long to finish; the "
                        "rest are then ended, each stream with a final chunk (finish reason abort) (default 30)")
    p.add_argument("--fast-prompts", action="store_true",
                   help="llama.cpp backend: prompts on ggml's fastest kernels (a faster prefill on some CPUs); a turn "
                        "continued from a kept prefix may then differ from the output a fresh server gives")
    ray = p.add_argument_group("replicas on Ray Serve (without --replicas: one process, no Ray)")
    ray.add_argument("--replicas", type=int, help="run N replicas on Ray Serve behind its HTTP proxy")
    ray.add_argument("--ray-address", help="join this Ray cluster (e.g. 10.0.0.5:6379) instead of starting one")
    ray.add_argument("--max-replicas", type=int, help="autoscale between --replicas and this many")
    ray.add_argument("--target-ongoing-requests", type=float,
                     help="autoscaling's target of ongoing requests per replica (default 4)")
    ray.add_argument("--cpus-per-replica", type=float, help="CPUs Ray reserves for each replica (default 1)")
    ray.add_argument("--no-route-by-key", dest="route_by_key", action="store_false",
                     help="send every request to the least loaded replica, keys or not")
    serve_access.add_arguments(p)
    serve_speech.add_arguments(p)
    add_quantize(p)
    add_placement(p)


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    template = chat_template_text(args)
    if template is not None and not args.chat:
        raise ConfigError("--chat-template is the template --chat wraps the prompt in: add --chat.")
    prediction = read_prediction(args.prediction)
    target, assistant = load_target_and_assistant(args)
    if template is not None:
        use_chat_template(target, template)
    last, logprobs = None, []
    for chunk in stream(target, prompt, assistant=assistant, lookup=args.lookup, suffix=args.suffix,
                        schedule=args.schedule, prediction=prediction,
                        **({"bad_words": banned_sequences(target.tokenizer, args.bad_word)} if args.bad_word else {}),
                        chat=args.chat, early_exit=args.early_exit or False, ngram_cache=args.ngram_cache,
                        **settings_from(args)):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        logprobs += chunk.logprobs or []
        last = chunk
    sys.stdout.write("\n")
    if args.logprobs is not None:
        print_logprobs(target.tokenizer, logprobs)
    if not args.quiet_stats:
        print("\n--- statistics ---", file=sys.stderr)
        print(last.stats.summary(), file=sys.stderr)
    return 0


def read_prediction(path: str | None) -> str | None:
    """--prediction's text, read before any model loads."""
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--prediction {path}: cannot read it as UTF-8 text ({e}); give a text file.") from e


def print_logprobs(tokenizer, logprobs) -> None:
    print("\n--- log-probabilities (token, logprob, alternatives) ---", file=sys.stderr)
    for lp in logprobs:
        top = "  ".join(f"{tokenizer.decode([t])!r} {v:.3f}" for t, v in lp.top)
        print(f"{tokenizer.decode([lp.token])!r}\t{lp.logprob:.4f}\t{top}", file=sys.stderr)


def model_rows() -> list[dict]:
    """`assistgen models`' rows: every embedded model, text (`EMBEDDED`) and speech (`SPEECH`), with its kind, whether
    its packages are installed, whether it is converted in the cache (a text model's float32 folder, a Whisper's
    transformers folder) and the quantized copies kept there (text models: speech drafters quantize in memory)."""
    from assistgen.backends.torch.quantization_schemes import SCHEMES
    from assistgen.backends.torch.quantize import is_saved
    from assistgen.paths import cache_root

    rows = []
    for entry in (*EMBEDDED.values(), *SPEECH.values()):
        text = entry.kind == "text"
        quantized = [s for s in SCHEMES if is_saved(cache_root() / "quantized" / f"{entry.alias}-{s}")] if text else []
        rows.append({"alias": entry.alias, "kind": entry.kind, "installed": is_installed(entry),
                     "converted": is_cached(entry.alias) if text else entry.is_converted(), "quantized": quantized,
                     "description": entry.description, "install": entry.install})
    return rows


def cmd_models(args: argparse.Namespace) -> int:
    def yes(flag: bool) -> str:
        return "yes" if flag else "no"

    print(f"{'alias':<20}{'kind':<8}{'installed':<11}{'converted':<11}{'quantized':<11}description")
    for row in model_rows():
        print(f"{row['alias']:<20}{row['kind']:<8}{yes(row['installed']):<11}{yes(row['converted']):<11}"
              f"{','.join(row['quantized']) or '-':<11}{row['description']}")
        if not row["installed"]:
            print(f"{'':<28}install: {row['install']}")
    print(f"\nconverted models live in {converted_dir('').parent} (set ASSISTGEN_CACHE to move it)")
    print("text models: generate, serve, bench (--model); speech models: transcribe (--model), serve (--speech-model)")
    print("also accepted: a Hugging Face hub id, a local model folder, or a path to a .gguf file (a Whisper: a hub id "
          "or a transformers folder)")
    return 0


def runs(values: list, start: int) -> list[tuple[int, int, object]]:
    """[(first index, last index, value)] for each run of equal values, indices counted from `start`."""
    out: list[list] = []
    for i, v in enumerate(values, start):
        if out and out[-1][2] == v:
            out[-1][1] = i
        else:
            out.append([i, i, v])
    return [tuple(r) for r in out]


def cmd_calibrate(args: argparse.Namespace) -> int:
    from assistgen.api import prepare
    from assistgen.backends.loader import load
    from assistgen.policy.costs import costs_path, known_costs

    model = prepare(load(args.model, load_settings(args)), refresh=args.refresh)
    facts, record = model.describe(), known_costs(model).record
    routes, costs = facts.get("linear_routes"), record["verification_costs"]
    print(f"{model.name}: cost of verifying k draft tokens relative to one plain step, v(k) = t(k+1)/t(1)")
    print("  " + " ".join(f"k={k}:{v:.2f}" for k, v in enumerate(costs)))
    if routes:
        groups = runs(routes["routes"][1:], start=1)
        print("linear route by rows: " + ", ".join(f"{a}-{b}: {route}" for a, b, route in groups))
        padded = [f"{n}->{p}" for n, p in enumerate(routes["padded"]) if p != n]
        print("rows run padded: " + (", ".join(padded) if padded else "none"))
        print(f"routes measured {routes.get('measured', '?')}; cached in {facts['routes_file']}")
    elif "linear_routes" in facts:
        print("linear routes: not applied (the small-row transform measured no faster than PyTorch's linear on this "
              "CPU)")
    print(f"costs measured {record.get('measured', '?')}; cached in {costs_path(model)}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Load the model(s), build the batched engine and serve it until SIGINT/SIGTERM (0 after a clean stop); with
    --replicas, the same server (`server_spec`) as Ray Serve replicas."""
    serve_speech.check(args)
    if args.replicas is not None or args.ray_address:
        return serve_on_ray(args)
    alone = [f"--{n.replace('_', '-')}" for n in ("max_replicas", "target_ongoing_requests", "cpus_per_replica")
             if getattr(args, n) is not None] + ([] if args.route_by_key else ["--no-route-by-key"])
    if alone:
        raise ConfigError(f"{', '.join(alone)} set(s) how Ray Serve runs replicas: add --replicas N.")
    from assistgen.serving.assembly import build_server

    server = build_server(server_spec(args))
    return server.serve(args.host, args.port, serve_speech.speech_service(args))


def server_spec(args: argparse.Namespace):
    """`assistgen serve`'s options as the `ServerSpec` both the one-process server and each replica are wired from
    (`serving.assembly`); the chat template is read, and every option checked, before any model loads."""
    from assistgen.serving.app_state import ServerSettings
    from assistgen.serving.assembly import ServerSpec
    from assistgen.serving.batching import EngineSettings

    settings = ServerSettings(model_name=args.model, ngram_cache=args.ngram_cache, suffix=args.suffix,
                              share_prefix_cache=args.share_prefix_cache, max_tokens_limit=args.max_tokens_limit,
                              **serve_speech.limits(args), **serve_access.access(args),
                              request_timeout=args.request_timeout,
                              **({} if args.shutdown_grace is None else {"shutdown_timeout": args.shutdown_grace}))
    assistant = load_settings(args, assistant=True) if args.assistant else LoadSettings()
    return ServerSpec(args.model, serving_settings(args), args.assistant, assistant, fast_linear(args), args.lookup,
                      args.early_exit or False, args.schedule,
                      EngineSettings(**engine_options(args)), settings, chat_template_text(args), args.calibration)


def chat_template_text(args: argparse.Namespace) -> str | None:
    """--chat-template's text (None: the model's own), read and checked before any model loads."""
    return None if getattr(args, "chat_template", None) is None else read_chat_template(args.chat_template)


def prefix_bytes(args: argparse.Namespace) -> int | None:
    """--prefix-cache in bytes (None: the default)."""
    from assistgen.backends.budget import parse_budget

    return None if args.prefix_cache is None else parse_budget(args.prefix_cache, "--prefix-cache", zero=True)


def serving_settings(args: argparse.Namespace) -> LoadSettings:
    """The server's target's loading settings, the options parsed once: on llama.cpp with the options a server adds,
    cells for the prefix cache beside the context and prompts on the row-exact kernels (unless --fast-prompts), so
    that a kept prefix holds what a fresh feed would."""
    from assistgen.backends.loader import choose_backend

    settings = load_settings(args)
    if choose_backend(args.model, settings) != "llama.cpp":
        if args.fast_prompts:
            raise ConfigError("--fast-prompts chooses llama.cpp's prompt kernels: it needs --backend llama.cpp "
                              "(a GGUF model).")
        return settings
    given = prefix_bytes(args)
    return settings.with_llama(kept_bytes="auto" if given is None else given, exact_prompts=not args.fast_prompts)


def engine_options(args: argparse.Namespace) -> dict:
    """EngineSettings fields from the serve options given (the prefix cache: its default unless told)."""
    given = {n: getattr(args, n) for n in ("max_batch", "max_queue", "prefill_budget") if getattr(args, n) is not None}
    return {**given, "prefix_cache": prefix_bytes(args)}


def serve_on_ray(args: argparse.Namespace) -> int:
    """`assistgen serve --replicas N`: the same server as N Ray Serve replicas (`serving/ray.py`)."""
    if args.ssl_keyfile or args.ssl_certfile or args.root_path:
        raise ConfigError("--ssl-keyfile, --ssl-certfile and --root-path are one process's (uvicorn's): with "
                          "--replicas, Ray Serve's HTTP proxy listens; put a TLS-terminating reverse proxy in front.")
    from assistgen.serving.ray import ReplicaOptions, run

    chosen = {n: getattr(args, n) for n in ("max_replicas", "target_ongoing_requests", "cpus_per_replica")
              if getattr(args, n) is not None}
    options = ReplicaOptions(replicas=args.replicas or 1, route_by_key=args.route_by_key, **chosen)
    return run(server_spec(args), options, args.host, args.port, args.ray_address)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "models":
            return cmd_models(args)
        if args.command == "info":
            from assistgen.cli.info import collect, report

            info = collect()
            print(json.dumps(info, indent=2) if args.json else report(info))
            return 0
        if args.command == "calibrate":
            return cmd_calibrate(args)
        if args.command == "bench":
            from assistgen.cli.bench import run_command

            return run_command(args)
        if args.command == "demo":
            from assistgen.cli.demo import run_demo

            return run_demo(args.model, args.max_new_tokens)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "transcribe":
            from assistgen.cli.transcribe import run_command as transcribe_command

            return transcribe_command(args)
    except (ConfigError, ModelLoadError, DatasetError, ValueError) as e:
        print(f"assistgen: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # (the reader of stdout went away, as `| head` or `| grep -q` do: quiet, as Unix tools)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    return 1


if __name__ == "__main__":
    sys.exit(main())
