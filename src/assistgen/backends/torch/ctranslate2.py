"""CTranslate2 Whisper weights as a Hugging Face `WhisperForConditionalGeneration` folder.

Contract: `read_variables(stream)` parses a CTranslate2 `model.bin` (binary format 6: a spec name, then named
arrays with their shapes and dtypes, then aliases) into {name: numpy array}; `convert_whisper(parts, ct2_config,
tokenizer_json, dest)` joins `parts` (the file, possibly split in order over several files), renames and splits its
variables into transformers' names (self-attention `linear_0` is q, k, v stacked; the decoder's cross-attention
`linear_1` is k, v stacked; layer-norm gamma/beta are weight/bias; the output projection is tied to the token
embeddings), casts to float32, and writes `dest` as a folder `from_pretrained` reads: config.json,
generation_config.json (decoder start, end, no-timestamps, task and language ids, the suppressed tokens, from
CTranslate2's config and the tokenizer), preprocessor_config.json (80 mel bins at 16 kHz), tokenizer.json and
model.safetensors. It checks what it reads (format version, spec name, every variable used, shapes) and raises
ValueError naming the file on anything else.
"""

from __future__ import annotations

import io
import json
import shutil
import struct
from pathlib import Path

import numpy as np

DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}  # CTranslate2's types.h order
VERSION = 6


def read_variables(stream: io.BufferedIOBase, where: str = "model.bin") -> dict[str, np.ndarray]:
    """{name: array} of a CTranslate2 model file (aliases resolved to the arrays they name)."""

    def unpack(fmt: str):
        size = struct.calcsize(fmt)
        data = stream.read(size)
        if len(data) != size:
            raise ValueError(f"{where} ends early: it is not a whole CTranslate2 model file")
        return struct.unpack("<" + fmt, data)

    def string() -> str:
        (n,) = unpack("H")
        return stream.read(n)[:-1].decode("utf-8")

    (version,) = unpack("I")
    if version != VERSION:
        raise ValueError(f"{where} is CTranslate2 format {version}; assistgen reads format {VERSION}")
    spec = string()
    if spec != "WhisperSpec":
        raise ValueError(f"{where} holds a CTranslate2 {spec}, not a Whisper model")
    unpack("I")  # the spec's revision
    (count,) = unpack("I")
    out: dict[str, np.ndarray] = {}
    for _ in range(count):
        name = string()
        (rank,) = unpack("B")
        shape = unpack(f"{rank}I") if rank else ()
        dtype, nbytes = unpack("B")[0], unpack("I")[0]
        if dtype not in DTYPES:
            raise ValueError(f"{where}: variable {name} has CTranslate2 type {dtype}, which assistgen does not read")
        out[name] = np.frombuffer(stream.read(nbytes), DTYPES[dtype]).reshape(shape)
    (aliases,) = unpack("I")
    for _ in range(aliases):
        alias, target = string(), string()
        out[alias] = out[target]
    return out


class JoinedParts(io.RawIOBase):
    """Files read one after another as one stream (a model.bin split over packages)."""

    def __init__(self, paths: list[Path]):
        self.files = [open(p, "rb") for p in paths]  # noqa: SIM115 - closed in close()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.files:
            n = self.files[0].readinto(buffer)
            if n:
                return n
            self.files.pop(0).close()
        return 0

    def close(self) -> None:
        for f in self.files:
            f.close()
        super().close()


def layer_count(variables: dict, side: str) -> int:
    n = 0
    while f"{side}/layer_{n}/ffn/linear_0/weight" in variables:
        n += 1
    return n


def norm(variables: dict, src: str, dst: str) -> dict:
    return {f"{dst}.weight": variables[f"{src}/gamma"], f"{dst}.bias": variables[f"{src}/beta"]}


def linear(variables: dict, src: str, dst: str, bias: bool = True) -> dict:
    out = {f"{dst}.weight": variables[f"{src}/weight"]}
    if bias:
        out[f"{dst}.bias"] = variables[f"{src}/bias"]
    return out


def split_projection(variables: dict, src: str, names: list[str], prefix: str) -> dict:
    """A stacked projection (q, k, v or k, v) split into transformers' linears; Whisper's k_proj has no bias (its
    stacked bias is zero there, checked)."""
    weights = np.split(variables[f"{src}/weight"], len(names))
    biases = np.split(variables[f"{src}/bias"], len(names))
    out = {}
    for name, w, b in zip(names, weights, biases, strict=True):
        out[f"{prefix}.{name}.weight"] = w
        if name == "k_proj":
            if np.any(b != 0):
                raise ValueError(f"{src}: Whisper's key projection has no bias, but this one is not zero")
        else:
            out[f"{prefix}.{name}.bias"] = b
    return out


