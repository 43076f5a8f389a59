"""The paged KV cache (models/paged.py, engine/blocks.py): a pool of fixed-size blocks under a memory budget, a block
table per request; requests wait for blocks in turn, the youngest is preempted and prefilled anew when blocks run out,
rejected guesses' blocks go back, common prefixes share blocks (copy on write). Every request's output equals what it
gets alone (greedy, float64 tiny models)."""

from __future__ import annotations

import pytest
import torch

from specdecode.core.tree import DraftTree
from specdecode.engine.loop import Engine
from specdecode.engine.prefix_cache import PrefixCache
from specdecode.models.paged import BlockPool, PagedKVCache

from .helpers import noisy_copy, tiny_model
from .test_server_batch import alone, batch_inputs, flat_cost, make_row, single_logits

BLOCK = 8


def budget(model, blocks: int) -> int:
    cfg = model.config
    return blocks * BlockPool.bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK, model.kv_dtype)


def paged_engine(model, blocks: int, share: bool = False) -> Engine:
    return Engine(model, flat_cost(), PrefixCache() if share else None, kv_memory=budget(model, blocks),
                  block_size=BLOCK)


def run_in_turn(engine: Engine, rows: list, check=None) -> tuple[dict[int, list[int]], list[int]]:
    """Admit each row when the engine admits it (in turn), step until all are done; returns their outputs and, per
    step, how many rows waited to be admitted."""
    out: dict[int, list[int]] = {}
    waiting, waited = list(rows), []
    while waiting or engine.rows or engine.paging.preempted:
        while waiting and engine.admits(waiting[0]):
            engine.add(waiting.pop(0))
        waited.append(len(waiting))
        for row, new in engine.step():
            assert not isinstance(new, Exception), new
            if row.finish_reason:
                engine.remove(row)
                out[id(row)] = row.new_tokens
        if check is not None:
            check(engine)
        assert len(waited) < 3000
    return out, waited


def blocks_match_lengths(engine: Engine) -> None:
    """Every row holds exactly the blocks its length needs (rejected guesses' blocks went back), and the pool's
    count of blocks in use is what the rows hold."""
    cache = engine.cache
    for i in range(len(engine.rows)):
        assert len(cache.tables[i]) == cache.blocks_for(cache.lengths[i])
    held = {b for i in range(len(engine.rows) + (engine.pending is not None)) for b in cache.tables[i]}
    assert cache.pool.used == len(held)


@pytest.mark.parametrize("share", [False, True], ids=["private", "shared-prefixes"])
def test_concurrent_requests_under_a_small_budget_equal_each_alone(share):
    """Six requests (plain, prompt lookup, a draft model) under a pool of 14 blocks of 8 tokens: some wait to be
    admitted, some are preempted and prefilled anew, each decodes exactly what it decodes alone, and every block
    comes back."""
    model = tiny_model(5, vocab_size=24)
    draft = noisy_copy(model, 1)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 24, (n,), generator=g).tolist() for n in (3, 17, 1, 9, 30, 6)]
    prompts[5] = prompts[4][:20] + prompts[5]  # shares two full blocks with prompt 4
    engine = paged_engine(model, 14, share)
    specs = [("none", 0), ("lookup", 4), ("lookup", 2), ("draft", 3), ("lookup", 3), ("none", 0)]
    rows = [make_row(model, p, m, k, draft=draft, max_new=30 + 3 * i)
            for i, (p, (m, k)) in enumerate(zip(prompts, specs, strict=True))]
    out, waited = run_in_turn(engine, rows, blocks_match_lengths)
    for i, row in enumerate(rows):
        assert out[id(row)] == alone(model, prompts[i], 30 + 3 * i), i
    assert max(waited) > 0  # admission waited for blocks
    assert engine.paging.preemptions > 0  # and running rows gave theirs back
    assert sum(r.stats.accepted for r in rows) > 0
    assert engine.cache.pool.available == engine.cache.pool.num_blocks  # every block is free or kept, unused


def test_preempted_request_is_prefilled_anew_with_output_unchanged():
    """Two long-running requests outgrow a pool that holds both prompts: the younger is preempted, waits, comes
    back with its committed tokens prefilled anew, and both decode what they decode alone."""
    model = tiny_model(3, vocab_size=24)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    engine = paged_engine(model, 8)
    rows = [make_row(model, p, "lookup", 3, max_new=40) for p in prompts]
    for row in rows:
        assert engine.admits(row)
        engine.add(row)
    out, _ = run_in_turn(engine, [])
    assert engine.paging.preemptions >= 1
    for prompt, row in zip(prompts, rows, strict=True):
        assert row.new_tokens == alone(model, prompt, 40)


