"""Command-line options shared by the commands: which model, where models run and how they are loaded.

Contract: `add_model` declares --model with its one default (`DEFAULT_MODEL`); `add_drafting` the drafting options
(--lookup, --suffix, --ngram-cache, --assistant, --early-exit) for every command that drafts; `add_quantize` and
`add_placement`
declare --quantize, --backend, --assistant-backend, --assistant-quantize, --assistant-head, --device, --dtype,
--context, --sequences, --max-memory and --no-repack on a parser; `placement` turns the parsed values into the
keyword arguments `assistgen.load_model` takes (only those given: no loading default is re-declared here, and an
option of the other backend is refused by the loader, not dropped), `load_settings` into the `LoadSettings` they
parse to, once per model a command loads (the assistant's own --assistant-quantize and --assistant-head included);
`load_target_and_assistant` loads a command's pair, splitting --max-memory between them (the assistant resident, the
target streamed); `settings_from` gives the generation settings a command was given, with the output's structure
(`add_structure`: --json-schema, --json, --regex, --grammar; files read here, so that a missing or malformed one is an
error naming it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from assistgen.backends.settings import BACKENDS, DTYPES, LoadSettings
from assistgen.backends.torch.quantization_schemes import SCHEMES
from assistgen.config import ConfigError, Structure

DEFAULT_MODEL = "smollm2-135m"  # the text model a command loads without --model
ALONE = "\0"  # `Parser` writes an `OptionalValue` given alone as `--opt=<ALONE>` (no command line holds a NUL byte)


class OptionalValue(argparse.Action):
    """An option whose value may be left out: `--opt` alone gives `const`, `--opt V` and `--opt=V` give `convert(V)`.
    Unlike argparse's nargs="?", which takes whatever argument follows and fails on it, `--opt TOKEN` where
    `convert` refuses TOKEN leaves TOKEN to the arguments after the option (a positional): `Parser` decides, seeing
    the token. `--opt=V` always means V (a V `convert` refuses is an error naming the option)."""

    def __init__(self, option_strings, dest, convert=int, const=True, **kwargs):
        super().__init__(option_strings, dest, nargs="?", const=const, **kwargs)
        self.convert = convert

    def takes(self, token: str) -> bool:
        """Whether `token` is this option's value (else the option was given alone)."""
        try:
            self.convert(token)
        except (TypeError, ValueError):
            return False
        return True

    def __call__(self, parser, namespace, values, option_string=None):
        if not isinstance(values, str) or values == ALONE:  # (argparse gives `const` itself at the end of the line)
            setattr(namespace, self.dest, self.const)
            return
        try:
            setattr(namespace, self.dest, self.convert(values))
        except (TypeError, ValueError) as e:
            name = getattr(self.convert, "__name__", "value")
            raise argparse.ArgumentError(self, f"invalid {name} value: {values!r}") from e


class Parser(argparse.ArgumentParser):
    """argparse's parser, save that an `OptionalValue` option followed by an argument that is not its value is marked
    as given alone before argparse reads the line (each subcommand's parser marks its own options)."""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(self.mark_alone(args), namespace)

    def mark_alone(self, args: list[str]) -> list[str]:
        out = []
        for i, token in enumerate(args):
            if token == "--":  # the rest is positional
                return out + args[i:]
            found = self.optional_value(token)
            if found is not None and not (i + 1 < len(args) and found[1].takes(args[i + 1])):
                token = f"{found[0]}={ALONE}"
            out.append(token)
        return out

    def optional_value(self, token: str) -> tuple[str, OptionalValue] | None:
        """(its option string, the action) where `token` names an `OptionalValue` option, abbreviated or not, with no
        value attached."""
        if token in self._option_string_actions:
            action = self._option_string_actions[token]
            return (token, action) if isinstance(action, OptionalValue) else None
        if not (self.allow_abbrev and token.startswith("--") and "=" not in token):
            return None
        matches = {a: s for s, a in self._option_string_actions.items() if s.startswith(token)}
        if len(matches) != 1:
            return None  # (unknown or ambiguous: argparse says so)
        (action, option), = matches.items()
        return (option, action) if isinstance(action, OptionalValue) else None


def add_layers(p, option: str, help: str) -> None:
    """A self-drafting option counted in layers: `option` alone is on (the count calibrated), `option N` or
    `option=N` takes N layers (`OptionalValue`: a next argument that is not a whole number is left to the command)."""
    p.add_argument(option, action=OptionalValue, metavar="LAYERS",
                   help=f"{help}. {option} N or {option}=N: N layers; the next argument is taken as N only when it is "
                        f"a whole number")


