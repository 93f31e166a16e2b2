"""A GGUF file made cheaper to run, once, and cached: requantized by llama.cpp's quantizer, and (for a drafter) its
output head kept to the vocabulary's most frequent tokens (FR-Spec, arXiv 2502.14856).

Contract: `derived_gguf(path, quantize, head, lib)` returns the path of a GGUF file under
`$ASSISTGEN_CACHE/gguf/derived/` made from `path`, keyed by the file's name and size, the type, the head and the
companion's version: with `quantize` (a `convert.QUANTIZER_TYPES` name or q8_0) every weight matrix requantized to
that type (llama.cpp's `pure` mode: the head too, so that it is no dearer than the rest); with `head` N, `output.weight`
kept to N rows and a `d2t` tensor (I64, the token id of each row) beside it, which the patched llama.cpp reads
(`assistgen_head_logits`: the logits of the tokens left out are -inf, the rows keep the vocabulary's width). The kept
tokens are every control and user-defined token (the chat template's, the end tokens) and the byte-level BPE
vocabulary's first ids up to N in all: a BPE vocabulary numbers its tokens in merge order, so its low ids are the
tokens its training text held most often (`kept_tokens`). A drafter with such a head never proposes a token left
out; verification is unchanged, so greedy output stays the target's and sampling stays lossless (the draft
distribution is zero outside the kept set). `HEAD_ARCHITECTURES` are the ones the patch reads a kept head for;
every refusal is a `ModelLoadError` naming the way out.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from assistgen.backends.embedded import ModelLoadError, say
from assistgen.backends.llamacpp.convert import QUANTIZER_TYPES, converter_version, quantize_file
from assistgen.paths import cache_root, replaced_atomically, safe_name

HEAD_ARCHITECTURES = ("llama", "qwen2")  # patches/llama.cpp-assistgen.patch: src/models/{llama,qwen2}.cpp
REQUANTIZE_TYPES = {**QUANTIZER_TYPES, "q8_0": "Q8_0"}
NORMAL_TOKEN = 1  # gguf's TokenType.NORMAL; control (3), user-defined (4) and the rest are always kept


def derived_gguf(path: Path, quantize: str | None, head: int | None, lib) -> Path:
    """The cached GGUF file of `path` requantized to `quantize` and/or with its head kept to `head` tokens."""
    kind = quantize.lower() if quantize else None
    if kind is not None and kind not in REQUANTIZE_TYPES:
        raise ModelLoadError(f"quantize={quantize!r} is not a type llama.cpp's quantizer makes from a GGUF file: use "
                             f"one of {', '.join(REQUANTIZE_TYPES)}.")
    if head is not None and (isinstance(head, bool) or not isinstance(head, int) or head < 256):
        raise ModelLoadError(f"head must be a number of tokens of at least 256, got {head!r}.")
    parts = [kind or "", f"head{head}" if head else ""]
    name = f"{safe_name(path.stem)}-{path.stat().st_size}-{'-'.join(p for p in parts if p)}-{converter_version()}"
    target = cache_root() / "gguf" / "derived" / f"{name}.gguf"
    if target.is_file():
        return target
    start = time.perf_counter()
    said = " and ".join(x for x in (f"requantizing it to {kind}" if kind else "",
                                      f"keeping its output head to {head} tokens" if head else "") if x)
    say(f"First use of {path.name} this way: {said}; the result is cached in {target}.")
    with replaced_atomically(target) as tmp:
        source = path
        if head:
            source = tmp.with_name(tmp.name + ".head")
            write_kept_head(path, source, head)
        try:
            if kind:
                quantize_file(lib, source, tmp, REQUANTIZE_TYPES[kind], requantize=True)
            else:
                os.replace(source, tmp)
        finally:
            if source != path and source.exists():
                source.unlink()
    say(f"Made {target.name} in {time.perf_counter() - start:.0f} s.")
    return target


def kept_tokens(token_types: np.ndarray, head: int) -> np.ndarray:
    """The ids a kept head of `head` rows keeps: every token that is not a normal one, then normal ones from id 0 up
    until there are `head` in all (ascending; [kept] int64)."""
    special = np.flatnonzero(token_types != NORMAL_TOKEN)
    normal = np.flatnonzero(token_types == NORMAL_TOKEN)[:max(0, head - len(special))]
    return np.union1d(special, normal).astype(np.int64)


def write_kept_head(path: Path, out: Path, head: int) -> None:
    """A copy of the GGUF file `path` whose output.weight holds only the kept tokens' rows, with `d2t` beside it."""
    import gguf

    reader = gguf.GGUFReader(path)
    field = reader.fields.get(gguf.Keys.General.ARCHITECTURE)
    arch = field.contents() if field is not None else "?"
    if arch not in HEAD_ARCHITECTURES:
        raise ModelLoadError(f"{path.name} is a {arch} model: a kept output head (head=) is read for "
                             f"{', '.join(HEAD_ARCHITECTURES)} models only; leave head unset for this one.")
    types = np.asarray(reader.fields[gguf.Keys.Tokenizer.TOKEN_TYPE].contents())
    if head >= len(types):
        raise ModelLoadError(f"head={head} keeps the whole vocabulary of {len(types)} tokens: give fewer.")
    kept = kept_tokens(types, head)
    tensors = {t.name: t for t in reader.tensors}
    source = tensors.get("output.weight", tensors["token_embd.weight"])  # (tied embeddings: the input table)
    rows = np.ascontiguousarray(source.data[kept])  # [kept, bytes of a row]: quantized rows are whole blocks
    writer = gguf.GGUFWriter(out, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    written = [(t.name, t.data, t.tensor_type) for t in reader.tensors if t.name != "output.weight"]
    written += [("output.weight", rows, source.tensor_type), ("d2t", kept, gguf.GGMLQuantizationType.I64)]
    for name, data, kind in written:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in written:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()

