"""Bad input gets a clear error that names the problem and the fix."""

from __future__ import annotations

import pytest
from helpers import encode, tiny_llama

from assistgen import ConfigError, ModelLoadError, TokenizerMismatchError, generate, load_model
from assistgen.backends.torch.model import Model
from assistgen.cli.schedule import parse_schedule
from assistgen.drafters.assistant import AssistantDrafter
from assistgen.policy.rules import Constant


@pytest.fixture(scope="module")
def target():
    return tiny_llama()


@pytest.mark.parametrize(
    "prompt, settings, message",
    [
        ("", {}, "prompt is empty"),
        ("   ", {}, "prompt is empty"),
        ([], {}, "prompt is empty"),
        ("hi", {"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
        ("hi", {"max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
        ("hi", {"temperature": -0.5}, "temperature must be >= 0"),
        ("hi", {"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ("hi", {"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ("hi", {"top_k": -1}, "top_k must be an integer >= 0"),
        ("hi", {"stop": [""]}, "stop strings must be non-empty"),
        ("hi", {"max_tokens": 5}, "Unknown generation setting"),
        ([1, 2, 10_000], {}, "outside the model's vocabulary"),
    ],
)
def test_bad_settings(target, prompt, settings, message):
    with pytest.raises(ConfigError, match=message):
        generate(target, prompt, **settings)


def test_prompt_longer_than_the_context(target):
    with pytest.raises(ConfigError, match="context length is 512"):
        generate(target, encode("x" * 600))


def test_chat_without_a_template(target):
    with pytest.raises(ConfigError, match="no chat template"):
        generate(target, "hello", chat=True)


def test_a_custom_drafter_missing_part_of_the_interface(target):
    class Old:
        name, context_length = "old", None

        def propose(self, ids, k, sampler, min_confidence=0.0): ...

        def observe(self, num_accepted, target_probs=None): ...

    with pytest.raises(ConfigError, match="lacks finish, report"):
        generate(target, "hello", assistant=Old())


def test_early_exit_with_too_many_layers(target):
    with pytest.raises(ConfigError, match="early exit.*layers"):
        generate(target, "hello", early_exit=99)


def test_assistant_and_early_exit_together(target):
    with pytest.raises(ConfigError, match="either an assistant model or early exit"):
        generate(target, "hello", assistant=target, early_exit=1)


def test_same_tokenizer_drafter_refuses_a_different_tokenizer(target):
    from helpers import SMALL_TOKENIZER

    other = Model(tiny_llama(seed=1, tokenizer=SMALL_TOKENIZER).hf, SMALL_TOKENIZER, "small-vocab")
    with pytest.raises(TokenizerMismatchError, match="tokenizers of .* differ.*universal mode"):
        AssistantDrafter(other, target)
    # generate() itself switches to universal mode instead
    assert generate(target, "hello", assistant=other, max_new_tokens=4).stats.mode == "universal"


def test_unknown_model_alias():
    with pytest.raises(ModelLoadError, match="Unknown model 'smollm3'.*smollm2-135m"):
        load_model("smollm3")


def test_unreachable_hub_id_names_the_alternatives(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="cannot be reached.*embedded model"):
        load_model("someone/not-a-cached-model")


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load_model(str(tmp_path / "nope.gguf"))


def test_folder_without_a_model(tmp_path):
    with pytest.raises(ModelLoadError, match="not a model folder"):
        load_model(str(tmp_path))


def test_a_schedule_given_as_text_is_refused_with_its_object_form_and_parsed_by_the_cli():
    model = tiny_llama()
    out = generate(model, encode("abc abc abc"), lookup=True, schedule=Constant(k=3), max_new_tokens=5)
    assert len(out.token_ids) == 5
    with pytest.raises(ConfigError, match=r"command line's form.*Constant\(k=\.\.\.\)"):
        generate(model, encode("abc"), lookup=True, schedule="constant:3", max_new_tokens=2)
    assert parse_schedule("constant:3") == Constant(k=3)
    with pytest.raises(ValueError, match="unknown schedule 'fast'"):
        parse_schedule("fast")
    with pytest.raises(ConfigError, match="schedule must be a schedule object"):
        generate(model, encode("abc"), lookup=True, schedule=4, max_new_tokens=2)