def test_admission_waits_for_blocks_and_preempted_requests_come_first():
    model = tiny_model(3, vocab_size=24)
    engine = paged_engine(model, 6)
    first = make_row(model, list(range(20)), "none", 0, max_new=20)  # 3 blocks, 5 once done
    second = make_row(model, list(range(1, 21)), "none", 0, max_new=5)
    assert engine.admits(first)
    engine.add(first)
    assert not engine.admits(second)  # 3 blocks + 1 spare for the running row > 3 free
    engine.paging.preempted.append(make_row(model, [1, 2], "none", 0, max_new=2))
    assert not engine.admits(make_row(model, [3], "none", 0, max_new=2))  # a preempted request waits before it
    engine.paging.preempted.clear()
    while first.finish_reason is None:
        engine.step()
    engine.remove(first)
    assert engine.admits(second)


def test_rejected_guesses_give_their_blocks_back():
    """A draft model's guesses are written into blocks; after each step the row holds only the blocks of its
    accepted tokens, and the pool counts them."""
    model = tiny_model(5, vocab_size=24)
    engine = paged_engine(model, 40)
    row = make_row(model, [1, 2, 3], "draft", 6, draft=noisy_copy(model, 7, noise=0.3), max_new=60)
    engine.add(row)
    rejected = 0
    while row.finish_reason is None:
        before = row.stats.drafted - row.stats.accepted
        engine.step()
        rejected += row.stats.drafted - row.stats.accepted > before
        blocks_match_lengths(engine)
    assert rejected > 0
    engine.remove(row)
    assert engine.cache.pool.available == 40
    assert row.new_tokens == alone(model, [1, 2, 3], 60)


def test_common_prefixes_share_blocks_by_reference():
    """A second request beginning with the first's 24 tokens takes its three full blocks (reference counts 2), and
    a conversation's next turn finds its history's blocks kept after the first turn left."""
    model = tiny_model(4, vocab_size=24)
    engine = paged_engine(model, 30, share=True)
    system = [(7 * i) % 24 for i in range(24)]
    first = make_row(model, system + [1, 2, 3], "none", 0, max_new=20)
    second = make_row(model, system + [4, 5], "none", 0, max_new=20)
    engine.add(first)
    engine.add(second)
    shared = engine.cache.tables[0][:3]
    assert engine.cache.tables[1][:3] == shared and all(engine.cache.pool.refs[b] == 2 for b in shared)
    assert second.stats.cached_tokens == 24
    out, _ = run_in_turn(engine, [])
    assert first.new_tokens == alone(model, system + [1, 2, 3], 20)
    assert second.new_tokens == alone(model, system + [4, 5], 20)
    turn = first.tokens + [9, 9, 1]  # the next turn: the whole history, then the new message
    again = make_row(model, turn, "none", 0, max_new=10)
    engine.add(again)
    assert again.stats.cached_tokens == (len(first.tokens) - 1) // BLOCK * BLOCK >= 40
    run_in_turn(engine, [])
    assert again.new_tokens == alone(model, turn, 10)


def test_copy_on_write_leaves_the_other_request_unchanged():
    """A sibling choice shares its prompt's blocks, the partly filled last one included; each one's writes copy
    that block first, so both decode what they decode alone (sampling: the same seed draws the same tokens)."""
    model = tiny_model(5, vocab_size=24)
    engine = paged_engine(model, 20)
    prompt = list(range(11))  # 10 cached positions: a full block and 2 of the next
    first = make_row(model, prompt, "lookup", 3, max_new=30, temperature=0.8, seed=1)
    sibling = make_row(model, prompt, "lookup", 3, max_new=30, temperature=0.8, seed=2)
    engine.add(first)
    engine.start(sibling, like=first)
    assert engine.pending is None and engine.cache.tables[1] == engine.cache.tables[0]
    partial = engine.cache.tables[0][1]
    assert engine.cache.pool.refs[partial] == 2
    engine.step()
    assert engine.cache.tables[0][1] != engine.cache.tables[1][1]  # the partial block was copied on write
    assert engine.cache.tables[0][0] == engine.cache.tables[1][0]  # the full one still shared
    run_in_turn(engine, [])
    for row, seed in ((first, 1), (sibling, 2)):
        from specdecode.proposers import PromptLookupProposer

        assert row.new_tokens == alone(model, prompt, 30, 0.8, seed=seed, proposer=PromptLookupProposer(), k=3)


