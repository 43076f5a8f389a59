"""Every speculation method the server may run is set up before it takes a request: the target's forward cost
timed, draft models and trained heads loaded, the layer-skip search run, low-bit copies made, each shown in the
log. A request never waits for any of that (minutes, and not cancellable once begun), and
a method that cannot run (no head, no calibration data) stops the server at start with the reason."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Iterable

from ..api import LLM, METHODS
from ..policy.cost import CostModel
from ..proposers.layer_skip import load_skip_search

log = logging.getLogger("specdecode.server")

# cheap to set up and useful to any client: allowed unless --methods says otherwise
DEFAULT_METHODS = ("none", "prompt-lookup", "lookahead")
_ready: weakref.WeakKeyDictionary[LLM, set[tuple[str, str | None]]] = weakref.WeakKeyDictionary()


def parse_methods(spec: str, default: str) -> tuple[str, ...]:
    """`--methods`: a comma list, or empty for DEFAULT_METHODS; the default method always joins, and 'none'
    (speculation off) is always allowed. (No 'all': draft, eagle and medusa each read --draft differently.)"""
    chosen = [m.strip() for m in spec.split(",") if m.strip()] if spec.strip() else list(DEFAULT_METHODS)
    unknown = [m for m in chosen if m not in METHODS]
    if unknown:
        raise ValueError(f"--methods: unknown method {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    return tuple(dict.fromkeys(["none", default, *chosen]))


def warm_up(llm: LLM, methods: Iterable[str], draft: str | None) -> None:
    """Set up each method once, as its first request would have; raise ValueError naming the method that
    cannot run and why. Methods already set up for this model are skipped."""
    ready = _ready.setdefault(llm, set())
    requested = ",".join(methods)
    methods = [m for m in methods if m != "none" and (m, draft) not in ready]
    if not methods:
        return
    started = time.perf_counter()
    if llm.assets._cost is None and CostModel.cached(llm.model) is None:  # else it is in memory or on disk
        log.info("timing the target's forward by size (once per model and machine, then cached; seconds)")
    llm.assets.cost_model()
    for i, method in enumerate(methods, 1):
        log.info("setting up %s (%d/%d)%s", method, i, len(methods), what(method, llm))
        t = time.perf_counter()
        try:
            if uses_layer_search(method, draft) and load_skip_search(llm.model) is None:
                search_layers(llm)
            llm.proposer(method, draft)
        except (ValueError, FileNotFoundError, OSError) as e:
            raise ValueError(f"the server cannot run method {method!r}: {e}. Fix that, or leave {method} out of "
                             f"--methods (now {requested})") from None
        ready.add((method, draft))
        log.info("%s ready (%.1f s)", method, time.perf_counter() - t)
    log.info("%d methods ready in %.1f s: %s", len(methods), time.perf_counter() - started, ", ".join(methods))


def uses_layer_search(method: str, draft: str | None) -> bool:
    return method == "layer-skip" or (method == "hybrid" and draft is None)


def what(method: str, llm: LLM) -> str:
    return {
        "draft": ": loading the draft model",
        "eagle": ": loading the EAGLE head",
        "medusa": ": loading the Medusa heads",
        "quantized": ": making the target's low-bit copy",
        "layer-skip": ": " + ("reading the cached layer search" if load_skip_search(llm.model) else
                              "searching which layers to skip (once per model and machine, then cached)"),
    }.get(method, "")


def search_layers(llm: LLM) -> None:
    def show(step) -> None:
        log.info("  layer-skip: skipping %s: agreement %.2f, predicted %.2fx", step.skipped or "none",
                 step.agreement, step.speedup)

    result = llm.assets.tune_layer_skip(progress=show)
    log.info("  layer-skip: drafts without layers %s%s", result.skipped,
             "" if result.pays else " (does not pay on this machine: k=auto runs plain steps)")
