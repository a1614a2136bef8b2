"""The prefix store under tensor and data parallelism (gloo, 2 worker processes): job B over job A's documents
equals a cold run, and each tensor-parallel rank's shard of a block is its own object."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from batchgen.engine.core.block_manager import chain_hash
from batchgen.engine.kv_store import KVStore, RankStores
from batchgen.engine.kv_store.format import BlockMiss, decode_block
from batchgen.engine.kv_store.store import object_name
from tests.test_kv_store import GREEDY, IDENTITY, assert_same, full_blocks, jobs, run

PARALLEL = dict(distributed_timeout_s=60, kv_cache_memory=1 << 22)


def test_a_block_is_a_hit_only_when_every_rank_shard_is(tmp_path):
    identities = [dataclasses.replace(IDENTITY, tp_rank=r, tp_size=2) for r in range(2)]
    ranks = RankStores([KVStore(str(tmp_path), i.namespace()) for i in identities])
    tokens, payload = tuple(range(16)), bytes(range(200)) * 2  # rank 0's 200 bytes, then rank 1's
    assert ranks.write(5, tokens, payload) == sum(p.stat().st_size for p in tmp_path.rglob("*.kv")) > len(payload)
    assert ranks.read(5, tokens, len(payload)).payload == payload
    assert decode_block((tmp_path / identities[1].namespace() / object_name(5)).read_bytes(),
                        identities[1].namespace(), 5, tokens, 200) == payload[200:]
    shard = tmp_path / identities[1].namespace() / object_name(5)
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(BlockMiss, match="corrupt"):
        ranks.read(5, tokens, len(payload))
    shard.unlink()
    with pytest.raises(BlockMiss, match="absent"):
        ranks.read(5, tokens, len(payload))


def shared_tokens(a: list[list[int]], b: list[list[int]]) -> list[int]:
    return [min(full_blocks(y), sum(1 for s, t in zip(x, y) if s == t) // 16) * 16 for x, y in zip(a, b)]


def names(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*.kv"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("arch, shards", [("llama", 2), pytest.param("deepseek-v2", 1, marks=pytest.mark.slow)])
def test_tensor_parallel_ranks_store_and_restore_their_own_shards(tiny_model_factory, tmp_path, arch, shards):
    """Per-head K/V: each rank's shard is an object in its rank's namespace. Latent rows: every rank holds
    the same bytes, stored once (rank 0's) and restored to every rank."""
    model, store = tiny_model_factory(arch), tmp_path / "kv"
    a, b = jobs(tokenizer(model), n=3)
    tp = dict(tensor_parallel_size=2, **PARALLEL)
    _, written = run(model, a, prefix_cache_store=str(store), **tp)
    namespaces = sorted(store.iterdir())
    computed = [len(p) + GREEDY.max_tokens - 1 for p in a]  # the last token sampled is never computed
    assert len(namespaces) == shards and all(names(ns) == names(namespaces[0]) for ns in namespaces)
    assert len(names(namespaces[0])) == sum(n // 16 for n in computed)
    assert written.prefix_store_bytes_written == sum(p.stat().st_size for p in store.rglob("*.kv"))
    cold, cold_m = run(model, b, **tp)
    hot, m = run(model, b, prefix_cache_store=str(store), **tp)
    assert_same(hot, cold)
    shared = shared_tokens(a, b)
    assert [o.num_cached_tokens for o in hot] == shared and m.prefix_cache_store_hits == sum(shared)
    assert m.prompt_tokens_computed == cold_m.prompt_tokens_computed - sum(shared)
    read = [ns / object_name(h) for prompt, n in zip(b, shared) for h in chain(prompt, n // 16)
            for ns in namespaces]  # every shard of every block served, once
    assert m.prefix_store_bytes_read == sum(p.stat().st_size for p in read)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_data_parallel_replicas_share_the_store(tiny_model, tmp_path):
    store = str(tmp_path / "kv")
    a, b = jobs(tokenizer(tiny_model), n=4)
    dp = dict(data_parallel_size=2, **PARALLEL)
    _, written = run(tiny_model, a, prefix_cache_store=store, **dp)
    cold, _ = run(tiny_model, b)
    hot, m = run(tiny_model, b, prefix_cache_store=store, **dp)
    assert_same(hot, cold)
    shared = shared_tokens(a, b)
    assert [o.num_cached_tokens for o in hot] == shared and m.prefix_cache_store_hits == sum(shared)
    assert written.prefix_store_bytes_written > 0 and len(list((tmp_path / "kv").iterdir())) == 1


def chain(prompt: list[int], blocks: int) -> list[int]:
    hashes: list[int] = []
    for i in range(blocks):
        hashes.append(chain_hash(hashes[-1] if hashes else None, tuple(prompt[16 * i:16 * (i + 1)])))
    return hashes


def tokenizer(model: Path):
    from batchgen.engine.loading.loader import load_model_source

    return load_model_source(str(model), weights=False).tokenizer
