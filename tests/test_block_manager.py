"""Block manager invariants: prefix hits, reclaiming freed blocks, and no leaks after a run."""
from __future__ import annotations

import itertools
import random

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.core import block_manager
from batchgen.engine.core.block_manager import BlockManager, fewest_runs
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.sampling.params import SamplingParams as Params
from tests.engine_helpers import TEXT


def seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(i, list(tokens), Params(), seed=0)


def test_prefix_hits_need_computed_full_blocks_and_leave_one_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(0, list(range(10)))
    bm.admit(a)
    assert a.num_computed_tokens == 0 and len(a.block_table) == 3
    b = seq(1, list(range(10)))
    bm.admit(b)
    assert b.num_computed_tokens == 0, "blocks not yet scheduled must not be shared"
    bm.mark_scheduled(a, 10)
    c = seq(2, list(range(8)))  # two full blocks, but the last token must be computed
    bm.admit(c)
    assert c.num_computed_tokens == 4 and c.block_table[0] == a.block_table[0]
    d = seq(3, list(range(9)))
    bm.admit(d)
    assert d.num_computed_tokens == 8 and d.block_table[:2] == a.block_table[:2]


def test_freed_blocks_are_reclaimed_by_hash_until_reused():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(0, list(range(9)))
    bm.admit(a)
    bm.mark_scheduled(a, 9)
    first_two = a.block_table[:2]
    bm.free_seq(a)
    assert bm.num_free_blocks == 4
    b = seq(1, list(range(9)))
    assert bm.can_admit(b)
    bm.admit(b)
    assert b.block_table[:2] == first_two and b.num_computed_tokens == 8
    bm.free_seq(b)
    other = seq(2, [100 + i for i in range(16)])  # takes every block, wiping the cached ones
    bm.admit(other)
    bm.free_seq(other)
    again = seq(3, list(range(9)))
    bm.admit(again)
    assert again.num_computed_tokens == 0


def test_new_tokens_take_blank_blocks_then_evict_in_the_order_blocks_were_freed():
    bm = BlockManager(num_blocks=7, block_size=4)
    cached = seq(0, list(range(8)))  # two full blocks, findable once scheduled
    bm.admit(cached)
    bm.mark_scheduled(cached, 8)
    partial = seq(1, [100, 101])  # holds tokens, nothing findable
    bm.admit(partial)
    bm.free_seq(partial)
    bm.free_seq(cached)  # its last block first
    assert list(bm.cached) == [2, 1, 0] and bm.num_free_blocks == 7
    latest = seq(2, [300])  # a never-used block before any block that held tokens
    bm.admit(latest)
    assert latest.block_table == [3]
    fresh = seq(3, list(range(400, 413)))  # four blocks: the last blank ones, then the first freed
    bm.admit(fresh)
    assert fresh.block_table == [2, 4, 5, 6] and list(bm.cached) == [1, 0]
    bm.free_seq(latest)
    again = seq(4, list(range(9)))
    assert bm.admit(again) == 8 and again.block_table == [0, 1, 3]


def test_without_prefix_caching_the_latest_freed_block_comes_back_first():
    bm = BlockManager(num_blocks=7, block_size=4, enable_prefix_caching=False)
    first, second = seq(0, [100, 101]), seq(1, [200, 201])
    bm.admit(first)
    bm.admit(second)
    bm.free_seq(first)
    bm.free_seq(second)
    latest, after = seq(2, [300]), seq(3, [400])
    bm.admit(latest)
    bm.admit(after)
    assert latest.block_table == [1] and after.block_table == [0] and not bm.cached


def test_blocks_freed_together_come_back_in_ascending_order():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = seq(0, list(range(24)))  # every block, ascending from a fresh cache
    bm.admit(a)
    bm.mark_scheduled(a, 24)
    assert a.block_table == list(range(6))
    bm.free_seq(a)  # its tail first: eviction would hand its blocks out descending
    b = seq(1, [100 + i for i in range(10)])  # three blocks, evicting a's three oldest-freed ones
    bm.admit(b)
    assert b.block_table == [3, 4, 5]
    bm.allocate(b, 16)  # grown by one: appended after its first blocks, whatever its id
    assert b.block_table[:3] == [3, 4, 5] and b.block_table[3] == 2
    again = seq(2, list(range(5)))  # a's first block is still findable, its second the one left to evict
    assert bm.admit(again) == 4 and again.block_table == [0, 1]


