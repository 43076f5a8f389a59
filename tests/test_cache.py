"""KVCache bookkeeping: writes, rollback, and compacting an accepted tree path with keep()."""

from __future__ import annotations

import pytest
import torch

from specdecode.core.tree import DraftTree
from specdecode.models import KVCache

from .helpers import tiny_model

LAYERS, HEADS, DIM = 3, 2, 4


def filled_cache(length: int, max_len: int = 16) -> KVCache:
    """A cache whose entry (layer l, k/v s, position t) holds the number 1000 l + 100 s + t everywhere."""
    cache = KVCache(LAYERS, HEADS, DIM, max_len, dtype=torch.float64)
    for layer in range(LAYERS):
        pos = torch.arange(length, dtype=torch.float64).view(1, 1, length, 1).expand(1, HEADS, length, DIM)
        cache.write(layer, 1000 * layer + pos, 1000 * layer + 100 + pos, 0)
    cache.length = length
    return cache


def positions(cache: KVCache, upto: int) -> torch.Tensor:
    """Decode which original position each slot [0, upto) holds, checking all layers, k and v agree."""
    t = cache.kv[:, :, 0, :, :upto]  # [L, 2, H, upto, D]
    offset = 1000 * torch.arange(LAYERS, dtype=torch.float64).view(LAYERS, 1, 1, 1, 1)
    offset = offset + 100 * torch.arange(2, dtype=torch.float64).view(1, 2, 1, 1, 1)
    pos = t - offset
    assert torch.all(pos == pos[0, 0, 0, :, 0].view(1, 1, 1, upto, 1)), "layers/k/v/heads moved differently"
    return pos[0, 0, 0, :, 0].long()


def test_write_returns_the_layer_so_far() -> None:
    cache = KVCache(LAYERS, HEADS, DIM, 8, dtype=torch.float64)
    k, v = torch.ones(1, HEADS, 3, DIM), 2 * torch.ones(1, HEADS, 3, DIM)
    keys, values = cache.write(1, k.double(), v.double(), 2)
    assert keys.shape == (1, HEADS, 5, DIM) and values.shape == (1, HEADS, 5, DIM)
    assert torch.all(keys[:, :, 2:] == 1) and torch.all(values[:, :, 2:] == 2)
    assert torch.all(keys[:, :, :2] == 0) and torch.all(cache.kv[0] == 0)  # other slots and layers untouched


def test_keep_non_prefix_moves_exactly_those_entries_for_all_layers() -> None:
    cache = filled_cache(12)
    cache.keep(5, [0, 2, 5, 6])  # a tree path: root, then nodes 2, 5, 6
    assert cache.length == 9
    assert positions(cache, 9).tolist() == [0, 1, 2, 3, 4, 5, 7, 10, 11]


def test_keep_prefix_is_a_pointer_move() -> None:
    cache = filled_cache(12)
    before = cache.kv.clone()
    cache.keep(5, [0, 1, 2])
    assert cache.length == 8 and torch.equal(cache.kv, before)
    cache.keep(8, [])  # nothing kept: the root's slot is dropped too
    assert cache.length == 8


@pytest.mark.parametrize("indices", [[0, 7], [-1], [0, 1, 2, 3, 4, 5, 6, 7]])
def test_keep_out_of_range(indices: list[int]) -> None:
    cache = filled_cache(12)
    with pytest.raises(IndexError):
        cache.keep(5, indices)  # entries 5..11 are the 7 new ones: index 7 is past the end
    assert cache.length == 12


def test_write_overflow() -> None:
    cache = KVCache(LAYERS, HEADS, DIM, 8, dtype=torch.float64)
    cache.write(0, torch.zeros(1, HEADS, 8, DIM, dtype=torch.float64), torch.zeros(1, HEADS, 8, DIM,
                dtype=torch.float64), 0)  # exactly full is fine
    with pytest.raises(ValueError, match="overflow"):
        cache.write(0, torch.zeros(1, HEADS, 2, DIM, dtype=torch.float64), torch.zeros(1, HEADS, 2, DIM,
                    dtype=torch.float64), 7)


def test_model_overflow_raises() -> None:
    model = tiny_model(0)
    with pytest.raises(ValueError, match="overflow"):
        model.forward(torch.zeros(1, 9, dtype=torch.long), model.new_cache(8))


def test_rollback() -> None:
    cache = filled_cache(10)
    cache.rollback(4)
    assert cache.length == 4
    cache.rollback(4)  # to the current length: a no-op
    with pytest.raises(ValueError):
        cache.rollback(5)  # cannot roll "back" beyond what is held
    with pytest.raises(ValueError):
        cache.rollback(-1)
    assert cache.length == 4


