"""The ragged batched forward and the batched decoder under the server: every row of a batch gets exactly
what it would get alone (float64 tiny models), and speculation backs off as the batch grows."""

from __future__ import annotations

import pytest
import torch

from specdecode.core.tree import DraftTree
from specdecode.models import BatchKVCache

from .helpers import FrozenCost, tiny_model


def single_logits(model, prefix: list[int], tree: DraftTree) -> torch.Tensor:
    cache = model.new_cache(64)
    if prefix:
        model.forward(torch.tensor([prefix]), cache, logits_at=None)
    tokens, positions, mask = tree.forward_inputs(len(prefix))
    return model.forward(torch.tensor([tokens]), cache, positions=positions, tree_mask=mask).logits[0]


def batch_inputs(trees: list[DraftTree], starts: list[int]):
    inputs = [tree.forward_inputs(start) for tree, start in zip(trees, starts, strict=True)]
    n = max(len(t) for t, _, _ in inputs)
    tokens = torch.zeros(len(trees), n, dtype=torch.long)
    positions = torch.zeros(len(trees), n, dtype=torch.long)
    masks = torch.zeros(len(trees), n, n, dtype=torch.bool)
    for b, (toks, pos, mask) in enumerate(inputs):
        m = len(toks)
        tokens[b, :m] = torch.tensor(toks)
        positions[b, :m] = pos
        positions[b, m:] = starts[b] + torch.arange(m, n)
        masks[b, :m, :m] = torch.ones(m, m, dtype=torch.bool).tril() if mask is None else mask
    return tokens, positions, masks, [len(t) for t, _, _ in inputs]


@pytest.mark.parametrize("window", [None, 6])
def test_ragged_batched_forward_equals_each_row_alone(window):
    model = tiny_model(3, sliding_window=window)
    g = torch.Generator().manual_seed(0)
    prefixes = [torch.randint(0, 56, (n,), generator=g).tolist() for n in (5, 11, 0, 1)]
    trees = [
        DraftTree.chain(7, [3, 9, 4]),
        DraftTree([1, 2, 3, 4, 5, 6], [-1, 0, 0, 1, 1, 2]),  # a tree: branches need the tree mask
        DraftTree.root_only(8),
        DraftTree.chain(2, [5]),
    ]
    cache = BatchKVCache(2, 2, 16, 4, batch_size=1, dtype=torch.float64)  # grows on demand
    for b, prefix in enumerate(prefixes):
        single = model.new_cache(32)
        if prefix:
            model.forward(torch.tensor([prefix]), single, logits_at=None)
        cache.load(b, single)
    tokens, positions, masks, sizes = batch_inputs(trees, [len(p) for p in prefixes])
    out = model.forward_batch(tokens, cache, positions=positions, sizes=sizes, tree_masks=masks)
    for b, (prefix, tree) in enumerate(zip(prefixes, trees, strict=True)):
        expected = single_logits(model, prefix, tree)
        assert out.logits[b].shape == expected.shape
        torch.testing.assert_close(out.logits[b], expected, rtol=1e-10, atol=1e-10)
        assert cache.lengths[b] == len(prefix) + len(tree)

    # keep an accepted path per row, then a second ragged step sees exactly the kept entries
    paths = [[0, 1, 2], [0, 2], [0], [0, 1]]
    for b, path in enumerate(paths):
        cache.keep(b, len(prefixes[b]), path)
    kept = [p + [trees[b].tokens[i] for i in path] for b, (p, path) in enumerate(zip(prefixes, paths, strict=True))]
    second = [DraftTree.chain(4, [1, 1]), DraftTree.root_only(3), DraftTree.chain(6, [2, 8, 8, 1]),
              DraftTree.root_only(0)]
    cache.move(3, 3)
    tokens, positions, masks, sizes = batch_inputs(second, [len(k) for k in kept])
    out = model.forward_batch(tokens, cache, positions=positions, sizes=sizes, tree_masks=masks)
    for b in range(4):
        torch.testing.assert_close(out.logits[b], single_logits(model, kept[b], second[b]), rtol=1e-10, atol=1e-10)


