"""A progress bar with a time estimate on stderr, for one-off work that can take more than a couple of seconds
(timing forwards on a new machine), usable inside another live display (then it stays quiet)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.errors import LiveError
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

Advance = Callable[[], None]


@contextmanager
def progress_bar(description: str, total: int) -> Iterator[Advance]:
    """Yields a function to call after each of `total` units of work."""
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("eta"), TimeRemainingColumn(), console=Console(stderr=True), transient=True)
    task = bar.add_task(description, total=total)
    try:
        bar.start()
    except LiveError:  # another live display (a spinner, the benchmark's bar) owns the terminal
        yield lambda: None
        return
    try:
        yield lambda: bar.advance(task)
    finally:
        bar.stop()