def test_copy_on_write_unit():
    pool = BlockPool(1, 1, 2, block_size=8, num_blocks=4, dtype=torch.float64)
    cache = PagedKVCache(pool)
    cache.grow(0, 12)
    cache.lengths[0] = 12
    pool.kv[:, :, cache.tables[0][1]] = 3.0
    cache.share(0, 1, 12)
    assert pool.refs[cache.tables[0][1]] == 2 and pool.available == 2
    cache.writable(1, 12, 13)
    assert cache.tables[1][0] == cache.tables[0][0] and cache.tables[1][1] != cache.tables[0][1]
    assert bool((pool.kv[:, :, cache.tables[1][1]] == 3.0).all())  # the copy holds what the shared block held
    pool.kv[:, :, cache.tables[1][1]] = 4.0
    assert bool((pool.kv[:, :, cache.tables[0][1]] == 3.0).all())  # the other row's block is untouched
    cache.free_row(1)
    cache.free_row(0)
    assert pool.available == 4 and pool.refs == [0] * 5


def test_a_budget_too_small_for_one_request_is_a_clear_error():
    model = tiny_model(3, vocab_size=24)
    engine = paged_engine(model, 4)  # 32 tokens
    row = make_row(model, [i % 24 for i in range(32)], "none", 0, max_new=20)
    assert engine.admits(row)  # admitted, to be refused at once rather than wait forever
    with pytest.raises(ValueError, match=r"KV cache budget holds 32 tokens .* need 5 blocks: raise --kv-cache-memory"):
        engine.add(row)
    assert not engine.rows and engine.pending is None and engine.cache.pool.available == 4
    with pytest.raises(ValueError, match="holds no block"):
        Engine(model, flat_cost(), kv_memory=10, block_size=BLOCK)
    with pytest.raises(ValueError, match="power of two"):
        BlockPool(1, 1, 2, block_size=12, num_blocks=4)


def test_trees_are_verified_through_the_block_table():
    """A ragged batch of trees and chains over rows whose blocks lie scattered in the pool computes each row's
    logits as the row alone; keeping an accepted tree path moves its entries through the table."""
    model = tiny_model(3)
    g = torch.Generator().manual_seed(0)
    prefixes = [torch.randint(0, 56, (n,), generator=g).tolist() for n in (5, 11, 0, 17)]
    trees = [DraftTree.chain(7, [3, 9, 4]), DraftTree([1, 2, 3, 4, 5, 6], [-1, 0, 0, 1, 1, 2]),
             DraftTree.root_only(8), DraftTree.chain(2, [5])]
    pool = BlockPool(2, 2, 16, block_size=8, num_blocks=24, dtype=torch.float64)
    cache = PagedKVCache(pool)
    for b in (3, 1, 0, 2):  # rows take blocks in another order than their index: tables are not contiguous
        cache.grow(b, len(prefixes[b]) + len(trees[b]))
    for b, prefix in enumerate(prefixes):
        if prefix:
            model.forward(torch.tensor([prefix]), cache.row(b), logits_at=None)
    tokens, positions, masks, sizes = batch_inputs(trees, [len(p) for p in prefixes])
    out = model.forward_batch(tokens, cache, positions=positions, sizes=sizes, tree_masks=masks)
    for b, (prefix, tree) in enumerate(zip(prefixes, trees, strict=True)):
        torch.testing.assert_close(out.logits[b], single_logits(model, prefix, tree), rtol=1e-10, atol=1e-10)
    paths = [[0, 1, 2], [0, 2, 5], [0], [0, 1]]
    for b, path in enumerate(paths):
        cache.keep(b, len(prefixes[b]), path)
    kept = [p + [trees[b].tokens[i] for i in path] for b, (p, path) in enumerate(zip(prefixes, paths, strict=True))]
    second = [DraftTree.chain(4, [1, 1]), DraftTree.root_only(3), DraftTree.chain(6, [2, 8, 8, 1]),
              DraftTree.root_only(0)]
    for b in range(4):
        cache.grow(b, len(kept[b]) + len(second[b]))
    tokens, positions, masks, sizes = batch_inputs(second, [len(k) for k in kept])
    out = model.forward_batch(tokens, cache, positions=positions, sizes=sizes, tree_masks=masks)
    for b in range(4):
        torch.testing.assert_close(out.logits[b], single_logits(model, kept[b], second[b]), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kv", ["float16", "float32", "int8"])
def test_native_blocks_read_through_the_block_table_bit_for_bit(lib, kv):
    """A float32 model's batch in the native kernel over a paged cache (blocks scattered, rows preempted and prefilled
    anew) decodes exactly what the contiguous cache decodes, and the kernel did read through the tables."""
    from specdecode.models import native

    model = tiny_model(5, vocab_size=24, dtype=torch.float32)
    model.kv_cache_dtype = kv
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 24, (n,), generator=g).tolist() for n in (3, 17, 1, 9, 30, 6)]

    def run(engine: Engine) -> list[list[int]]:
        rows = [make_row(model, p, "lookup", 3, max_new=40) for p in prompts]
        run_in_turn(engine, rows) if engine.paging else run_contiguous(engine, rows)
        return [row.new_tokens for row in rows]

    def run_contiguous(engine: Engine, rows: list) -> None:
        for row in rows:
            engine.add(row)
        while engine.rows:
            for row, new in engine.step():
                assert not isinstance(new, Exception), new
                if row.finish_reason:
                    engine.remove(row)

    expected = run(Engine(model, flat_cost()))
    paged = paged_engine(model, 16)
    tables = []
    original = native.NativeBlocks.run
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native.NativeBlocks, "run", lambda self, lib, x, kv, spans, *a, **k:
                   tables.append(all(s.table is not None for s in spans)) or original(self, lib, x, kv, spans, *a, **k))
        assert run(paged) == expected
    assert tables and all(tables) and paged.paging.preemptions > 0