def test_batch_cache_move_packs_rows():
    cache = BatchKVCache(1, 1, 2, 4, batch_size=3, dtype=torch.float64)
    cache.kv[:, :, 2, :, :3] = 5.0
    cache.lengths = [1, 2, 3]
    cache.move(2, 0)
    assert cache.lengths == [3, 2, 0] and bool((cache.kv[:, :, 0, :, :3] == 5.0).all())
    cache.reserve(5, 10)
    assert cache.batch_size == 5 and cache.max_len >= 10 and cache.lengths == [3, 2, 0, 0, 0]
    assert bool((cache.kv[:, :, 0, :, :3] == 5.0).all())


# ---------------------------------------------------------------------------------- the batched decoder
from specdecode.core.acceptance import AcceptanceStats  # noqa: E402
from specdecode.core.sampling import SamplingParams  # noqa: E402
from specdecode.engine.loop import Engine, generate_ids  # noqa: E402
from specdecode.engine.request import Request  # noqa: E402
from specdecode.policy.batch_cost import BatchCost  # noqa: E402
from specdecode.policy.cost import CostModel  # noqa: E402
from specdecode.policy.speculation import AdaptiveK, FixedK  # noqa: E402
from specdecode.proposers import DraftModelProposer, NoProposer, PromptLookupProposer  # noqa: E402

from .helpers import noisy_copy  # noqa: E402
from .test_gemma import NATIVE_FAMILIES, native_tiny  # noqa: E402


def flat_cost(per_token: float = 0.0) -> BatchCost:
    """A made-up cost: 1 s per forward plus `per_token` s per token in it (rows x tokens per row)."""
    sizes = [1, 2, 4, 8, 16]
    tables = [FrozenCost(sizes, [8, 64], [[1 + per_token * b * n for n in sizes]] * 2) for b in (1, 4, 16)]
    return BatchCost([1, 4, 16], tables)


def make_row(model, prompt, method, k, max_new=40, temperature=0.0, seed=None, cost=None, draft=None):
    proposer = {"none": NoProposer, "lookup": PromptLookupProposer}.get(method)
    proposer = proposer() if proposer else DraftModelProposer(draft, model.config.vocab_size)
    policy = k if not isinstance(k, int) else FixedK(k)
    return Request(model.config.max_position_embeddings, proposer, prompt, max_new_tokens=max_new,
                   params=SamplingParams(temperature=temperature), k=policy, seed=seed)


def alone(model, prompt, max_new=40, temperature=0.0, seed=None, proposer=None, k=0):
    return generate_ids(model, prompt, max_new_tokens=max_new, params=SamplingParams(temperature=temperature),
                        k=k, seed=seed, proposer=proposer)[0]


def run_all(decoder, pending: list[tuple[int, Request]]) -> dict[int, list[int]]:
    """Step until every row is done; pending rows join at the given step number."""
    out: dict[int, list[int]] = {}
    step = 0
    while pending or decoder.rows:
        for when, row in [p for p in pending if p[0] <= step]:
            decoder.add(row)
            pending.remove((when, row))
        for row, new in decoder.step():
            assert not isinstance(new, Exception), new
            if row.finish_reason:
                decoder.remove(row)
                out[id(row)] = row.new_tokens
        step += 1
    return out