def whisper_state_dict(v: dict) -> dict[str, np.ndarray]:
    """transformers' `WhisperForConditionalGeneration` parameters from CTranslate2's variables."""
    sd = {
        "model.encoder.conv1.weight": v["encoder/conv1/weight"], "model.encoder.conv1.bias": v["encoder/conv1/bias"],
        "model.encoder.conv2.weight": v["encoder/conv2/weight"], "model.encoder.conv2.bias": v["encoder/conv2/bias"],
        "model.encoder.embed_positions.weight": v["encoder/position_encodings/encodings"],
        "model.decoder.embed_tokens.weight": v["decoder/embeddings/weight"],
        "model.decoder.embed_positions.weight": v["decoder/position_encodings/encodings"],
        **norm(v, "encoder/layer_norm", "model.encoder.layer_norm"),
        **norm(v, "decoder/layer_norm", "model.decoder.layer_norm"),
    }
    for side in ("encoder", "decoder"):
        for i in range(layer_count(v, side)):
            src, dst = f"{side}/layer_{i}", f"model.{side}.layers.{i}"
            sd.update(split_projection(v, f"{src}/self_attention/linear_0", ["q_proj", "k_proj", "v_proj"],
                                       f"{dst}.self_attn"))
            sd.update(linear(v, f"{src}/self_attention/linear_1", f"{dst}.self_attn.out_proj"))
            sd.update(norm(v, f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm"))
            sd.update(linear(v, f"{src}/ffn/linear_0", f"{dst}.fc1"))
            sd.update(linear(v, f"{src}/ffn/linear_1", f"{dst}.fc2"))
            sd.update(norm(v, f"{src}/ffn/layer_norm", f"{dst}.final_layer_norm"))
            if side == "decoder":
                sd.update(linear(v, f"{src}/attention/linear_0", f"{dst}.encoder_attn.q_proj"))
                sd.update(split_projection(v, f"{src}/attention/linear_1", ["k_proj", "v_proj"],
                                           f"{dst}.encoder_attn"))
                sd.update(linear(v, f"{src}/attention/linear_2", f"{dst}.encoder_attn.out_proj"))
                sd.update(norm(v, f"{src}/attention/layer_norm", f"{dst}.encoder_attn_layer_norm"))
    return {k: np.ascontiguousarray(a, dtype=np.float32) for k, a in sd.items()}


def whisper_configs(v: dict, ct2: dict, tokenizer_json: Path) -> tuple[dict, dict]:
    """(config.json, generation_config.json) of the converted model, from the weights' shapes, CTranslate2's config
    and the tokenizer's special tokens."""
    from transformers import WhisperTokenizerFast

    tokenizer = WhisperTokenizerFast(tokenizer_file=str(tokenizer_json))
    ids = tokenizer.convert_tokens_to_ids
    vocab, d_model = v["decoder/embeddings/weight"].shape
    start, end, no_timestamps = ids("<|startoftranscript|>"), ids("<|endoftext|>"), ids("<|notimestamps|>")
    languages = {tokenizer.convert_ids_to_tokens(i): i for i in ct2["lang_ids"]}
    multilingual = vocab >= 51865  # English-only Whisper has 51,864 tokens
    config = {
        "architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper",
        "vocab_size": int(vocab), "d_model": int(d_model), "num_mel_bins": int(v["encoder/conv1/weight"].shape[1]),
        "encoder_layers": layer_count(v, "encoder"), "decoder_layers": layer_count(v, "decoder"),
        "encoder_attention_heads": int(v["encoder/num_heads"]), "decoder_attention_heads": int(v["decoder/num_heads"]),
        "encoder_ffn_dim": int(v["encoder/layer_0/ffn/linear_0/weight"].shape[0]),
        "decoder_ffn_dim": int(v["decoder/layer_0/ffn/linear_0/weight"].shape[0]),
        "max_source_positions": int(v["encoder/position_encodings/encodings"].shape[0]),
        "max_target_positions": int(v["decoder/position_encodings/encodings"].shape[0]),
        "activation_function": "gelu", "scale_embedding": False, "tie_word_embeddings": True,
        "decoder_start_token_id": start, "eos_token_id": end, "bos_token_id": end, "pad_token_id": end,
        "torch_dtype": "float32",
    }
    generation = {
        "decoder_start_token_id": start, "eos_token_id": end, "bos_token_id": end, "pad_token_id": end,
        "no_timestamps_token_id": no_timestamps, "prev_sot_token_id": ids("<|startofprev|>"),
        "suppress_tokens": list(ct2["suppress_ids"]), "begin_suppress_tokens": list(ct2["suppress_ids_begin"]),
        "is_multilingual": multilingual,
        "alignment_heads": [list(h) for h in ct2.get("alignment_heads", [])], "max_initial_timestamp_index": 50,
        "max_length": config["max_target_positions"], "return_timestamps": False,
    }
    if multilingual:  # (an English-only model has neither: transformers would detect a language from an empty table)
        generation["lang_to_id"] = languages
        generation["task_to_id"] = {"transcribe": ids("<|transcribe|>"), "translate": ids("<|translate|>")}
    return config, generation


PREPROCESSOR = {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 80, "sampling_rate": 16000,
                "hop_length": 160, "chunk_length": 30, "n_fft": 400, "n_samples": 480000, "nb_max_frames": 3000,
                "padding_side": "right", "padding_value": 0.0, "return_attention_mask": False,
                "processor_class": "WhisperProcessor"}


def convert_whisper(parts: list[Path], ct2_config: Path, tokenizer_json: Path, dest: Path) -> Path:
    """Write the transformers folder of a CTranslate2 Whisper (see the module's contract) into `dest`."""
    from safetensors.numpy import save_file

    with JoinedParts(parts) as joined, io.BufferedReader(joined, 1 << 20) as stream:
        variables = read_variables(stream, str(parts[0]))
    ct2 = json.loads(Path(ct2_config).read_text(encoding="utf-8"))
    config, generation = whisper_configs(variables, ct2, tokenizer_json)
    state = whisper_state_dict(variables)
    if config["num_mel_bins"] != PREPROCESSOR["feature_size"]:
        raise ValueError(f"{parts[0]}: {config['num_mel_bins']} mel bins; assistgen's preprocessor has 80")
    dest.mkdir(parents=True, exist_ok=True)
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    (dest / "generation_config.json").write_text(json.dumps(generation, indent=1))
    (dest / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=1))
    (dest / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "WhisperTokenizer"}))
    shutil.copyfile(tokenizer_json, dest / "tokenizer.json")
    return dest
