"""Keyword arguments checked against the public function the user called, with a did-you-mean."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Collection, Iterable


def keyword_names(func: Callable) -> set[str]:
    """The keyword arguments `func` names (not *args / **kwargs)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in inspect.signature(func).parameters.values() if p.kind in kinds} - {"self"}


def check_keywords(func: str, given: Iterable[str], known: Collection[str]) -> None:
    """TypeError, as Python's own, for the first keyword of `given` not in `known`, naming the closest one."""
    for name in given:
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else f"; it takes {', '.join(sorted(known))}"
            raise TypeError(f"{func}() got an unexpected keyword argument {name!r}{hint}")
