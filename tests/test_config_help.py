"""`--help` of a user script that parses `AsyncGRPOConfig` / `AsyncPPOConfig` with TRL's `TrlParser` (issue 32).

argparse renders every help string with `%` formatting (`help % {"default": ..., "prog": ...}`), so a bare `%` in
a field's `metadata["help"]` either crashes `--help` ("20% of" reads as the spec `% o`) or silently prints the
wrong text (`%s`). The convention is transformers' and TRL's: write `%%` for a percent sign.

- Each field's help is rendered on its own through `TrlParser`, so a failure names the field.
- The whole `--help` of `TrlParser((Config,))` (and with `ModelConfig`, as the recipe builds it) exits 0 and shows
  our fields' texts.
- The raw help strings hold no `%` other than `%%` and argparse's own `%(name)s` placeholders: that catches a `%s`
  that would render without an error but print a dict.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest
from trl import GRPOConfig, ModelConfig, TrlParser

from trl_async import AsyncGRPOConfig, AsyncPPOConfig

CONFIGS = [AsyncGRPOConfig, AsyncPPOConfig]
# argparse's placeholders (`%(default)s`, `%(prog)s`, ...) and the escaped percent sign.
ARGPARSE_PERCENT = re.compile(r"%%|%\((default|prog|type|choices|dest|metavar|required|help)\)[sdrf]")


def own_fields(config_class) -> list[dataclasses.Field]:
    """The fields this project declares (or redeclares) on top of TRL's GRPOConfig, with their help."""
    trl_fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    return [
        f
        for f in dataclasses.fields(config_class)
        if f.name not in trl_fields or f.metadata.get("help") != trl_fields[f.name].metadata.get("help")
    ]


def field_help_action(parser: argparse.ArgumentParser, name: str) -> argparse.Action:
    (action,) = [a for a in parser._actions if f"--{name}" in a.option_strings]
    return action


def normalized(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("config_class", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_renders_its_help_through_trl_parser(config_class):
    """Every option TrlParser builds from the config (TRL's fields included) renders; our fields show their full
    help text, with `%%` printed as `%`."""
    parser = TrlParser((config_class,))
    formatter = parser._get_formatter()
    options = {action.dest for action in parser._actions}
    missing = [f.name for f in dataclasses.fields(config_class) if f.init and f.name not in options]
    assert not missing, f"fields without a command-line option: {missing}"
    for action in parser._actions:
        if action.help in (None, argparse.SUPPRESS):
            continue
        try:
            text = formatter._expand_help(action)
        except (TypeError, ValueError, KeyError) as error:
            pytest.fail(f"--help of {action.dest} does not render: {type(error).__name__}: {error}")
        # A stray `%s` prints the dict of argparse's parameters, which has this key.
        assert "'option_strings'" not in text, f"--help of {action.dest} prints argparse's dict: {text!r}"

    for f in own_fields(config_class):
        raw = f.metadata.get("help")
        assert raw, f"{config_class.__name__}.{f.name} has no help"
        shown = formatter._expand_help(field_help_action(parser, f.name))
        expected = raw.replace("%%", "%")
        assert normalized(shown).startswith(normalized(expected)), (f.name, shown)


def test_the_shared_prompt_forward_help_keeps_its_percent():
    """The help that crashed `--help` (issue 32) is shown whole, "under 20% of the tokens" included."""
    parser = TrlParser((AsyncGRPOConfig,))
    shown = parser._get_formatter()._expand_help(field_help_action(parser, "shared_prompt_forward"))
    assert "saves under 20% of the tokens (long completions)" in normalized(shown)


@pytest.mark.parametrize("config_class", CONFIGS, ids=lambda c: c.__name__)
def test_help_strings_hold_no_bare_percent(config_class):
    """A `%` must be `%%` (or an argparse placeholder): `%s`, `% o`, `%d` in a help string are mistakes even where
    argparse happens not to raise."""
    for f in own_fields(config_class):
        bare = ARGPARSE_PERCENT.sub("", f.metadata.get("help", ""))
        assert "%" not in bare, f"{config_class.__name__}.{f.name}: write '%%' for a percent sign: {bare!r}"


def test_the_percent_check_catches_what_argparse_lets_through():
    """The check above is not vacuous: a `%s` renders without an error (the dict of argparse's parameters is
    printed), and the check flags it; `%%` and `%(default)s` pass."""
    parser = argparse.ArgumentParser()
    action = parser.add_argument("--share", help="under 20%s of the tokens")
    assert "'option_strings'" in parser._get_formatter()._expand_help(action)
    assert "%" in ARGPARSE_PERCENT.sub("", "under 20%s of the tokens")
    assert "%" not in ARGPARSE_PERCENT.sub("", "under 20%% of the tokens (default: %(default)s)")


@pytest.mark.parametrize("with_model_config", [False, True], ids=["alone", "with_ModelConfig"])
@pytest.mark.parametrize("config_class", CONFIGS, ids=lambda c: c.__name__)
def test_help_of_trl_parser_exits_0(config_class, with_model_config, capsys):
    """A user script's `TrlParser((Config,) [+ ModelConfig]).parse_args_and_config()` given `--help`: argparse prints
    the help and exits 0, our options listed with their text. (`tests/test_entry_points.py` runs the recipe's
    `--help`, built the same way, in a child process.)"""
    parser = TrlParser((config_class, ModelConfig) if with_model_config else (config_class,))
    with pytest.raises(SystemExit) as exited:
        parser.parse_args_and_config(args=["--help"])
    assert exited.value.code == 0
    help_text = normalized(capsys.readouterr().out)
    assert help_text.startswith("usage:")
    for option in ("--max_staleness", "--shared_prompt_forward", "--m2po_rule", "--output_dir", "--loss_type"):
        assert option in help_text
    assert "saves under 20% of the tokens" in help_text
    if config_class is AsyncPPOConfig:
        assert "--vf_coef" in help_text and "--kl_coef" in help_text
    assert ("--model_name_or_path" in help_text) == with_model_config
