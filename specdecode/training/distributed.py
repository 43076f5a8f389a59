"""Data-parallel training on an existing engine: `--nproc N` relaunches the command under torchrun, and the
N workers train one model in PyTorch DDP (gloo on CPUs, nccl on GPUs), each on its own shard of the samples.

Every worker answers its shard of the prompts and extracts the features of its shard of the training samples
(a sharded feature cache); the held-out set is every worker's, so all score the same data. The main worker
alone writes the log, checkpoints, the draft and the report; the others follow its decisions (when to stop).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence, Sized
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

T = TypeVar("T")


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def launched() -> bool:
    """True inside a torchrun worker."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(nproc: int, argv: Sequence[str]) -> int:
    """`specdecode ARGV` in `nproc` torchrun workers on this machine; their exit code. Each worker gets an equal
    share of the cores (torchrun's default would be one thread each)."""
    threads = max(1, (os.cpu_count() or 1) // nproc)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "specdecode.cli", *without_nproc(argv)]
    return subprocess.call(cmd, env=env)


def without_nproc(argv: Sequence[str]) -> list[str]:
    """argv less `--nproc N`: a worker knows it is one from torchrun's environment (and torchrun's own parser
    would take `--nproc` for its `--nproc-per-node`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def init(device: str) -> tuple[World, str]:
    """Join the process group torchrun set up (nothing outside torchrun): (this worker's world, its device)."""
    if not launched():
        return World(), device
    local = int(os.environ["LOCAL_RANK"])
    if device.startswith("cuda"):
        device = f"cuda:{local}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return world(), device


def finish() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def world() -> World:
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    return World()


def shard(items: Sequence[T]) -> list[T]:
    """This worker's share: items rank, rank + size, ..."""
    w = world()
    return list(items[w.rank :: w.size])


def unshard(parts: Sequence[Sequence[T]]) -> list[T]:
    """The inverse of `shard` over every worker's part (in rank order): items back in their first order."""
    out: list[T] = []
    for i in range(max((len(p) for p in parts), default=0)):
        out.extend(p[i] for p in parts if i < len(p))
    return out


def barrier() -> None:
    if world().size > 1:
        dist.barrier()


def collective_device() -> str:
    """Where the process group's tensors must be: nccl reduces on this worker's GPU, gloo on the CPU."""
    return f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"


def from_main(value: int) -> int:
    """The main worker's `value`, on every worker (so all take the same decision)."""
    if world().size == 1:
        return value
    t = torch.tensor([value], dtype=torch.long, device=collective_device())
    dist.broadcast(t, 0)
    return int(t.item())


def summed(counts: torch.Tensor) -> torch.Tensor:
    """`counts` summed over every worker (each counted its own shard): statistics of the whole data."""
    if world().size == 1:
        return counts
    total = counts.to(collective_device())
    dist.all_reduce(total)
    return total.to(counts.device)


def samples_trained_on(store: Sized) -> int:
    """Training samples over every worker (each holds its shard): for the report."""
    return int(summed(torch.tensor([len(store)]))[0])


def local_batch(batch_size: int) -> int:
    """Sequences per step on each worker: the global batch split between them."""
    size = world().size
    if batch_size % size:
        raise ValueError(f"--batch-size {batch_size} does not split between {size} processes: use a multiple")
    return batch_size // size


class LossModule(nn.Module):
    """module + its loss as one forward, which DDP wraps (its gradient hooks are armed in forward)."""

    def __init__(self, module: nn.Module, loss_fn) -> None:
        super().__init__()
        self.module, self.loss_fn = module, loss_fn

    def forward(self, batch: dict):
        return self.loss_fn(self.module, batch)


def data_parallel(module: nn.Module, loss_fn):
    """loss_fn(module, batch), under DDP when there are several workers (gradients averaged between them)."""
    if world().size == 1:
        return lambda batch: loss_fn(module, batch)
    device = next(module.parameters()).device
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(LossModule(module, loss_fn), device_ids=ids)