def test_batched_decoding_equals_each_request_alone():
    """Rows of different lengths and methods (plain, lookup fixed and adaptive, a model draft) join at different
    steps and leave when done; greedy and seeded sampling give each exactly what it gets alone."""
    model = tiny_model(5, vocab_size=24)  # a small vocabulary: greedy text repeats, so lookups get accepted
    draft = noisy_copy(model, 1)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 24, (n,), generator=g).tolist() for n in (3, 17, 1, 9, 30, 6)]
    cost = flat_cost()
    decoder = Engine(model, cost)
    adaptive = lambda: AdaptiveK(decoder.view, AcceptanceStats(), cheap=True)  # noqa: E731
    specs = [("none", 0, 0.0), ("lookup", 4, 0.0), ("lookup", adaptive(), 0.0), ("draft", 3, 0.0),
             ("lookup", 3, 0.9), ("lookup", adaptive(), 0.0)]
    rows = [make_row(model, p, m, k, temperature=t, seed=i, draft=draft, max_new=30 + 3 * i)
            for i, (p, (m, k, t)) in enumerate(zip(prompts, specs, strict=True))]
    out = run_all(decoder, [(0, rows[0]), (0, rows[1]), (2, rows[2]), (2, rows[3]), (5, rows[4]), (9, rows[5])])
    for i, row in enumerate(rows):
        if specs[i][2]:  # sampling: the same seed and method alone draws the same tokens
            expected = alone(model, prompts[i], 30 + 3 * i, 0.9, seed=i, proposer=PromptLookupProposer(), k=3)
        else:  # greedy: every method gives plain decoding's tokens
            expected = alone(model, prompts[i], 30 + 3 * i)
        assert out[id(row)] == expected, i
    assert sum(r.stats.accepted for r in rows) > 0
    assert decoder.cache.lengths[0] == 0 and not decoder.rows


class Exploding(PromptLookupProposer):
    def __init__(self, after: int) -> None:
        super().__init__()
        self.calls, self.after = 0, after

    def propose(self, context):
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("proposer bug")
        return super().propose(context)


def test_a_failing_row_leaves_alone():
    model = tiny_model(5, vocab_size=24)
    decoder = Engine(model, flat_cost())
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    rows = [make_row(model, p, "lookup", 2) for p in prompts]
    rows[1].proposer = Exploding(after=3)
    for row in rows:
        decoder.add(row)
    failed, done = [], {}
    while decoder.rows:
        for row, new in decoder.step():
            if isinstance(new, Exception):
                failed.append(row)
            elif row.finish_reason:
                decoder.remove(row)
                done[id(row)] = row.new_tokens
    assert failed == [rows[1]]
    for i in (0, 2):
        assert done[id(rows[i])] == alone(model, prompts[i])


def test_speculation_backs_off_as_the_batch_grows():
    """Same acceptance, same proposals: one row verifies deep guesses when tokens are nearly free; sixteen rows,
    where a guessed token costs what it adds to the batched forward, verify none; back to one, deep again."""
    model = tiny_model(5, vocab_size=24)
    decoder = Engine(model, flat_cost(per_token=0.3))
    stats = AcceptanceStats()
    for i in range(60):  # guesses are right 50-75% of the time
        stats.record(3, *((0, 1), (1, 2), (2, 3), (3, 3))[i % 4])

    def depths(n_rows: int) -> list[int]:
        decoder.rows = [make_row(model, [1, 2, 3], "lookup", AdaptiveK(decoder.view, stats, cheap=True))
                        for _ in range(n_rows)]
        proposals = [DraftTree.from_paths(3, [[1, 2, 3, 1, 2, 3]], bucket=3)] * n_rows
        return [t.depth for t in decoder.choose(proposals, [10] * n_rows)]

    assert min(depths(1)) > 0
    assert set(depths(16)) == {0}
    assert min(depths(1)) > 0
    decoder.rows = []


def test_batch_cost_is_measured_once_and_cached(tmp_path):
    model = tiny_model(5, vocab_size=24, max_position_embeddings=64)
    cost = BatchCost.for_model(model, 3, CostModel.flat(), cache_dir=tmp_path)
    assert cost.batch_sizes == [1, 2, 3] and all(s > 0 for t in cost.tables for row in t.seconds for s in row)
    again = BatchCost.for_model(model, 3, CostModel.flat(), cache_dir=tmp_path)
    assert again.tables[2].seconds == cost.tables[2].seconds
    assert cost.seconds(3, 4, 20) > 0 and cost.seconds(5, 4, 20) > 0


