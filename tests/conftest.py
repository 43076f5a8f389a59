"""Shared test setup, and the guard that keeps the suite independent of what lies beside the checkout."""

from __future__ import annotations

import os
import signal
import sys
import sysconfig
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

CHECKOUT = Path(__file__).resolve().parents[1]

# The tests need nothing beside the repository (README, "Set up and run"): a bare clone runs them as CI does. The
# library looks for optional data in $SPECDECODE_DATA, else in shared/data beside the checkout; an empty folder of
# our own is set here, before any test module imports specdecode, so no default ever finds the data a developer
# keeps there, and the guard below fails a test that still reads it.
_USER_DATA = os.environ.get("SPECDECODE_DATA")
os.environ["SPECDECODE_DATA"] = tempfile.mkdtemp(prefix="specdecode-tests-no-data-")


def _real(path: str | os.PathLike[str]) -> str:
    return os.path.realpath(os.path.expanduser(os.fspath(path)))


def _forbidden_roots() -> list[str]:
    """What a test must not read: the folder holding the checkout (its neighbours: ../shared, other clones) and the
    user's data folder. A checkout at the file system's root has no such folder; only shared/ beside it counts."""
    roots = [str(CHECKOUT.parent / "shared")]
    if CHECKOUT.parent != Path(CHECKOUT.anchor):
        roots.append(str(CHECKOUT.parent))
    if _USER_DATA:
        roots.append(_USER_DATA)
    return sorted({_real(r) for r in roots})


def _allowed_roots() -> list[str]:
    """Where reading is fine even inside a forbidden root: the checkout, the temp dir, the Python installation
    (a virtualenv may sit beside the checkout) and the per-user caches (converted tokenizers, built kernels)."""
    roots = [str(CHECKOUT), tempfile.gettempdir(), sys.prefix, sys.base_prefix, sys.exec_prefix,
             os.environ.get("SPECDECODE_CACHE", "~/.cache/specdecode"), os.environ.get("XDG_CACHE_HOME", "~/.cache"),
             *sysconfig.get_paths().values(), *(p for p in sys.path if p)]
    return sorted({_real(r) for r in roots})


FORBIDDEN = _forbidden_roots()
ALLOWED = _allowed_roots()
HOME = _real("~")
WATCHED_EVENTS = frozenset({"open", "os.listdir", "os.scandir"})
outside_reads: list[str] = []  # every refused path, in order: a test fails if any was added while it ran


class ReadOutsideCheckout(RuntimeError):
    """Not an OSError, so a caller's `except OSError` fallback does not hide it (the teardown check finds it
    anyway)."""


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def refused(path: str) -> bool:
    """Under a forbidden root and not under an allowed folder inside it (the temp dir holding the checkout's
    folder, as `.ci/run`'s isolated copy does, exempts nothing there)."""
    real = _real(path)
    if _under(real, HOME) and real != HOME and os.path.relpath(real, HOME).startswith("."):
        return False  # a checkout cloned into HOME: tools' own config and caches there (~/.config/matplotlib, ...)
    for root in FORBIDDEN:
        if _under(real, root) and not any(_under(real, a) and _under(a, root) and a != root for a in ALLOWED):
            return True
    return False


def _audit(event: str, args: tuple) -> None:
    # runs for every audited event in the process (imports, compiles, ...): the event's name is checked first
    if event not in WATCHED_EVENTS or not args or not isinstance(args[0], str | bytes | os.PathLike):
        return
    path = os.fsdecode(args[0])
    if refused(path):
        outside_reads.append(path)
        raise ReadOutsideCheckout(f"a test read {path}, outside the checkout ({CHECKOUT}): the tests must need "
                                  "nothing beside the repository (ship what they need under tests/ or the package)")


sys.addaudithook(_audit)  # audit hooks cannot be removed: it watches the whole session, collection included


@pytest.fixture(autouse=True)
def _nothing_read_outside_the_checkout() -> Iterator[None]:
    """Fails a test that read beside the checkout even where its code caught the exception the hook raised."""
    seen = len(outside_reads)
    yield
    if len(outside_reads) > seen:
        pytest.fail(f"read outside the checkout: {sorted(set(outside_reads[seen:]))}", pytrace=False)


@pytest.fixture(params=["", "portable"], ids=["native", "portable"])
def lib(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """The native kernels built for this CPU, then as plain C (what a CPU without AVX2 runs). A build that fails
    where a C compiler exists fails the test: a skip would hide a kernel source that no longer compiles."""
    from specdecode import kernels

    monkeypatch.setenv("SPECDECODE_NATIVE", request.param or "1")
    kernels.reset()
    try:
        found = kernels.native()
        if found is None:
            if kernels._compiler() is None:  # noqa: SLF001 - the build's own compiler lookup
                pytest.skip("no C compiler here")
            pytest.fail("the native kernels did not build here: the warning 'native quantized kernels unavailable' "
                        "says why")
        if kernels.simd() == "scalar" and request.param != "portable":
            pytest.skip("this CPU lacks AVX2: the portable build only")
        yield found
    finally:
        kernels.reset()


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tiny models are dominated by per-op overhead; extra intra-op threads only add contention.

    One thread makes the tiny-model suite several times faster on a small CPU (and steadier when other
    processes share it). Tests that load the real model keep torch's default.
    """
    if request.node.get_closest_marker("real_model"):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _denormals_kept() -> Iterator[None]:
    """`specdecode train` flushes denormal floats to zero for the rest of its process (training/common.py); a test
    that runs it in-process must not leave that behind: hypothesis (the server's fuzz tests) refuses to generate
    floats on a thread that flushes, and float64 reference checks would lose their smallest values."""
    yield
    torch.set_flush_denormal(False)


@pytest.fixture(autouse=True)
def _ctrl_c_raises() -> None:
    """Every test starts with Python's own Ctrl-C (KeyboardInterrupt): the CLI's Ctrl-C tests found it replaced in a
    pytest-xdist worker by something an earlier file in the same worker ran (ignored, so the subprocesses it
    started inherited the ignoring too). A warning names the test that found it so."""
    handler = signal.getsignal(signal.SIGINT)
    if handler is not signal.default_int_handler:
        warnings.warn(f"SIGINT's handler was {handler!r} when this test began; restored to KeyboardInterrupt",
                      stacklevel=1)
        signal.signal(signal.SIGINT, signal.default_int_handler)
