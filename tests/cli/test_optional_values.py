"""An option whose value may be left out (`--early-exit [LAYERS]`, `--speech-early-exit [LAYERS]`) never swallows the
argument after it unless that argument is its value: `assistgen transcribe --early-exit clip.wav` is early exit on
clip.wav, `--early-exit 6 clip.wav` and `--early-exit=6 clip.wav` six layers. Parsed by the CLI's own parser, in every
subcommand that has such an option; one real `assistgen transcribe` run at the end."""

from __future__ import annotations

import argparse

import pytest
from helpers import speak

from assistgen.cli.main import build_parser, main
from assistgen.cli.options import OptionalValue

# (subcommand, option, its attribute, what follows it when it is given alone: a positional, or another option)
CASES = [
    ("generate", "--early-exit", "early_exit", ["Hi there"]),
    ("transcribe", "--early-exit", "early_exit", ["clip.wav"]),
    ("serve", "--early-exit", "early_exit", ["--port", "9000"]),
    ("serve", "--speech-early-exit", "speech_early_exit", ["--port", "9000"]),
]
IDS = [f"{command} {option}" for command, option, _, _ in CASES]
POSITIONAL = {"generate": "prompt", "transcribe": "file"}


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def refused(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as stop:
        parse(*argv)
    assert stop.value.code == 2
    return capsys.readouterr().err


def test_every_option_with_an_optional_value_is_one_that_leaves_a_positional_alone():
    found = sorted((name, option) for name, sub in subcommands().items() for action in sub._actions
                   if action.nargs == "?" and action.option_strings for option in action.option_strings)
    assert found == sorted((command, option) for command, option, _, _ in CASES)  # (a new one: add it to CASES)
    for name, sub in subcommands().items():
        for action in sub._actions:
            if action.nargs == "?" and action.option_strings:
                assert isinstance(action, OptionalValue), f"{name} {action.option_strings}"


@pytest.mark.parametrize(("command", "option", "dest", "after"), CASES, ids=IDS)
def test_given_alone_before_a_positional_or_an_option_the_option_is_on_and_the_next_argument_stays(
        command, option, dest, after):
    args = parse(command, option, *after)
    assert getattr(args, dest) is True
    if command in POSITIONAL:
        assert getattr(args, POSITIONAL[command]) == after[0]
    else:
        assert args.port == 9000


@pytest.mark.parametrize(("command", "option", "dest", "after"), CASES, ids=IDS)
def test_a_whole_number_after_the_option_or_attached_to_it_is_the_count(command, option, dest, after):
    for argv in ([option, "6", *after], [f"{option}=6", *after], [*after, option, "6"], [*after, f"{option}=6"]):
        args = parse(command, *argv)
        assert getattr(args, dest) == 6, argv
        if command in POSITIONAL:
            assert getattr(args, POSITIONAL[command]) == after[0], argv


@pytest.mark.parametrize(("command", "option", "dest", "after"), CASES, ids=IDS)
def test_last_on_the_line_abbreviated_or_left_out(command, option, dest, after):
    assert getattr(parse(command, *after, option), dest) is True
    assert getattr(parse(command, option[:-2], *after), dest) is True  # argparse's abbreviations still work
    assert getattr(parse(command, option[:-2], "3", *after), dest) == 3
    assert getattr(parse(command, *after), dest) is None


@pytest.mark.parametrize(("command", "option", "dest", "after"), CASES, ids=IDS)
def test_an_attached_value_that_is_not_a_number_is_an_error_naming_the_option(capsys, command, option, dest, after):
    err = refused(capsys, command, f"{option}=clip.wav", *after)
    assert f"argument {option}: invalid int value: 'clip.wav'" in err


@pytest.mark.parametrize("command", sorted(POSITIONAL))
def test_a_positional_that_is_a_number_goes_after_a_double_dash_or_first(command):
    args = parse(command, "--early-exit", "--", "42")
    assert args.early_exit is True and getattr(args, POSITIONAL[command]) == "42"
    args = parse(command, "42", "--early-exit")
    assert args.early_exit is True and getattr(args, POSITIONAL[command]) == "42"
    args = parse(command, "--early-exit", "2", "42")
    assert args.early_exit == 2 and getattr(args, POSITIONAL[command]) == "42"


def test_the_issues_command_line_parses_and_the_drafters_stay_exclusive(capsys):
    args = parse("transcribe", "--model", "whisper-base", "--early-exit", "clip.wav")
    assert (args.model, args.early_exit, args.file) == ("whisper-base", True, "clip.wav")
    err = refused(capsys, "transcribe", "--assistant", "whisper-tiny-en", "--early-exit", "clip.wav")
    assert "argument --early-exit: not allowed with argument --assistant" in err
    err = refused(capsys, "serve", "--speech-model", "whisper-base", "--speech-self-draft", "--speech-early-exit")
    assert "not allowed with argument --speech-self-draft" in err
    assert "the following arguments are required: file" in refused(capsys, "transcribe", "--early-exit", "6")


def test_the_help_says_how_the_count_is_given(capsys):
    for name, sub in subcommands().items():
        for action in sub._actions:
            if isinstance(action, OptionalValue):
                option = action.option_strings[0]
                assert f"{option}=N" in action.help and "only when it is a whole number" in action.help, name


@pytest.mark.integration
def test_transcribe_with_early_exit_before_the_file_runs(tmp_path, capsys):
    clip = speak("Please hold the line.", tmp_path / "clip.wav")
    assert main(["transcribe", "--model", "whisper-tiny-en", "--early-exit", clip]) == 0
    out, err = capsys.readouterr()
    assert "line" in out.lower() and "mode early-exit" in err