def test_eagle_rows_get_the_hidden_states_they_would_get_alone():
    """A proposer that drafts from the target's hidden states (EAGLE) sees, in a batch, exactly the features it
    sees alone: its every proposal is the same, so are the outputs and the acceptance."""
    from specdecode.models.eagle import EagleConfig, EagleHead
    from specdecode.proposers import EagleProposer

    from .helpers import randomize_

    model = tiny_model(5, vocab_size=24, num_layers=4)
    head = EagleHead(EagleConfig.for_target(model.config, 24))
    randomize_(head, 3)
    head = head.double().eval().requires_grad_(False)

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 24, (n,), generator=g).tolist() for n in (4, 13, 7)]
    alone_logs, alone_out = [], []
    for p in prompts:
        proposer, log = recording(EagleProposer(head, model, topk=2, nodes=6))
        out, stats = generate_ids(model, p, proposer=proposer, k=3, max_new_tokens=30)
        alone_logs.append(log)
        alone_out.append((out, stats.drafted, stats.accepted))
    decoder = Engine(model, flat_cost())
    rows, logs = [], []
    for p in prompts:
        proposer, log = recording(EagleProposer(head, model, topk=2, nodes=6))
        rows.append(Request(model.config.max_position_embeddings, proposer, p, max_new_tokens=30,
                            params=SamplingParams(), k=FixedK(3)))
        logs.append(log)
    out = run_all(decoder, [(0, rows[0]), (1, rows[1]), (3, rows[2])])
    for i, row in enumerate(rows):
        assert logs[i] == alone_logs[i]
        assert (out[id(row)], row.stats.drafted, row.stats.accepted) == alone_out[i]
    assert sum(len(t) > 1 for log in logs for t in log) > 0


def recording(proposer):
    """The proposer, with every proposal's tokens logged."""
    log: list[list[int]] = []
    propose = proposer.propose

    def logged(*args):
        tree = propose(*args)
        log.append(list(tree.tokens))
        return tree

    proposer.propose = logged
    return proposer, log


def test_a_prompt_cached_in_chunks_between_steps_decodes_as_alone():
    """Engine.start / prefill: a long prompt is cached a few tokens at a time between the batch's steps, in the row
    after the batch's, which follows when a running row leaves; every request then decodes exactly what it
    decodes alone, and a pending prompt can be dropped."""
    model = tiny_model(5, vocab_size=24)
    g = torch.Generator().manual_seed(2)
    short, other, long = (torch.randint(0, 24, (n,), generator=g).tolist() for n in (5, 7, 60))
    decoder = Engine(model, flat_cost())
    rows = {name: make_row(model, p, "lookup", 3, max_new=m) for name, p, m in
            (("short", short, 6), ("other", other, 30), ("long", long, 20))}
    decoder.add(rows["short"])
    decoder.add(rows["other"])
    decoder.start(rows["long"])
    chunks = 0
    while decoder.pending is not None:
        assert decoder.prefill(8) <= 8
        chunks += 1
        for row, _ in decoder.step():
            if row.finish_reason:
                decoder.remove(row)  # "short" leaves mid-prefill: the pending row moves up behind the batch
    assert chunks == 8 and rows["short"].finish_reason  # 59 cached tokens, 8 a turn
    out = run_all(decoder, [])
    assert rows["short"].new_tokens == alone(model, short, 6)
    assert out[id(rows["other"])] == alone(model, other, 30) and out[id(rows["long"])] == alone(model, long, 20)
    decoder.start(make_row(model, long, "none", 0))
    decoder.prefill(8)
    decoder.cancel_pending()
    assert decoder.pending is None and not decoder.rows and decoder.cache.lengths[0] == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["own-forward", "carried-in-the-step"])
