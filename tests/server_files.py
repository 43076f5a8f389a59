"""Files a test server starts from: a tiny checkpoint with a real BPE tokenizer (context raised to 1024, so long
requests exist) and, saved where a server looks for them, flat made-up forward costs for one torch thread
(timing forwards is not what server tests are about)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import specdecode
from specdecode.policy.batch_cost import BatchCost
from specdecode.policy.cost import TABLE_VERSION, CostModel

from .helpers import make_tokenizer, write_checkpoint

CONTEXT = 1024


def server_files(root: Path, max_batches: tuple[int, ...] = (16,)) -> tuple[Path, Path, specdecode.LLM]:
    """(checkpoint, cache dir for SPECDECODE_CACHE, the checkpoint loaded in float64)."""
    checkpoint = write_checkpoint(root / "ckpt", make_tokenizer())
    config = json.loads((checkpoint / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (checkpoint / "config.json").write_text(json.dumps(config))
    cache = root / "cache"
    llm = specdecode.load(checkpoint, dtype="float64")
    sizes = [1, 2, 4, 8, 16]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the cost files' names carry the thread count: the servers run one thread
    try:
        single = CostModel(sizes, [64, 512], [[1e-3 * (1 + 0.01 * n) for n in sizes]] * 2, version=TABLE_VERSION)
        CostModel.save(llm.model, single, cache)
        for max_batch in max_batches:
            batch_sizes = BatchCost.sizes_up_to(max_batch)
            tables = [CostModel(sizes, [64, 512], [[1e-3 * (1 + 0.01 * b * n) for n in sizes]] * 2)
                      for b in batch_sizes]
            BatchCost(batch_sizes, tables).save(BatchCost.path(llm.model, max_batch, cache))
    finally:
        torch.set_num_threads(threads)
    return checkpoint, cache, llm
