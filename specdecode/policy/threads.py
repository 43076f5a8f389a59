"""How many threads a forward runs on: one per core that other processes leave free.

A decode step on the CPU is hundreds of parallel loops, each ending at a barrier. When another process takes one
of the cores, the thread sharing that core is descheduled for whole time slices and every barrier waits for it,
so two threads beside a busy process run slower than one (benchmarks/results/comment-timings.md). A laptop or a
shared server is such a machine. So
every REFRESH seconds the engine reads how busy this process's cores were (/proc/stat: all processes, less this
process's own CPU time) and runs on the cores left free, between 1 and the threads it started with.

Only where a forward's numbers do not depend on the thread count: the native kernels share out whole outputs,
each computed by one thread with the same instructions whatever the count (tested), so the choice changes speed,
never a token. Elsewhere (another device, PyTorch's own kernels) the count stays as set.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..models import Transformer

log = logging.getLogger("specdecode")

REFRESH = 0.1  # seconds between readings of /proc/stat: another process's busy stretch lasts seconds, a step far less
STAT = Path("/proc/stat")
# /proc/stat's per-CPU fields: user nice system idle iowait irq softirq steal (guest time is inside user); a
# hypervisor's steal is a neighbour's use of the core too
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


def adaptive() -> bool:
    """Whether the engine may change its thread count (SPECDECODE_ADAPTIVE_THREADS=0 keeps the count set)."""
    return os.environ.get("SPECDECODE_ADAPTIVE_THREADS", "1") != "0"


def may_change(model: Transformer) -> bool:
    """Whether the forwards of this model may run on fewer threads than now: the governor acts, the kernels do not
    depend on the count, and there are threads to drop."""
    return adaptive() and model.native_kernels and torch.get_num_threads() > 1


def usable_cores() -> list[int]:
    """The CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def busy_seconds(cores: list[int], stat: Path = STAT) -> float:
    """CPU seconds all processes have spent on these cores since boot."""
    wanted, total = {f"cpu{c}" for c in cores}, 0
    for line in stat.read_text().splitlines():
        name, *values = line.split()
        if name in wanted:
            total += sum(int(values[i]) for i in BUSY_FIELDS if i < len(values))
    return total / os.sysconf("SC_CLK_TCK")


def threads_for(others: float, cores: int, most: int) -> int:
    """Threads to run on when other processes keep `others` of `cores` busy (on average): the cores they leave,
    rounded (a core busy a third of the time still runs a thread better than not), between 1 and `most`."""
    return max(1, min(most, round(cores - others)))


class ThreadGovernor:
    """Runs the forwards on the cores other processes leave free (see the module docstring): `update()` before
    each forward; a reading every REFRESH seconds, the thread count changed only when the answer changes."""

    def __init__(self, most: int | None = None, stat: Path = STAT) -> None:
        self.most = most or torch.get_num_threads()
        self.cores, self.stat = usable_cores(), stat
        self.threads = self.most
        self.others = 0.0  # cores other processes kept busy over the last reading
        self.enabled = adaptive()
        self._last: tuple[float, float, float] | None = None  # (wall, busy, own CPU) at the last reading
        if self.enabled:
            try:
                self._last = self._reading()
            except (OSError, ValueError) as e:
                self.enabled = False
                log.info("cannot read how busy the cores are (%s): forwards run on the threads set whatever other "
                         "processes do", e)

    def _reading(self) -> tuple[float, float, float]:
        return time.perf_counter(), busy_seconds(self.cores, self.stat), time.process_time()

    def update(self) -> int:
        """The thread count for the next forward (set in torch and OpenMP when it changes)."""
        if not self.enabled or self._last is None:
            return self.threads
        if torch.get_num_threads() != self.threads:  # set by someone else since (e.g. a caller's torch.set_num_threads)
            self.most = self.threads = torch.get_num_threads()
        now = time.perf_counter()
        if self.most == 1 or now - self._last[0] < REFRESH:
            return self.threads
        try:
            reading = self._reading()
        except (OSError, ValueError):
            return self.threads
        (wall0, busy0, own0), (wall1, busy1, own1) = self._last, reading
        self._last = reading
        self.others = max(0.0, (busy1 - busy0) - (own1 - own0)) / (wall1 - wall0)
        wanted = threads_for(self.others, len(self.cores), self.most)
        if wanted != self.threads:
            log.info("other processes keep %.1f of %d cores busy: forwards run on %d threads (were %d)",
                     self.others, len(self.cores), wanted, self.threads)
            self.threads = wanted
            torch.set_num_threads(wanted)
        return self.threads


_governor: ThreadGovernor | None = None


def governor() -> ThreadGovernor:
    """The process's one governor (torch's thread count is the process's), made at first use."""
    global _governor
    if _governor is None:
        _governor = ThreadGovernor()
    return _governor