def test_the_scheduler_chunks_a_prompt_that_arrives_mid_stream(dtype):
    """While a request runs, each step caches about one decode step's worth of a new prompt (priced by the cost
    table): in the step's own forward where the native blocks run (float32 on the CPU), else in a forward of its
    own after it; with nothing running, a whole prompt of up to prefill_tokens at once. Both requests then decode
    exactly what they decode alone."""
    import asyncio

    from specdecode.server.metrics import Metrics
    from specdecode.server.scheduler import Job, Scheduler

    model = tiny_model(5, vocab_size=24, dtype=dtype)
    flat_to_8 = [[1.0, 1.0, 1.0, 1.0, 2.0]] * 2  # forwards of up to 8 tokens cost a 1-token step; 16 cost two
    engine = Engine(model, BatchCost([1, 4, 16], [FrozenCost([1, 2, 4, 8, 16], [8, 64], flat_to_8)] * 3))
    scheduler = Scheduler(engine, max_batch=4, max_queue=4, metrics=Metrics("tiny", 256))
    loop = asyncio.new_event_loop()
    tokenizer = type("T", (), {"decode": lambda self, ids, **k: "x" * len(ids)})()
    carried = []
    original = type(model).forward_batch
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(type(model), "forward_batch",
                       lambda self, *a, **k: carried.append(bool(k.get("prefill"))) or original(self, *a, **k))
            assert scheduler.prefill_budget() == scheduler.prefill_tokens == 1024  # nothing runs: whole prompts
            running = Job(make_row(model, [1, 2, 3], "none", 0, max_new=40), tokenizer, [], loop)
            scheduler.submit(running)
            scheduler._prefill()
            assert engine.rows == [running.row] and scheduler.prefill_budget() == 8
            scheduler.prefill_share = 0.75  # a chunk may cost 3 steps: 16 tokens (2 steps' worth)
            assert scheduler.prefill_budget() == 16
            scheduler.prefill_share = 0.5
            prompt = (list(range(20)) * 10)[:199] + [3]
            arriving = Job(make_row(model, prompt, "none", 0, max_new=10), tokenizer, [], loop)
            scheduler.submit(arriving)
            scheduler._prefill()
            assert engine.pending is arriving.row and engine.cache.lengths[1] == 0  # the steps will cache it
            turns = 0
            while engine.pending is not None:
                scheduler._step()
                scheduler._prefill()
                turns += 1
                assert engine.pending is None or engine.cache.lengths[1] == 8 * turns
        assert arriving.row in engine.rows and id(arriving.row) in scheduler.active
        assert turns == 25 and running.row.stats.new_tokens == 25  # 199 tokens, 8 a step, the stream kept going
        assert any(carried) == (dtype == torch.float32)
        while scheduler.active:
            scheduler._step()
        assert running.row.new_tokens == alone(model, [1, 2, 3], 40)
        assert arriving.row.new_tokens == alone(model, prompt, 10)
    finally:
        loop.close()


def test_a_queue_is_prefilled_in_chunks_worth_the_fill_time():
    """With prompts waiting for a batch with room, a turn may cache FILL_SECONDS' worth of a prompt (64 tokens here)
    instead of one short step's (8): the batch fills in a few turns; with none waiting, or the batch full, the
    running batch's own step prices the chunk."""
    import asyncio

    from specdecode.server.metrics import Metrics
    from specdecode.server.scheduler import FILL_SECONDS, Job, Scheduler

    model = tiny_model(5, vocab_size=24, dtype=torch.float32)
    ms = [0.010, 0.010, 0.020, 0.040, 0.080]  # a step 10 ms; 16, 32, 64 prompt tokens 20, 40, 80 ms
    assert ms[-1] <= FILL_SECONDS < 2 * ms[-1]
    cost = FrozenCost([1, 8, 16, 32, 64], [8, 512], [ms, ms])
    engine = Engine(model, BatchCost([1, 2, 16], [cost] * 3))
    scheduler = Scheduler(engine, max_batch=2, max_queue=8, metrics=Metrics("tiny", 256))
    loop = asyncio.new_event_loop()
    tokenizer = type("T", (), {"decode": lambda self, ids, **k: "x" * len(ids)})()

    def job(prompt: list[int]) -> Job:
        return Job(make_row(model, prompt, "none", 0, max_new=40), tokenizer, [], loop)

    try:
        running = job([1, 2, 3])
        scheduler.submit(running)
        scheduler._prefill()
        assert engine.rows == [running.row] and scheduler.prefill_budget() == 8  # nothing waits: one step's worth
        for _ in range(2):
            scheduler.submit(job(list(range(20)) * 10))
        assert scheduler.prefill_budget() == 64  # two wait, the batch has room: the fill time's worth
        scheduler._prefill()  # one of them is being cached: it fills the batch, the other waits for room
        assert scheduler.prefilling is not None and scheduler.prefill_budget() == 8
    finally:
        loop.close()