DRAFTING_HELP = {  # each drafting option's help; a command says what it means there where that differs
    "lookup": "prompt-lookup drafting (no second model)",
    "suffix": "suffix drafting: the longest earlier match of the text's tail, continued by what most often followed it "
              "(no second model)",
    "ngram_cache": "draft from n-grams of earlier requests in this process, and of this one",
    "assistant": "assistant model (any tokenizer: a different one switches to universal mode)",
    "early_exit": "self-drafting with the target's first LAYERS layers (chosen by calibration if omitted)",
}


def add_drafting(p: argparse.ArgumentParser, options=tuple(DRAFTING_HELP), **helps: str):
    """The drafting options a command takes (`options`, of --lookup, --suffix, --ngram-cache, --assistant and
    --early-exit), declared once for every command, with `helps` for what one means there; --assistant and
    --early-exit exclude each other. Returns that exclusive group (a command adds its own model drafters to it)."""
    help_of = {**DRAFTING_HELP, **helps}
    for name in ("lookup", "suffix", "ngram_cache"):
        if name in options:
            p.add_argument("--" + name.replace("_", "-"), action="store_true", help=help_of[name])
    models = p.add_mutually_exclusive_group()
    if "assistant" in options:
        models.add_argument("--assistant", "-a", help=help_of["assistant"])
    if "early_exit" in options:
        add_layers(models, "--early-exit", help_of["early_exit"])
    return models


def add_model(p: argparse.ArgumentParser, help: str = "alias, hub id, local folder or .gguf file") -> None:
    p.add_argument("--model", "-m", default=DEFAULT_MODEL, help=help)


def add_quantize(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize", metavar="|".join((*SCHEMES, "q4_k_m", "q8_0", "...")),
                   help="weight-only quantization of the model(s), cached on disk: on torch int8 (per channel) or int4 "
                        "(in groups); a GGUF type (q4_k_m, q8_0, q6_k, f16, ...) converts a transformers folder or hub "
                        "id for the llama.cpp backend with llama.cpp's converter and quantizer")


def add_placement(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="what computes the logits: torch, llama.cpp (GGUF files, CPU), or auto (default: llama.cpp "
                        "for a GGUF model on the CPU when llama-cpp-python is installed and no torch-only option "
                        "is given, else torch)")
    p.add_argument("--assistant-backend", choices=BACKENDS,
                   help="the assistant's backend (default: --backend)")
    p.add_argument("--assistant-quantize", metavar="q4_0|q8_0|...",
                   help="llama.cpp backend: the assistant's GGUF file requantized once to this type and cached (q4_0 "
                        "is the cheapest one-row step on most CPUs; default: --quantize, else the file's own types)")
    p.add_argument("--assistant-head", type=int, metavar="N",
                   help="llama.cpp backend: the assistant's output head kept to the vocabulary's N most frequent "
                        "tokens (FR-Spec; e.g. 32768 of Qwen's 151,936): a cheaper draft step that never proposes the "
                        "others; the output is unchanged (llama and qwen2 models)")
    p.add_argument("--device", help="torch backend: where the model(s) run: cpu (default), cuda or cuda:N")
    p.add_argument("--dtype", choices=list(DTYPES),
                   help="torch backend: weights and activations (default float32; bfloat16 is usual on a GPU)")
    p.add_argument("--context", type=int,
                   help="llama.cpp backend: KV cells of each model's context, shared by its sequences "
                        "(default: the model's trained context, at most 4096)")
    p.add_argument("--sequences", type=int,
                   help="llama.cpp backend: sequences that can live at once in a context (default 32)")
    p.add_argument("--max-memory", metavar="BYTES",
                   help="the memory the target may keep resident (e.g. 800MB, 2GiB): on the CPU its weights stay "
                        "memory-mapped and what does not fit is read from the file in each pass (on a GPU: the "
                        "layers beyond it stay in CPU memory); an assistant stays resident and its share is taken "
                        "from this budget")
    p.add_argument("--no-repack", dest="repack", action="store_const", const=False,
                   help="llama.cpp backend: keep the weights in the file's layout (about 600 MB less memory for "
                        "a 1.5B model, prompts about 1.5x slower: docs/benchmarks.md)")


def placement(args: argparse.Namespace, assistant: bool = False) -> dict:
    """load_model's backend=, device=, dtype=, context=, sequences= and repack= from the command line, only those
    given."""
    backend = (args.assistant_backend or args.backend) if assistant else args.backend
    out = {"backend": backend}
    if args.device:
        out["device"] = args.device
    if args.dtype:
        out["dtype"] = DTYPES[args.dtype]
    for name in ("context", "sequences", "repack"):
        if getattr(args, name, None) is not None:
            out[name] = getattr(args, name)
    if not assistant and getattr(args, "max_memory", None) is not None:
        out["max_memory"] = args.max_memory
    return out


