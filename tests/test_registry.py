"""Method selection is a table: every method named in names.METHODS has options (a dataclass of defaults) and a
builder, and `registry.build` gives each method its own options and wraps a model draft where asked."""

from __future__ import annotations

from dataclasses import fields

import pytest

from specdecode.common.names import METHODS
from specdecode.proposers import (
    LookaheadProposer,
    NoProposer,
    PromptLookupProposer,
    SuffixCache,
    SuffixProposer,
    registry,
)
from specdecode.proposers.draft_model import DraftModelProposer

from .helpers import FrozenCost, tiny_model


class FakeAssets:
    """The assets the light methods read: a tiny target, a cost table, the suffix cache."""

    def __init__(self) -> None:
        self.model = tiny_model(0, vocab_size=24)
        self.cost = FrozenCost([1, 64], [0, 1000], [[1.0, 1.5], [1.0, 1.5]])
        self.cache = SuffixCache()

    def cost_model(self):
        return self.cost

    def suffix_cache(self, max_tokens=None):
        return self.cache

    def auto_branches(self) -> int:
        return 3

    def draft_model(self, draft):
        return self  # a "loaded LLM": its .model drafts


def test_every_method_has_options_with_defaults_and_a_builder() -> None:
    assert set(registry.TABLE) == set(METHODS)
    for method in registry.TABLE.values():
        method.options()  # every option has a default
    assert registry.option_names() == {f.name for m in registry.TABLE.values() for f in fields(m.options)} | {
        "cascade", "async_draft", "draft_threads"}


def test_each_method_takes_its_own_options_and_ignores_the_others() -> None:
    assets = FakeAssets()
    assert isinstance(registry.build(assets, "none"), NoProposer)
    auto = registry.build(assets, "prompt-lookup", k="auto", window=9)
    assert isinstance(auto, PromptLookupProposer) and auto.branches == 3 and auto.max_ngram == 3
    fixed = registry.build(assets, "prompt-lookup", k=4, max_ngram=5)
    assert isinstance(fixed, PromptLookupProposer) and fixed.branches == 1 and fixed.max_ngram == 5
    lookahead = registry.build(assets, "lookahead", window=6, max_ngram=9)
    assert isinstance(lookahead, LookaheadProposer) and lookahead.window == 6
    sized, unsized = (registry.build(assets, "suffix", k=k, nodes=7) for k in ("auto", 4))
    assert isinstance(sized, SuffixProposer) and sized.cost is assets.cost and sized.nodes == 7
    assert isinstance(unsized, SuffixProposer) and unsized.cost is None and sized.cache is unsized.cache
    cascade = registry.build(assets, "draft", "tiny", cascade="prompt-lookup", max_ngram=4)
    assert isinstance(cascade, DraftModelProposer) and cascade.lookup is not None and cascade.lookup.max_ngram == 4


def test_refusals_say_what_to_do() -> None:
    assets = FakeAssets()
    with pytest.raises(ValueError, match="unknown method 'nope'; choose one of none"):
        registry.build(assets, "nope")
    with pytest.raises(ValueError, match="online_draft trains the EAGLE head"):
        registry.build(assets, "suffix", online_draft=True)
    with pytest.raises(ValueError, match="needs a draft model"):
        registry.build(assets, "draft")
    with pytest.raises(ValueError, match="cascade: prompt lookup guesses for a model draft"):
        registry.build(assets, "suffix", cascade="prompt-lookup")
