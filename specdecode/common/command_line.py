"""What every `specdecode` command line shares (the subcommands in cli/, `serve` in server/cli.py): a parser whose
--help shows defaults and whose errors guess what was meant, checked number types, and the precision options
(--dtype, --quantization, --kv-cache-dtype) of generate, tune, bench and serve. Standard library only: `specdecode
--help` answers without torch."""

from __future__ import annotations

import argparse
import difflib
import re

from .names import DTYPE_NAMES, KV_CACHE_DTYPES, QUANTIZATIONS


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help appends each option's default, except where there is none to show (None, a flag's False, an empty
    list) or the help text already says it ("(default: ...)")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if default is None or default is False or default == [] or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose subcommands (and theirs) are Parsers with DefaultsHelpFormatter too, and whose errors
    guess what was meant: a mistyped option or choice gets the closest one, under the usage of the subcommand it
    was given to (argparse leaves an unknown option of a subcommand to the top level, whose usage says nothing
    about the subcommand's options)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self.chosen(parsed)
            parser.error(parser.unrecognized(extras))
        return parsed

    def chosen(self, parsed: argparse.Namespace) -> Parser:
        """The innermost subcommand's parser that `parsed` went through (`train eagle`: eagle's)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                picked = action.choices.get(getattr(parsed, action.dest, None) or "")
                if isinstance(picked, Parser):
                    return picked.chosen(parsed)
        return self

    def unrecognized(self, extras: list[str]) -> str:
        options = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
        hints = []
        for extra in extras:
            flag = extra.split("=", 1)[0]
            close = difflib.get_close_matches(flag, options, n=1, cutoff=0.6) if flag.startswith("-") else []
            if close:
                hints.append((flag, close[0]))
        message = f"unrecognized arguments: {' '.join(extras)}"
        if len(hints) == 1:
            return message + f"; did you mean {hints[0][1]}?"
        return message + "".join(f"; {flag}: did you mean {guess}?" for flag, guess in hints)

    def error(self, message: str):
        # argparse's "invalid choice: 'x' (choose from 'a', 'b')", of a subcommand's name or an option's value
        found = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if found:
            choices = re.findall(r"'([^']*)'", found.group(2))
            close = difflib.get_close_matches(found.group(1), choices, n=1, cutoff=0.5)
            if close:
                message += f"; did you mean {close[0]!r}?"
        super().error(message)


def int_in(low: int, high: int | None = None, what: str = "a number"):
    """An argparse type: an integer in [low, high], refused by argparse (usage and a one-line error) otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            bound = f"from {low} to {high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"{what} must be {bound}, got {value}")
        return value

    parse.__name__ = what  # argparse names the type in its messages
    return parse


port = int_in(1, 65535, "a TCP port")
positive = int_in(1, None, "a count")

QUANTIZATION_CHOICES = ["auto", "none", *QUANTIZATIONS]


def add_precision_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="float32", choices=list(DTYPE_NAMES),
                   help="activations and unquantized weights (default: %(default)s)")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATION_CHOICES,
                   help="weights: auto = a GGUF file's Q4_0/Q4_1/Q8_0 as stored, int8 activations as llama.cpp, "
                   "others in --dtype; none = all in --dtype; int4/int8 = weight-only, float32 activations; "
                   "int4-a8/int8-a8 = int8 activations too (default: %(default)s)")
    p.add_argument("--kv-cache-dtype", default="float16", choices=list(KV_CACHE_DTYPES),
                   help="keys and values of a float32 model: float16 = half the memory, as llama.cpp; int8 = a quarter "
                   "(a scale a row: long contexts read half float16's bytes); float32 = as computed "
                   "(default: %(default)s)")


def quantization(args: argparse.Namespace) -> str | None:
    """--quantization as `specdecode.load` takes it ("none" -> None)."""
    return None if args.quantization == "none" else args.quantization
