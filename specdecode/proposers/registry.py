"""Method selection as a table: each method's name -> its options (a dataclass whose fields are the method's keyword
options, with their defaults and help: common/method_options.py, torch-free, so the command line's flags and the
server's request fields are generated from them) and its builder, beside the method's proposer. `build` makes a
fresh proposer from the table, and wraps a model draft where asked (a cascade, asynchronous drafting)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from ..common.method_options import OPTIONS, WrapOptions, all_options
from ..common.names import METHODS
from . import base, draft_model, eagle, hybrid, layer_skip, lookahead, medusa, prompt_lookup, quantized, suffix
from .assets import Assets, Draft
from .async_draft import AsyncDraftProposer
from .base import Proposer
from .draft_model import DraftModelProposer
from .prompt_lookup import PromptLookupProposer


@dataclass(frozen=True)
class Method:
    options: type  # a dataclass: the method's options and their defaults
    build: Callable[[Assets, Any, Draft, int | str], Proposer]  # (assets, options, draft, k) -> a fresh proposer

    def option_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self.options))


BUILDERS: dict[str, Callable[[Assets, Any, Draft, int | str], Proposer]] = {
    "none": base.build, "prompt-lookup": prompt_lookup.build, "draft": draft_model.build, "lookahead": lookahead.build,
    "layer-skip": layer_skip.build, "eagle": eagle.build, "medusa": medusa.build, "quantized": quantized.build,
    "suffix": suffix.build, "hybrid": hybrid.build,
}
TABLE: dict[str, Method] = {name: Method(OPTIONS[name], build) for name, build in BUILDERS.items()}


def option_names() -> set[str]:
    """Every keyword option some method (or the wrapping of a model draft) takes."""
    return set(all_options())


def build(assets: Assets, method: str, draft: Draft = None, *, k: int | str = "auto", **options: Any) -> Proposer:
    """A fresh proposer for `method`, to run with `k`; options: any method's (`option_names`), each method taking its
    own (the others are ignored, so one set of options can serve several methods)."""
    if options.get("online_draft") and method not in ("eagle", "hybrid"):
        raise ValueError(f"online_draft trains the EAGLE head: it goes with method 'eagle' or 'hybrid', not "
                         f"{method!r}")
    if method not in TABLE:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    chosen = TABLE[method]
    own = chosen.options(**{name: options[name] for name in chosen.option_names() if name in options})
    proposer = chosen.build(assets, own, draft, k)
    wrap = WrapOptions(**{f.name: options[f.name] for f in fields(WrapOptions) if f.name in options})
    if wrap.cascade is not None:
        if wrap.cascade != "prompt-lookup":
            raise ValueError(f"cascade drafts with 'prompt-lookup' (for a model draft), not {wrap.cascade!r}")
        if not isinstance(proposer, DraftModelProposer):
            raise ValueError(f"cascade: prompt lookup guesses for a model draft (method draft, quantized or "
                             f"layer-skip), not for {method!r}")
        lookup = prompt_lookup.PromptLookupOptions()
        proposer.lookup = PromptLookupProposer(max_ngram=options.get("max_ngram", lookup.max_ngram),
                                               min_ngram=options.get("min_ngram", lookup.min_ngram))
    if wrap.async_draft:  # AsyncDraftProposer refuses what cannot draft ahead, and says why
        proposer = AsyncDraftProposer(proposer, assets.drafter(wrap.draft_threads))
    return proposer
