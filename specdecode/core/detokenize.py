"""Incremental detokenization with stop strings: emit text as soon as it is final, never past a stop."""

from __future__ import annotations

from collections.abc import Sequence

# tokens decoded again before a window's new ones: a clean-up (" ." -> ".") or a decoder that strips a text's first
# space must see what precedes the new tokens (with one token of context, a lone space token stripped hid it)
CONTEXT = 4


class IncrementalText:
    """Collects generated tokens; `add` reports a completed stop string, `ready` returns new final text.

    Text is held back while it ends in an incomplete UTF-8 sequence or could be the start of a stop
    string, so a stream never shows characters that a later token would take back.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.tokens: list[int] = []
        self.text = ""
        self.stopped = False
        self._emitted = 0  # characters already returned by ready()
        self._checked = 0  # text before this holds no stop string
        self._stale = False  # tokens added since the text was last decoded
        # decoding reads a window, not the whole text (each step's decode of every token made a request quadratic
        # in its length): the window starts at _start, CONTEXT tokens before the last
        # final text's end; `_context` is those tokens' text decoded alone (a tokenizer may read a text's first
        # token differently), `_done` the final text up to its end
        self._done, self._start, self._context = "", 0, ""

    def add(self, token: int) -> bool:
        """Append one token; True when this token completed a stop string (the text is cut before it)."""
        self.tokens.append(token)
        self._stale = True
        if not self.stop:
            return False
        self._decode()
        longest = max(map(len, self.stop))
        lo = max(0, self._checked - longest + 1)
        hits = [i for i in (self.text.find(s, lo) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
            return True
        self._checked = len(self.text)
        return False

    def ready(self) -> str:
        """Text that is final now and was not returned before."""
        self._decode()
        end = len(self.text)
        if not self.stopped:
            end = len(self.text.rstrip("\ufffd"))  # an incomplete multi-byte character
            end -= self._stop_prefix_len(self.text[:end])
        piece = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return piece

    def finish(self) -> str:
        """Everything not returned yet: the request is over, nothing will be taken back."""
        self._decode()
        piece = self.text[self._emitted :]
        self._emitted = len(self.text)
        return piece

    def _decode(self) -> None:
        """self.text = the decoded tokens, from a window: the text after the window's context is new, and final once
        it ends in a whole character (the next window's context then ends where it does)."""
        if not self._stale or self.stopped:
            return
        self._stale = False
        window = self.tokenizer.decode(self.tokens[self._start :], skip_special_tokens=True)
        if not window.startswith(self._context):  # the tokens after the context changed its text (a tokenizer's
            # clean-up across the boundary): decode it all, once
            self._done, self._start, self._context = "", 0, ""
            window = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        new = window[len(self._context) :]
        self.text = self._done + new
        if new and not new.endswith("\ufffd"):
            self._done, final = self.text, len(self.tokens)
            self._start = max(0, final - CONTEXT)
            self._context = self.tokenizer.decode(self.tokens[self._start : final], skip_special_tokens=True)

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best


class RequestText:
    """A request's text as its steps commit tokens: a stop token ends it (kept in the ids, never in the text), a
    stop string cuts it. The library's text streams and the server's events both come from `step`."""

    def __init__(self, tokenizer, stops: Sequence[str], stop_token_ids: frozenset[int]) -> None:
        self.incremental = IncrementalText(tokenizer, stops)
        self.stop_token_ids = stop_token_ids
        self.stop_token: list[int] = []  # the stop token that ended the text, if one did
        self.finish: str | None = None  # "stop" | "length" once the text has ended

    @property
    def text(self) -> str:
        return self.incremental.text

    @property
    def token_ids(self) -> list[int]:
        """The tokens behind the text, and the stop token that ended it."""
        return self.incremental.tokens + self.stop_token

    def step(self, tokens: list[int], finish_reason: str | None) -> str:
        """New final text after a step committed `tokens` (`finish_reason`: the request's, once it ended)."""
        for token in tokens:
            if token in self.stop_token_ids:
                self.finish, self.stop_token = "stop", [token]
                break
            if self.incremental.add(token):
                self.finish = "stop"
                break
        self.finish = self.finish or finish_reason
        return self.incremental.ready() + (self.incremental.finish() if self.finish else "")