def test_the_scheduler_admits_in_turn_under_the_budget():
    """The server's scheduler over a paged engine: eight requests submitted at once under a pool that holds about
    two; each starts when its blocks are free, none fails, each decodes what it decodes alone."""
    import asyncio

    from specdecode.server.metrics import Metrics
    from specdecode.server.scheduler import Job, Scheduler

    model = tiny_model(5, vocab_size=24)
    engine = paged_engine(model, 12)
    scheduler = Scheduler(engine, max_batch=8, max_queue=8, metrics=Metrics("tiny", 256))
    loop = asyncio.new_event_loop()
    tokenizer = type("T", (), {"decode": lambda self, ids, **k: "x" * len(ids)})()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 24, (n,), generator=g).tolist() for n in (20, 9, 30, 14, 25, 3, 17, 11)]
    jobs = [Job(make_row(model, p, "lookup" if i % 2 else "none", 3 if i % 2 else 0, max_new=20), tokenizer, [], loop)
            for i, p in enumerate(prompts)]
    try:
        scheduler.submit_all(jobs)
        most, turns = 0, 0
        while scheduler.waiting or scheduler.active or scheduler.prefilling is not None:
            scheduler._prefill()
            if scheduler.active:
                scheduler._step()
            most = max(most, len(scheduler.active))
            turns += 1
            assert turns < 2000
    finally:
        loop.close()
    assert all(job.done and job.row.finish_reason == "length" for job in jobs)
    assert 1 < most < len(jobs)  # several ran at once, never all: the rest waited for blocks
    for prompt, job in zip(prompts, jobs, strict=True):
        assert job.row.new_tokens == alone(model, prompt, 20)
    assert engine.cache.pool.available == engine.cache.pool.num_blocks


def test_the_server_refuses_a_prompt_the_budget_cannot_hold(tmp_path):
    """--kv-cache-memory too small for a prompt: a 400 that names the budget (never a request left waiting); a
    prompt that fits is answered."""
    from fastapi.testclient import TestClient

    import specdecode

    from .test_server_isolation import app_for, make_tokenizer, write_checkpoint

    llm = specdecode.load(write_checkpoint(tmp_path / "ckpt", make_tokenizer()), dtype="float64")
    cfg = llm.model.config
    block = BlockPool.bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, llm.model.kv_dtype)
    with TestClient(app_for(llm, kv_cache_memory=3 * block)) as client:  # 48 tokens
        long = "the cat sat on the mat"
        while len(llm.encode(long)) <= 48:
            long += " and the dog"
        assert len(llm.encode(long)) + 2 <= cfg.max_position_embeddings  # within the context: the budget refuses it
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": long, "max_tokens": 2})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "kv_cache_exceeded" and "raise --kv-cache-memory" in error["message"]
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "the cat", "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_kv_cache_memory_sizes():
    import argparse

    from specdecode.server.cli import memory_size

    assert memory_size("2GiB") == 2 << 30 and memory_size("512MiB") == 512 << 20 and memory_size("1.5G") == 3 << 29
    assert memory_size("3000000") == 3_000_000 and memory_size("1GB") == 10**9
    for bad in ("", "12 parsecs", "-1GiB", "0"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a size such as 4GiB"):
            memory_size(bad)
