"""Each speculation method's options, in one place: a dataclass per method whose fields are its keyword options with
their defaults and help. The method table (proposers/registry.py) pairs each with its builder; `specdecode generate`'s
flags (cli/commands.py) and the `speculation` object of a server request (server/schemas.py) are generated from
these fields, so an option is written once.

An option a request may set (`per_request`) is cheap to apply to a fresh proposer; the others are set up once, when
a model loads or a server starts (a low-bit copy, a layer search, a learner, a drafting thread), so a server takes
them from its own command line, never from a request.

Standard library only, like names.py: `specdecode generate --help` answers without torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from .command_line import positive
from .names import QUANTIZATIONS


def option(default: Any, help: str, *, parse: Callable[[str], Any] = int, choices: Sequence[str] | None = None,
           per_request: bool = False) -> Any:
    """A field of a method's options: its default, its help, how a command line parses it (a bool is a flag) and
    whether a request may set it."""
    return field(default=default, metadata={"help": help, "parse": parse, "choices": choices,
                                            "per_request": per_request})


def layer_list(text: str) -> list[int]:
    """--skip-layers: a comma list of layer indexes."""
    try:
        return [int(i) for i in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of layer indexes (e.g. 3,5,7)") from None


layer_list.__name__ = "a comma list of layers"

# the fields several methods share, written once
MAX_NGRAM = "longest n-gram matched"
MIN_NGRAM = "shortest n-gram matched"
BRANCHES = ("continuations merged into a tree (default: 1; prompt-lookup with --k auto: 3, which verifies as much "
            "of the tree as pays)")
SKIP_LAYERS = ("comma list of layers the draft leaves out (default: layer-skip, hybrid: searched once and cached; "
               "quantized: none)")
TOPK = "the EAGLE head's children per expanded tree node"
NODES = "most guessed tokens a step (the cost model picks how many are worth verifying)"
ONLINE = "the EAGLE head learns from what the target verifies while it runs"


@dataclass(frozen=True)
class NoOptions:
    """Plain decoding takes no options."""


@dataclass(frozen=True)
class PromptLookupOptions:
    max_ngram: int = option(3, MAX_NGRAM, per_request=True)
    min_ngram: int = option(1, MIN_NGRAM, per_request=True)
    branches: int | None = option(None, BRANCHES, per_request=True)  # None: `Assets.auto_branches` under k="auto"


@dataclass(frozen=True)
class DraftOptions:
    """A model draft takes no options besides `draft` (the model)."""


@dataclass(frozen=True)
class LookaheadOptions:
    window: int = option(4, "Jacobi window columns", per_request=True)
    ngram: int = option(3, "n-gram size (levels = ngram - 1)", per_request=True)
    guesses: int = option(4, "pool n-grams verified per step", per_request=True)


@dataclass(frozen=True)
class LayerSkipOptions:
    skip_layers: Sequence[int] | None = option(None, SKIP_LAYERS, parse=layer_list)  # None: searched, cached


@dataclass(frozen=True)
class EagleOptions:
    topk: int = option(4, TOPK, per_request=True)
    nodes: int = option(24, NODES, per_request=True)  # the cost model sizes the tree within them and the depth k
    online_draft: bool = option(False, ONLINE)  # the learner is the model's (`Assets.online_head`)


@dataclass(frozen=True)
class MedusaOptions:
    """Medusa takes no options besides `draft` (the trained heads' folder); the cost model sizes its trees."""


@dataclass(frozen=True)
class QuantizedOptions:
    low_bit: str = option("int4-a8", "the precision of the target's copy that drafts", parse=str,
                          choices=QUANTIZATIONS)
    skip_layers: Sequence[int] | None = option(None, SKIP_LAYERS, parse=layer_list)  # the copy leaves them out too


@dataclass(frozen=True)
class SuffixOptions:
    nodes: int = option(24, NODES, per_request=True)  # sized by the cost model under k="auto"


@dataclass(frozen=True)
class HybridOptions:
    max_ngram: int = option(3, MAX_NGRAM, per_request=True)  # prompt lookup beside a model draft
    min_ngram: int = option(1, MIN_NGRAM, per_request=True)
    branches: int | None = option(None, BRANCHES, per_request=True)
    skip_layers: Sequence[int] | None = option(None, SKIP_LAYERS, parse=layer_list)  # the layer-skipped target
    topk: int = option(4, TOPK, per_request=True)  # the EAGLE head beside suffix decoding
    nodes: int = option(24, NODES, per_request=True)  # ... and suffix decoding
    online_draft: bool = option(False, ONLINE)


@dataclass(frozen=True)
class WrapOptions:
    """Options of any model draft (draft, quantized, layer-skip): what wraps the proposer its method builds."""

    cascade: str | None = option(None, "prompt lookup guesses for the draft model, which checks its guesses in one "
                                 "forward", parse=str, choices=("prompt-lookup",))
    async_draft: bool = option(False, "the draft drafts the next step while the target verifies this one (a worker "
                               "thread; output unchanged)")
    draft_threads: int = option(1, "--async-draft: threads of the drafter (the target's forwards keep the other "
                                "cores)", parse=positive)


OPTIONS: dict[str, type] = {
    "none": NoOptions, "prompt-lookup": PromptLookupOptions, "draft": DraftOptions, "lookahead": LookaheadOptions,
    "layer-skip": LayerSkipOptions, "eagle": EagleOptions, "medusa": MedusaOptions, "quantized": QuantizedOptions,
    "suffix": SuffixOptions, "hybrid": HybridOptions,
}
MODEL_DRAFTS = ("draft", "quantized", "layer-skip")  # the methods WrapOptions apply to


@dataclass(frozen=True)
class Option:
    """One keyword option as every method that takes it shares it: one flag, one request field."""

    name: str
    default: Any
    help: str
    parse: Callable[[str], Any]
    choices: Sequence[str] | None
    per_request: bool
    methods: tuple[str, ...]

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def all_options() -> dict[str, Option]:
    """Every option some method (or the wrapping of a model draft) takes, by name, with the methods that take it.
    A name means one thing everywhere: methods that share it share its default and its help."""
    found: dict[str, Option] = {}
    owners = [*((method, cls) for method, cls in OPTIONS.items()), *((m, WrapOptions) for m in MODEL_DRAFTS)]
    for method, cls in owners:
        for f in fields(cls):
            default = None if f.default is MISSING else f.default
            meta = f.metadata
            seen = found.get(f.name)
            if seen is None:
                found[f.name] = Option(f.name, default, meta["help"], meta["parse"], meta["choices"],
                                       meta["per_request"], (method,))
                continue
            if (seen.default, seen.help, seen.per_request) != (default, meta["help"], meta["per_request"]):
                raise TypeError(f"option {f.name!r} differs between methods {seen.methods[0]} and {method}")
            found[f.name] = Option(seen.name, seen.default, seen.help, seen.parse, seen.choices, seen.per_request,
                                   (*seen.methods, method))
    return found


def add_method_flags(parser: argparse.ArgumentParser) -> None:
    """A flag for each option: '--max-ngram N', help naming the methods that read it; a bool is a plain flag."""
    for opt in all_options().values():
        text = f"{', '.join(opt.methods)}: {opt.help}"
        if isinstance(opt.default, bool):
            parser.add_argument(opt.flag, action="store_true", help=text)
        else:
            parser.add_argument(opt.flag, type=opt.parse, default=opt.default, help=text,
                                choices=list(opt.choices) if opt.choices else None)


def method_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options a parsed command line gives (every option, at its default where not given)."""
    return {name: getattr(args, name) for name in all_options()}
