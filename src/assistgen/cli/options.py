"""Command-line options shared by the commands: where models run and how they are loaded.

Contract: `add_quantize` and `add_placement` declare --quantize, --device and --dtype on a parser; `placement`
and `loading` turn the parsed values into the keyword arguments `assistgen.load_model` takes (only those
given: no default is re-declared here); `settings_from` gives the generation settings a command was given.
"""

from __future__ import annotations

import argparse

from assistgen.backends.torch.loading import DTYPES
from assistgen.backends.torch.quantize import SCHEMES


def add_quantize(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize", metavar="|".join(SCHEMES),
                   help="weight-only quantization of the model(s) (int8 per channel, int4 in groups); cached on disk")


def add_placement(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", help="where the model(s) run: cpu (default), cuda or cuda:N")
    p.add_argument("--dtype", choices=list(DTYPES),
                   help="weights and activations (default float32; bfloat16 is the usual choice on a GPU)")


def placement(args: argparse.Namespace) -> dict:
    """load_model's device= and dtype= from --device and --dtype, only those given."""
    out = {"device": args.device} if args.device else {}
    if args.dtype:
        out["dtype"] = DTYPES[args.dtype]
    return out


def loading(args: argparse.Namespace) -> dict:
    """load_model's keyword arguments from --quantize, --no-fast-linear (where the command has it) and placement."""
    out = {"quantize": args.quantize, **placement(args)}
    if getattr(args, "no_fast_linear", False):
        out["fast_linear"] = False
    return out


def settings_from(args: argparse.Namespace) -> dict:
    """The GenerationConfig fields given on the command line."""
    names = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")
    out = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    if args.stop:
        out["stop"] = tuple(args.stop)
    return out
