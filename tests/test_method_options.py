"""Each method's options are written once (common/method_options.py): the method table reads them, `specdecode
generate` has a flag for every one, a server request's `speculation` object a field for every one a request may
set, and the server's own command line the ones it sets up at start."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

import pytest

from specdecode.cli.commands import build_parser
from specdecode.common import method_options
from specdecode.common.method_options import OPTIONS, WrapOptions, all_options, option
from specdecode.proposers import registry
from specdecode.server import schemas
from specdecode.server.errors import APIError

# what a server sets up once at start and never takes from a request: its command line's flag, or None where
# `specdecode serve` does not offer it (the server then runs the method's default)
SET_UP_AT_START = {"online_draft": "--online-draft", "async_draft": "--async-draft", "skip_layers": None,
                   "low_bit": None, "cascade": None, "draft_threads": None}


def subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser(command)
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


def test_the_table_reads_each_methods_options_from_the_one_place() -> None:
    assert {name: m.options for name, m in registry.TABLE.items()} == OPTIONS
    assert registry.option_names() == {f.name for cls in [*OPTIONS.values(), WrapOptions] for f in fields(cls)}


def test_every_option_of_every_method_is_a_generate_flag_with_its_default() -> None:
    actions = {a.dest: a for a in subparser("generate")._actions}
    for name, opt in all_options().items():
        assert name in actions, f"generate has no {opt.flag}"
        action = actions[name]
        assert action.option_strings == [opt.flag] and action.default == opt.default
        for method in opt.methods:
            assert method in (action.help or ""), (name, method)


def test_every_option_is_a_request_field_or_set_up_at_start() -> None:
    request_fields = set(schemas.Speculation.model_fields) - {"method", "k"}
    per_request = {name for name, opt in all_options().items() if opt.per_request}
    assert request_fields == per_request
    assert set(all_options()) - per_request == set(SET_UP_AT_START)
    serve = {s for a in subparser("serve")._actions for s in a.option_strings}
    assert {flag for flag in SET_UP_AT_START.values() if flag} <= serve


def test_generate_parses_the_generated_flags() -> None:
    args = build_parser("generate").parse_args(["generate", "hi", "--max-ngram", "5", "--skip-layers", "3,5",
                                                "--online-draft", "--low-bit", "int8"])
    options = method_options.method_options(args)
    assert options["max_ngram"] == 5 and options["skip_layers"] == [3, 5] and options["online_draft"] is True
    assert options["low_bit"] == "int8" and options["window"] == 4 and options["cascade"] is None


@pytest.mark.parametrize("argv,message", [
    (["--skip-layers", "3,x"], "not a comma list of layer indexes"),
    (["--low-bit", "int3"], "invalid choice: 'int3'"),
    (["--draft-threads", "0"], "a count must be >= 1"),
])
def test_generate_refuses_bad_option_values(argv, message, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser("generate").parse_args(["generate", "hi", *argv])
    assert message in capsys.readouterr().err


def test_a_request_sets_its_methods_options_within_bounds() -> None:
    body = {"model": "m", "prompt": "hi", "speculation": {"method": "prompt-lookup", "max_ngram": 2, "branches": 1}}
    spec = schemas.parse(schemas.CompletionRequest, body).speculation
    assert spec.options() == {"max_ngram": 2, "branches": 1}
    assert schemas.parse(schemas.CompletionRequest, {**body, "speculation": {"k": 3}}).speculation.options() == {}
    for bad in (0, schemas.MAX_OPTION + 1, "2", 2.0):
        with pytest.raises(APIError, match="speculation.window") as refused:
            schemas.parse(schemas.CompletionRequest, {**body, "speculation": {"window": bad}})
        assert refused.value.status == 400
    with pytest.raises(APIError, match="unrecognized request argument `speculation.low_bit`"):
        schemas.parse(schemas.CompletionRequest, {**body, "speculation": {"low_bit": "int8"}})


def test_an_option_that_means_two_things_is_refused(monkeypatch) -> None:
    """Negative control: two methods that give one option name different defaults cannot both be generated."""

    @dataclass(frozen=True)
    class Other:
        max_ngram: int = option(5, method_options.MAX_NGRAM, per_request=True)

    monkeypatch.setitem(OPTIONS, "other", Other)
    with pytest.raises(TypeError, match="option 'max_ngram' differs between methods prompt-lookup and other"):
        all_options()