@pytest.mark.parametrize("family", NATIVE_FAMILIES)
def test_native_batch_rows_compute_bit_for_bit_what_each_computes_alone(family):
    """On the CPU in float32 a batch's rows run through the native blocks side by side (no padding): a chain, a
    tree and a single token of three rows of different lengths give the very logits (and hidden states) each row
    gives alone, Gemma's sliding window past its end included. So a request's greedy tokens never depend on the
    batch it shares, nor on whether speculation is on."""
    model = native_tiny(family)
    cfg = model.config
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 56, (n,), generator=g).tolist() for n in (9, 14, 4)]
    tree = DraftTree.from_paths(prompts[1][-1], [[5, 6, 7], [5, 8], [9]])
    steps = [(DraftTree.chain(prompts[0][-1], [3, 4]), None), (tree, tree.attention_mask()),
             (DraftTree.root_only(prompts[2][-1]), None)]
    batch = BatchKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, batch_size=3, dtype=model.kv_dtype)
    for b, prompt in enumerate(prompts):  # the model's cache type (float16 for float32), as the engine keeps it
        model.forward(torch.tensor([prompt[:-1]]), batch.row(b), logits_at=None)
    sizes = [len(t) for t, _ in steps]
    n = max(sizes)
    tokens, positions = torch.zeros(3, n, dtype=torch.long), torch.zeros(3, n, dtype=torch.long)
    for b, ((t, _), prompt) in enumerate(zip(steps, prompts, strict=True)):
        tokens[b, : len(t)] = torch.tensor(t.tokens)
        positions[b, : len(t)] = len(prompt) - 1 + t.depths()
    calls = []
    original = type(model)._native_batch
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(model), "_native_batch", lambda self, *a: calls.append(1) or original(self, *a))
        out = model.forward_batch(tokens, batch, positions=positions, sizes=sizes,
                                  tree_masks=[m for _, m in steps], hidden_layers=[0])
    assert calls  # the native batch path ran
    for b, ((t, mask), prompt) in enumerate(zip(steps, prompts, strict=True)):
        alone = model.new_cache(64)
        model.forward(torch.tensor([prompt[:-1]]), alone, logits_at=None)
        ref = model.forward(torch.tensor([t.tokens]), alone, positions=len(prompt) - 1 + t.depths(), tree_mask=mask,
                            hidden_layers=[0])
        assert torch.equal(out.logits[b], ref.logits[0]), b
        assert torch.equal(out.hidden[b][0], ref.hidden[0][0]), b
        assert batch.lengths[b] == len(prompt) - 1 + len(t)


class RaggedRecording(BatchCost):
    """A flat ragged table that records what the engine teaches it."""

    def __init__(self) -> None:
        flat = flat_cost()
        super().__init__(flat.batch_sizes, flat.tables, ragged=True)
        self.by_tokens: list[tuple[int, int]] = []

    def observe_tokens(self, rows: int, total: int, context: int, seconds: float) -> None:
        self.by_tokens.append((rows, total))
        super().observe_tokens(rows, total, context, seconds)


def test_a_ragged_batch_teaches_its_table_by_the_tokens_each_step_held():
    """A ragged step's width does not say how many tokens it held: the engine reports the sum of its rows' trees
    (the rows' verified guesses plus one token a row), and only for steps that guessed."""
    model = tiny_model(5, vocab_size=24)
    cost = RaggedRecording()
    decoder = Engine(model, cost)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 4, 5, 4, 5]]
    rows = [make_row(model, p, "lookup", 3, max_new=20) for p in prompts]
    depths = []
    for row in rows:
        decoder.add(row)
    while decoder.rows:
        decoder.step()
        depths.append(sum(decoder.last_depths) + len(decoder.last_depths))
        for row in [r for r in decoder.rows if r.finish_reason]:
            decoder.remove(row)
    assert cost.by_tokens and all(rows == 2 and total > 2 for rows, total in cost.by_tokens)
    assert [total for _, total in cost.by_tokens] == [d for d in depths if d > 2][: len(cost.by_tokens)]
