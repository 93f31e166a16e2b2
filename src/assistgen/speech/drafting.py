"""A speech model's drafters: early exit's layer, the self-draft (the target's own decoder in quantized weights) and
an assistant Whisper, each on the window's encoder output.

Contract: each function returns the model drafter for one window (or the exit layer), which `api.generate` composes
with the token drafters asked for (`api.drafting.make_drafter`); the tokenizer choice (token ids, or universal mode
through text) is `api.drafting.model_drafter`'s. What the policy starts from is measured once per model, never in a
decoding step: early exit's layer and the self-draft's agreement on the calibration text, a drafting decoder's pass
times (`policy.costs.measured_costs`, kept on disk). Drafting weights change how many drafts are accepted, never the
output; a scheme that cannot run where the model is raises `ConfigError`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from assistgen.api.drafting import model_drafter
from assistgen.backends.torch.speech import DRAFT_VOCABULARY, HeardModel, SpeechModel
from assistgen.config import ConfigError
from assistgen.drafters.assistant import AssistantDrafter, agreement, same_tokenizer
from assistgen.drafters.early_exit import calibrate_exit_layer
from assistgen.policy.costs import measured_costs

DRAFT_WEIGHTS = ("auto", "int8", "int4", "float", None)
TAIL_FRAMES = 100  # mel frames of the window's padding an assistant's encoder also reads (1 s)


def exit_layers(speech: SpeechModel, heard: HeardModel, early_exit: bool | int) -> int:
    """The exit layer: the given one, or the calibrated one (once per model: on its first input, over the decoder
    prompt and the package's sample article)."""
    if early_exit is not True:
        return int(early_exit)
    if speech.exit_layer is None:  # (on the text without timestamps, whatever this window decodes)
        speech.exit_layer = calibrate_exit_layer(replace(heard, timestamps=False), calibration_ids(speech))[0]
    return speech.exit_layer



def calibration_ids(speech: SpeechModel) -> list[int]:
    """A decoder prompt and the package's sample article (256 tokens): the text drafters are calibrated on."""
    from importlib.resources import files

    text = files("assistgen").joinpath("data/article.txt").read_text()
    return heard_prompt(speech) + list(speech.tokenizer(text, add_special_tokens=False)["input_ids"])[:252]



def heard_prompt(speech: SpeechModel) -> list[int]:
    return speech.decoder_prompt("en" if speech.multilingual else None)



def drafting_weights(speech: SpeechModel, draft_weights: str | None) -> str | None:
    """The scheme a drafter's copy of `speech` holds its weights in: "auto" is int8 on the CPU (PyTorch's quantized
    kernels are CPU kernels), float elsewhere; "float" or None: as loaded."""
    if draft_weights not in DRAFT_WEIGHTS:
        raise ConfigError(f"draft_weights must be one of {', '.join(map(str, DRAFT_WEIGHTS))}, got {draft_weights!r}.")
    if draft_weights == "auto":
        return "int8" if speech.device.type == "cpu" else None
    if draft_weights in ("int8", "int4") and speech.device.type != "cpu":
        raise ConfigError(f"draft_weights={draft_weights!r} runs on the CPU only; {speech.name} is on "
                          f"{speech.device}: use draft_weights='float'.")
    return None if draft_weights == "float" else draft_weights



def self_drafter(target: HeardModel, scheme: str | None) -> AssistantDrafter:
    """The target's own decoder with quantized weights (`SpeechModel.for_drafting`) on the target's encoder output:
    the same tokenizer and the same input, so it agrees with the target on most tokens, at a fraction of its cost."""
    if scheme is None:
        raise ConfigError("self_draft needs quantized drafting weights (draft_weights='int8' or 'int4', on the CPU): "
                          "the target's own float decoder would cost as much as it saves.")
    speech, copy = target.speech, target.speech.for_drafting(scheme)
    heard = HeardModel(copy, target.encoded, target.begin, draft_vocabulary=DRAFT_VOCABULARY,
                       timestamps=target.timestamps)
    if scheme not in speech.agreement:  # once per model: on its first input, over the calibration text
        ids, begin = calibration_ids(speech), len(heard_prompt(speech))
        speech.agreement[scheme] = agreement(replace(target, begin=begin, timestamps=False),
                                             replace(heard, begin=begin, timestamps=False), ids,
                                             positions=len(ids) - begin)
        measured_costs(heard)  # its passes timed once (kept on disk): the policy's prior for its cost per token
    return AssistantDrafter(heard, target, acceptance_prior=speech.agreement[scheme])



def assistant_drafter(target: HeardModel, assistant: SpeechModel, features: torch.Tensor, spoken: int,
                      language: str | None):
    """The assistant Whisper on the same window (its copy for drafting, when `assistant` is one): same tokenizer, it
    drafts token ids directly; another, in universal mode from its own decoder prompt. Its decoder's passes are timed
    on its first window (`policy.costs.measured_costs`), so that the policy prices it by time, not by weight bytes.
    Where both extract the same features (Whisper's 80 mel bins), `features` [1, mels, 3000] are the target's;
    `spoken`: the window's frames that hold audio. With timestamps, a same-tokenizer assistant decodes with them
    too."""
    same = same_tokenizer(target, assistant)  # then it reads the target's decoder prompt, timestamps and all
    prompt = assistant.decoder_prompt(language if assistant.multilingual else None)  # (universal mode's own)
    frames = spoken + TAIL_FRAMES  # the audio's own frames, and a second of the padding after it
    heard = assistant.listen(features, begin=target.begin if same else len(prompt), draft_vocabulary=DRAFT_VOCABULARY,
                             lazy=True, frames=frames, timestamps=target.timestamps and same)  # its encoder runs
    measured_costs(heard)  # its passes timed once per model (kept on disk; on this first window, the encoder runs for
    # it): the policy's prior for its cost per token
    return model_drafter(target, heard, prefix=prompt)