def test_tree_forward_then_keep_continues_like_the_path_alone() -> None:
    """After verifying a tree and keeping one non-first branch, decoding matches a model that only saw it."""
    model = tiny_model(7)
    prompt = [3, 17, 9, 30, 3, 17, 2]
    tree = DraftTree.from_paths(prompt[-1], [[4, 5, 6], [4, 8, 9, 10], [11]])
    path_nodes = [0, 1, 4, 5]  # root -> 4 -> 8 -> 9: the second branch, a non-prefix keep
    assert [tree.tokens[i] for i in path_nodes] == [2, 4, 8, 9]

    cache = model.new_cache(64)
    model.forward(torch.tensor([prompt[:-1]]), cache, logits_at=None)
    start = cache.length
    model.forward(torch.tensor([tree.tokens]), cache, positions=start + tree.depths(),
                  tree_mask=tree.attention_mask())
    cache.keep(start, path_nodes)
    continuation = [13, 1, 40]
    got = model.forward(torch.tensor([continuation]), cache).logits

    fresh = model.new_cache(64)
    expected = model.forward(torch.tensor([prompt + [4, 8, 9] + continuation]), fresh).logits[:, -3:]
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)
    # without compaction the continuation would see the wrong entries: the check can fail
    bad = model.new_cache(64)
    model.forward(torch.tensor([prompt[:-1]]), bad, logits_at=None)
    model.forward(torch.tensor([tree.tokens]), bad, positions=start + tree.depths(), tree_mask=tree.attention_mask())
    bad.length = start + len(path_nodes)  # a pointer move only
    wrong = model.forward(torch.tensor([continuation]), bad).logits
    assert not torch.allclose(wrong, expected)


@pytest.mark.parametrize("indices", [[0, 1, 2], [0, 2], [0, 1, 2, 3, 4, 5, 6, 7], [0, 7]])
def test_batch_keep_moves_a_tree_path_and_checks_every_range(indices: list[int]) -> None:
    """A chain's prefix (every plain step) only moves the row's length; a tree path is packed; both refuse indices
    past the row's new entries, leaving the row as it was."""
    from specdecode.models import BatchKVCache

    cache = BatchKVCache(LAYERS, HEADS, DIM, 16, batch_size=2, dtype=torch.float64)
    cache.kv[:, :, 1, :, :12] = torch.arange(12, dtype=torch.float64)[:, None]  # entry p holds p
    cache.lengths[1] = 12
    if max(indices) >= 7:  # entries 5..11 are the 7 new ones
        with pytest.raises(IndexError):
            cache.keep(1, 5, indices)
        assert cache.lengths[1] == 12
        return
    cache.keep(1, 5, indices)
    assert cache.lengths[1] == 5 + len(indices)
    assert cache.kv[0, 0, 1, 0, : cache.lengths[1], 0].tolist() == [0, 1, 2, 3, 4, *(5 + i for i in indices)]


def test_an_engine_gives_its_cache_memory_back_when_its_batch_empties() -> None:
    """A long request grows the batch's cache (rows and positions); once every request has left, the cache is back
    to its starting size, and the next request runs as before."""
    from specdecode.core.sampling import SamplingParams
    from specdecode.engine.loop import Engine, generate_ids
    from specdecode.engine.request import Request
    from specdecode.policy.batch_cost import BatchCost
    from specdecode.policy.cost import CostModel
    from specdecode.proposers import NoProposer

    from .helpers import tiny_model

    model = tiny_model(0, vocab_size=56, max_position_embeddings=2048)
    engine = Engine(model, BatchCost.single(CostModel.flat()))
    start = engine.cache.kv.numel()

    def request(n: int) -> Request:
        return Request(2048, NoProposer(), [i % 50 for i in range(n)], max_new_tokens=4, params=SamplingParams(), k=0)

    long, short = request(900), request(5)
    engine.add(long)
    engine.add(short)
    grown = engine.cache.kv.numel()
    assert grown >= 4 * start
    engine.step()
    engine.remove(long)
    assert engine.cache.kv.numel() == grown  # a row still runs: nothing moves under it
    engine.remove(short)
    assert engine.cache.kv.numel() == start and engine.cache.lengths == [0] * engine.cache.batch_size
    again = request(5)
    engine.add(again)
    assert engine.step()[0][1] == generate_ids(model, again.tokens[:5], max_new_tokens=1)[0]


def test_a_second_choice_copies_the_prompts_cache_instead_of_prefilling() -> None:
    """Engine.add(like=...): the n choices of one prompt share its prefill (a copy of the sibling's rows), and
    decode exactly what a request alone decodes, even when the sibling has already generated tokens."""
    from specdecode.core.sampling import SamplingParams
    from specdecode.engine.loop import Engine, generate_ids
    from specdecode.engine.request import Request
    from specdecode.policy.batch_cost import BatchCost
    from specdecode.policy.cost import CostModel
    from specdecode.proposers import NoProposer

    from .helpers import tiny_model

    model = tiny_model(1, vocab_size=56)
    prompt = [3, 9, 4, 4, 17, 30, 2, 8, 8, 1]
    expected = generate_ids(model, prompt, max_new_tokens=6)[0]
    engine = Engine(model, BatchCost.single(CostModel.flat()))
    first, second = (Request(512, NoProposer(), prompt, max_new_tokens=6, params=SamplingParams(), k=0)
                     for _ in range(2))
    engine.add(first)
    engine.step()
    engine.step()  # the sibling is two tokens ahead
    forwards = []
    original = model.forward
    model.forward = lambda *a, **k: forwards.append(1) or original(*a, **k)  # type: ignore[method-assign]
    try:
        engine.add(second, like=first)
        assert not forwards  # no prefill: its prompt's entries were copied
    finally:
        del model.forward
    while engine.rows:
        for row, _ in engine.step():
            if row.finish_reason is not None:
                engine.remove(row)
    assert first.new_tokens == second.new_tokens == expected