def test_no_blocks_leak_after_preemption_and_sharing(tiny_model):
    probe = LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory=1 << 20)
    per_block = probe.engine.executor.kv_layout.bytes_per_block(16, probe.config.torch_dtype)
    llm = LLM(str(tiny_model), dtype="float32", device="cpu", max_num_batched_tokens=64,
              kv_cache_memory=per_block * 16)
    shared = llm.tokenizer.encode(TEXT * 2)[:48]
    prompts = [shared + llm.tokenizer.encode(f" {i}") for i in range(8)]
    llm.generate(prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    bm = llm.engine.block_manager
    assert llm.engine.metrics.preemptions > 0
    assert bm.num_free_blocks == len(bm.blocks)
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert llm.engine.metrics.prefix_cache_hits > 0


def test_blocks_out_of_every_window_are_released_and_stay_cached():
    bm = BlockManager(num_blocks=8, block_size=4, window=6)
    a = seq(0, list(range(20)))
    bm.admit(a)
    bm.mark_scheduled(a, 20)
    table = list(a.block_table)
    a.num_computed_tokens = 9  # the next query (position 9) reads keys 4..9: block 0 is out of the window
    bm.release_out_of_window(a)
    assert a.block_table == [-1, *table[1:]] and bm.num_free_blocks == 4
    a.num_computed_tokens = 17  # keys 12.. : blocks 0-2 are out
    bm.release_out_of_window(a)
    bm.release_out_of_window(a)  # idempotent
    assert a.block_table[:3] == [-1] * 3 and bm.num_free_blocks == 6
    b = seq(1, list(range(13)))  # a released block keeps its hash: a later prompt reuses it
    bm.admit(b)
    assert b.num_computed_tokens == 12 and b.block_table == table[:3] + b.block_table[3:]
    bm.free_seq(a)
    bm.free_seq(b)
    assert bm.num_free_blocks == 8 and all(block.ref_count == 0 for block in bm.blocks)
    assert a.num_released_blocks == 0 and not a.block_table


def test_window_models_free_blocks_as_they_run(tiny_model_factory):
    """Mistral's window covers every layer: a long sequence keeps about a window of blocks, not all."""
    llm = LLM(str(tiny_model_factory("mistral")), dtype="float32", device="cpu", max_num_batched_tokens=32)
    engine = llm.engine
    assert engine.block_manager.window == 24
    prompt = llm.tokenizer.encode(TEXT * 3)
    engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    held = []
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        if running:
            held.append(sum(b >= 0 for b in running[0].block_table))
    assert len(prompt) + 40 > 6 * 16 and max(held[-10:]) <= -(-24 // 16) + 2
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)


def held_once(bm: BlockManager) -> bool:
    """Every block is in exactly one place: held by sequences, blank, earmarked or cached; the count agrees."""
    earmarked = [b for ids in bm.earmarks.values() for b in ids]
    free = bm.blank + earmarked + list(bm.cached)
    held = [b.block_id for b in bm.blocks if b.ref_count > 0]
    return (sorted(free + held) == list(range(len(bm.blocks))) and bm.num_earmarked == len(earmarked)
            and bm.num_free_blocks == len(free))


def decode(bm: BlockManager, seqs: list[Sequence], steps: int) -> None:
    """Each step every sequence gains a token and the blocks for it, as the scheduler's decode steps do."""
    for step in range(steps):
        for s in seqs:
            s.token_ids.append(1000 + step)
            bm.allocate(s, s.num_tokens)


def is_run(table: list[int]) -> bool:
    return table == list(range(table[0], table[0] + len(table)))


def test_decoding_rows_extend_their_own_run_of_blocks():
    tables = {}
    for max_earmark in (64, 0):  # 0: no earmarks, blocks taken as rows cross a boundary interleave the rows
        bm = BlockManager(num_blocks=128, block_size=4, max_earmark=max_earmark)
        rows = [Sequence(i, [i] * 8, Params(max_tokens=12), seed=0) for i in range(4)]
        for s in rows:
            bm.admit(s)
        decode(bm, rows, 12)
        assert all(len(s.block_table) == 5 for s in rows) and held_once(bm)
        tables[max_earmark] = [s.block_table for s in rows]
    assert all(is_run(t) for t in tables[64]), tables[64]
    assert not any(is_run(t) for t in tables[0]), tables[0]


def test_earmarks_cap_at_the_context_at_max_earmark_and_at_an_eighth_of_the_cache():
    bm = BlockManager(num_blocks=64, block_size=4, max_model_len=20)
    bm.admit(Sequence(0, [1] * 8, Params(max_tokens=100), seed=0))
    assert bm.earmarks[0] == [4, 3, 2]  # up to 20 tokens: 5 blocks, 2 of them the prompt's
    bm = BlockManager(num_blocks=64, block_size=4)
    bm.admit(Sequence(0, [1] * 8, Params(max_tokens=100), seed=0))
    bm.admit(Sequence(1, [1] * 8, Params(max_tokens=100), seed=0))
    assert len(bm.earmarks[0]) == bm.num_earmarked == 64 // 8 and 1 not in bm.earmarks
    bm = BlockManager(num_blocks=64, block_size=4, max_earmark=2)
    bm.admit(s := Sequence(0, [1] * 8, Params(max_tokens=100), seed=0))
    assert bm.earmarks[0] == [3, 2]
    bm.free_seq(s)  # its prompt's blocks held tokens: they wait with the freed ones; its earmarks are blank
    assert not bm.earmarks and bm.num_free_blocks == 64 and held_once(bm) and list(bm.cached) == [1, 0]
    again = Sequence(1, [2] * 16, Params(max_tokens=1), seed=0)  # the earmarks come back ascending
    bm.admit(again)
    assert again.block_table == [2, 3, 4, 5]


def test_others_take_earmarked_blocks_only_when_no_other_block_is_free():
    bm = BlockManager(num_blocks=48, block_size=4)
    cached = Sequence(0, list(range(8)), Params(max_tokens=1), seed=0)
    bm.admit(cached)
    bm.mark_scheduled(cached, 8)
    bm.free_seq(cached)  # blocks 0 and 1 are findable by hash
    bm.admit(Sequence(9, [9] * 151, Params(max_tokens=1), seed=0))  # 38 blocks, nothing to earmark
    first = Sequence(1, [100] * 4, Params(max_tokens=12), seed=0)
    bm.admit(first)  # a blank block and three earmarked ones after it
    second = Sequence(2, [200] * 4, Params(max_tokens=12), seed=0)
    bm.admit(second)  # the last blank ones
    assert len(bm.blank) == 0 and bm.num_earmarked == 6 and held_once(bm)
    marks = list(bm.earmarks[2])
    third = Sequence(3, [300] * 15, Params(max_tokens=1), seed=0)  # four blocks, nothing to earmark
    assert bm.can_admit(third)
    bm.admit(third)  # the two cached blocks, then two of the newest earmarks, highest first
    assert third.block_table == sorted([0, 1] + marks[:2]) and bm.earmarks[2] == marks[2:] and held_once(bm)
    decode(bm, [second], 4)  # the second sequence grows into what it still has earmarked
    assert second.block_table[1] == marks[2] and held_once(bm)
    assert bm.num_cached_blocks(Sequence(4, list(range(9)), Params(), seed=0)) == 0


def test_blocks_of_rejected_drafts_return_to_the_sequence_s_earmarks():
    bm = BlockManager(num_blocks=32, block_size=4)
    s = Sequence(0, [1] * 6, Params(max_tokens=20), seed=0)
    bm.admit(s)
    bm.allocate(s, 6 + 5)  # two drafts' worth of blocks beyond the prompt's
    drafted = list(s.block_table)
    bm.truncate(s, 7)
    assert s.block_table == drafted[:2] and held_once(bm)
    bm.allocate(s, 11)
    assert s.block_table == drafted and is_run(drafted) and held_once(bm)
    bm.free_seq(s)
    assert bm.num_free_blocks == 32 and held_once(bm)


def test_an_engine_s_decoding_rows_each_read_one_run_of_blocks(tiny_model):
    llm = LLM(str(tiny_model), dtype="float32", device="cpu", max_num_seqs=8)
    engine = llm.engine
    for i in range(8):
        prompt = llm.tokenizer.encode(f"{i}. {TEXT}")[:40]  # no shared prefix: each row has blocks of its own
        engine.add_request(prompt, SamplingParams(max_tokens=48, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        tables = [s.block_table for s in engine.scheduler.running]
        assert all(is_run(t) for t in tables), tables
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks) and held_once(engine.block_manager)


def test_with_no_blank_block_left_earmarks_evict_the_oldest_cached_blocks():
    bm = BlockManager(num_blocks=32, block_size=4, max_earmark=0)
    old = Sequence(0, list(range(64)), Params(max_tokens=1), seed=0)
    newer = Sequence(1, list(range(100, 164)), Params(max_tokens=1), seed=0)
    for s in (old, newer):
        bm.admit(s)
        bm.mark_scheduled(s, 64)
        bm.free_seq(s)  # 16 full blocks each, findable by hash, the old ones the oldest
    assert not bm.blank and len(bm.cached) == 32
    bm.max_earmark = 64
    grows = Sequence(2, [7] * 4, Params(max_tokens=8), seed=0)
    bm.admit(grows)  # a block and two earmarked: the old prompt's last three, the oldest freed, in order
    assert grows.block_table == [13] and bm.earmarks[2] == [15, 14] and held_once(bm)
    assert bm.num_cached_blocks(Sequence(3, list(range(100, 165)), Params(), seed=0)) == 16
    assert bm.num_cached_blocks(Sequence(4, list(range(65)), Params(), seed=0)) == 13
    decode(bm, [grows], 8)
    assert grows.block_table == [13, 14, 15] and held_once(bm)


def runs_in(ids: list[int]) -> int:
    return sum(1 for i, b in enumerate(ids) if i == 0 or b != ids[i - 1] + 1)


def test_evictions_take_as_few_runs_as_any_choice_of_the_candidates():
    rng = random.Random(0)
    for _ in range(300):
        candidates = rng.sample(range(24), rng.randint(1, 10))
        count = rng.randint(1, len(candidates))
        taken = fewest_runs(candidates, count)
        fewest = min(runs_in(sorted(c)) for c in itertools.combinations(candidates, count))
        assert len(taken) == len(set(taken)) == count and set(taken) <= set(candidates) and taken == sorted(taken)
        assert runs_in(taken) == fewest, (candidates, count, taken)


def test_evictions_skip_blocks_found_by_hash_until_their_turn():
    bm = BlockManager(num_blocks=7, block_size=4, max_earmark=0)
    a, b, c = seq(0, range(8)), seq(1, range(100, 108)), seq(2, range(200, 208))
    for s in (a, b, c):
        bm.admit(s)
        bm.mark_scheduled(s, 8)
    for s in (a, c, b):
        bm.free_seq(s)
    reuse = seq(3, [*range(100, 108), 9])  # finds b's two blocks, then takes the last blank one
    assert bm.admit(reuse) == 8 and reuse.block_table == [2, 3, 6]
    bm.free_seq(reuse)
    assert not bm.blank and list(bm.cached) == [1, 0, 5, 4, 6, 3, 2]
    fresh = seq(4, range(300, 312))  # oldest first would give [0, 1, 5]; all seven in one run would take 2
    bm.admit(fresh)
    assert fresh.block_table == [4, 5, 6] and list(bm.cached) == [1, 0, 3, 2] and held_once(bm)
    assert bm.num_cached_blocks(seq(5, [*range(100, 108), 9])) == 2


def test_blocks_restored_from_a_lower_tier_wait_their_turn_as_prefixes():
    bm = BlockManager(num_blocks=7, block_size=4, max_earmark=0)
    a, b, c = seq(0, range(8)), seq(1, [*range(100, 108), 9]), seq(2, range(200, 208))
    bm.admit(a)
    bm.mark_scheduled(a, 8)
    bm.admit(b)  # its two full blocks' KV comes from the prefix store
    bm.mark_restored(b, 0)
    bm.mark_restored(b, 1)
    bm.mark_scheduled(b, 1)
    bm.admit(c)
    bm.mark_scheduled(c, 8)
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1], [2, 3, 4], [5, 6])
    for s in (a, c, b):
        bm.free_seq(s)
    assert list(bm.cached) == [1, 0, 6, 5, 4, 3, 2]
    fresh = seq(4, range(300, 312))  # all seven in one run would take [0, 1, 2], the restored block 2 with them
    bm.admit(fresh)
    assert fresh.block_table == [4, 5, 6] and list(bm.cached) == [1, 0, 3, 2] and held_once(bm)
    assert bm.num_cached_blocks(seq(5, [*range(100, 108), 9])) == 2


