"""What every `specdecode` command line shares: a parser whose --help shows defaults, and checked number types."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help appends each option's default, except where there is none to show (None, a flag's False, an empty
    list) or the help text already says it ("(default: ...)")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if default is None or default is False or default == [] or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose subcommands (and theirs) are Parsers with DefaultsHelpFormatter too."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


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
