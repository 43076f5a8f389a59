"""Incremental detokenization: the text after every token is the whole text decoded, while each step decodes only a
short window (decoding every token each step made a long request quadratic), for tokenizers that read a text's start
differently or clean spaces up across tokens."""

from __future__ import annotations

import random

import pytest

from specdecode.core.detokenize import IncrementalText

from .helpers import make_tokenizer

TEXT = ("Hello, world! Don't stop . It's 3.14 , ok ? Ünïcödé — “quotes” 日本語のテキスト 😀👍🏽 and 🇫🇷 flags.\n\n"
        "```python\ndef f(x):\n    return x ** 2\n```\n  Ça va? Ελληνικά, русский, हिन्दी. ∑∫√ ≤≥ ½")


class Counting:
    """A tokenizer whose decode counts the tokens it reads, and optionally strips a text's leading space (as
    SentencePiece's decoders do) or cleans up ' .' and ' ,' (as `clean_up_tokenization_spaces` does)."""

    def __init__(self, tokenizer, strip: bool = False, clean_up: bool = False) -> None:
        self.tokenizer, self.strip, self.clean_up = tokenizer, strip, clean_up
        self.read: list[int] = []

    def decode(self, tokens, skip_special_tokens: bool = False) -> str:
        self.read.append(len(tokens))
        text = self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)
        if self.strip:
            text = text.removeprefix(" ")
        if self.clean_up:
            text = text.replace(" .", ".").replace(" ,", ",")
        return text


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.mark.parametrize("strip", [False, True])
@pytest.mark.parametrize("clean_up", [False, True])
def test_text_after_every_token_is_the_whole_text_decoded(tokenizer, strip, clean_up) -> None:
    rng = random.Random(0)
    encoded = tokenizer.encode(TEXT * 3, add_special_tokens=False)
    soup = [rng.randrange(len(tokenizer)) for _ in range(400)]  # splits multi-byte characters, specials included
    for tokens in (encoded, soup):
        counting = Counting(tokenizer, strip, clean_up)
        text, shown = IncrementalText(counting), ""
        for i, token in enumerate(tokens):
            text.add(token)
            shown += text.ready()
            assert text.text == counting.decode(tokens[: i + 1], skip_special_tokens=True), i
        if not clean_up:  # a clean-up may take back a space already shown (as a whole-text decode did too)
            assert shown + text.finish() == text.text


def test_each_step_decodes_a_window_not_the_whole_text(tokenizer) -> None:
    counting = Counting(tokenizer)
    text = IncrementalText(counting)
    pieces = []
    for token in tokenizer.encode(TEXT * 4, add_special_tokens=False):
        text.add(token)
        pieces.append(text.ready())
    assert "".join(pieces) + text.finish() == tokenizer.decode(tokenizer.encode(TEXT * 4, add_special_tokens=False))
    assert len(counting.read) > 400 and max(counting.read) <= 16  # a whole-text decode would read ~500 tokens


def test_stop_string_split_across_windows_cuts_exactly(tokenizer) -> None:
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    text = IncrementalText(tokenizer, stop=["return x"])
    shown = ""
    for token in tokens:
        stopped = text.add(token)
        shown += text.ready()
        if stopped:
            break
    assert text.stopped and text.text == TEXT[: TEXT.index("return x")]
    assert shown + text.finish() == text.text