def load_settings(args: argparse.Namespace, assistant: bool = False) -> LoadSettings:
    """The command's loading options parsed, once, into `LoadSettings` (the assistant's with `assistant`)."""
    lone = [f"--assistant-{n}" for n in ("quantize", "head") if getattr(args, f"assistant_{n}", None) is not None]
    if lone and not getattr(args, "assistant", None):
        raise ConfigError(f"{', '.join(lone)} set(s) how the assistant is loaded: add --assistant MODEL.")
    given = placement(args, assistant)
    quantize = (getattr(args, "assistant_quantize", None) or args.quantize) if assistant else args.quantize
    if quantize:
        given["quantize"] = quantize
    if assistant and getattr(args, "assistant_head", None) is not None:
        given["head"] = args.assistant_head
    return LoadSettings.parse(given.pop("backend"), **given)


def load_target_and_assistant(args: argparse.Namespace, target: LoadSettings | None = None,
                              calibration: str = "now") -> tuple:
    """A command's target and its assistant (None without --assistant), their costs measured now or later
    (`api.prepare`), within --max-memory's budget (`api.loading.load_with_assistant`); `target`: the target's
    settings when the command has parsed them already (a server's, with its own options:
    `cli.main.serving_settings`), else `load_settings(args)`."""
    from assistgen.api.loading import load_with_assistant

    return load_with_assistant(args.model, load_settings(args) if target is None else target, args.assistant,
                               load_settings(args, assistant=True) if args.assistant else None,
                               fast_linear(args), calibration)


def fast_linear(args: argparse.Namespace) -> bool | str:
    """`prepare`'s fast_linear: False with --no-fast-linear, else "auto"."""
    return False if getattr(args, "no_fast_linear", False) else "auto"


def settings_from(args: argparse.Namespace) -> dict:
    """The GenerationConfig fields given on the command line."""
    names = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")
    out = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    if args.stop:
        out["stop"] = tuple(args.stop)
    structure = structure_from(args)
    if structure is not None:
        out["structure"] = structure
    if getattr(args, "logprobs", None) is not None:
        out["logprobs"] = args.logprobs
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_p", "min_tokens"):
        if getattr(args, name, None) is not None:
            out[name] = getattr(args, name)
    if getattr(args, "ignore_eos", False):
        out["ignore_eos"] = True
    if getattr(args, "logit_bias", None):
        out["logit_bias"] = tuple(args.logit_bias)
    return out


def add_sampling_set(p: argparse.ArgumentParser) -> None:
    """The sampling set beyond temperature, top-k and top-p (`core/processing.py`)."""
    p.add_argument("--frequency-penalty", type=float, help="a token's logit less this times its count so far "
                   "(-2 to 2; OpenAI's)")
    p.add_argument("--presence-penalty", type=float, help="a token's logit less this once it occurred (-2 to 2)")
    p.add_argument("--repetition-penalty", type=float,
                   help="logits of tokens in the prompt or output divided (or, negative, multiplied) by this (> 0)")
    p.add_argument("--min-p", type=float, help="drop tokens below this times the likeliest one's probability")
    p.add_argument("--min-tokens", type=int, help="no end token before this many new tokens")
    p.add_argument("--ignore-eos", action="store_true", help="an end token does not end the generation")
    p.add_argument("--logit-bias", type=logit_bias_argument, action="append", metavar="TOKEN=BIAS",
                   help="add BIAS (-100 to 100) to token id TOKEN's logit (repeatable)")
    p.add_argument("--bad-word", action="append", metavar="TEXT",
                   help="never generate this text's tokens (alone or after a space; repeatable)")


def logit_bias_argument(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give TOKEN=BIAS (a token id and a number), got {text!r}") from None


def add_structure(p: argparse.ArgumentParser) -> None:
    """The output's structure: a JSON schema file, any JSON object, a regex or a grammar file (one of them)."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--json-schema", metavar="FILE", help="the output follows this JSON schema (a .json file)")
    group.add_argument("--json", action="store_true", help="the output is a JSON object")
    group.add_argument("--regex", metavar="RE", help="the output matches this regular expression")
    group.add_argument("--grammar", metavar="FILE",
                       help="the output follows this grammar (GBNF, llama.cpp's, or Lark, llguidance's)")


def structure_from(args: argparse.Namespace) -> Structure | None:
    """The `Structure` the options name (files read and a schema parsed here: errors name the file)."""
    if getattr(args, "json_schema", None):
        text = read_text(args.json_schema, "--json-schema")
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--json-schema {args.json_schema}: not valid JSON ({e.msg} at line {e.lineno}, "
                              f"column {e.colno}).") from e
        return Structure("json_schema", text)
    if getattr(args, "json", False):
        return Structure("json_object")
    if getattr(args, "regex", None):
        return Structure("regex", args.regex)
    if getattr(args, "grammar", None):
        return Structure("grammar", read_text(args.grammar, "--grammar"))
    return None


def read_text(path: str, option: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{option} {path}: cannot read it ({e.strerror or e}).") from e
