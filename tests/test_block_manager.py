"""Block manager invariants: prefix hits, reclaiming freed blocks, and no leaks after a run."""
from __future__ import annotations

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.sampling_params import SamplingParams as Params
from batchgen.engine.sequence import Sequence
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