def stream_adjacency(window: int) -> float:
    """Share of running rows' block pairs in order once a cache has turned over, for a stream of random prompts."""
    bm = BlockManager(num_blocks=256, block_size=4, max_earmark=8)
    bm.eviction_window = window
    rng = random.Random(1)
    waiting = [Sequence(i, [rng.randrange(10**6) for _ in range(rng.randint(20, 90))],
                        Params(max_tokens=rng.randint(4, 24)), seed=0) for i in range(300)]
    running, pairs = [], []
    while waiting or running:
        while waiting and len(running) < 8 and bm.can_admit(waiting[0]):
            s = waiting.pop(0)
            bm.admit(s)
            bm.mark_scheduled(s, s.num_tokens)
            running.append(s)
        decode(bm, running, 1)
        for s in running:
            bm.mark_scheduled(s, s.num_tokens)
        if len(waiting) < 200:  # past the first turn of the cache
            pairs += [b == a + 1 for s in running for a, b in zip(s.block_table, s.block_table[1:])]
        for s in [s for s in running if s.num_tokens - s.num_prompt_tokens >= s.params.max_tokens]:
            running.remove(s)
            bm.free_seq(s)
    assert held_once(bm) and bm.num_free_blocks == 256
    return sum(pairs) / len(pairs)


def test_a_turned_over_cache_gives_new_rows_runs_of_blocks():
    oldest_first = stream_adjacency(window=1)  # the oldest freed blocks, wherever they lie
    runs = stream_adjacency(window=block_manager.EVICTION_WINDOW)
    assert runs > 0.97 and oldest_first < 0.95, (runs, oldest_first)
