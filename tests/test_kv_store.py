"""The prefix KV store: its object format, and job B over job A's documents against a cold run."""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.config import EngineConfig
from batchgen.engine.kv_store import KVIdentity, KVStore, kv_identity
from batchgen.engine.kv_store.estimate import rank_kv_layout
from batchgen.engine.kv_store.format import BlockMiss, decode_block, encode_block, weights_digest
from batchgen.engine.kv_store.host import HostCache
from batchgen.engine.kv_store.store import object_name
from batchgen.engine.loading.loader import load_model_source
from batchgen.engine.models.registry import model_config
from batchgen.engine.quantization.checkpoint import convert_folder
from tests.engine_helpers import TEXT
from tests.s3_server import moto_server, s3  # noqa: F401

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=True)
LOGPROB_TOL = 1e-5  # the same prefix computed in other batch shapes differs in the last float bits


# ---- the object format -------------------------------------------------------------------------------
IDENTITY = KVIdentity(weights="w", dtype="float32", layout=(((2, 4), (2, 4)),), block_size=16)


def test_block_round_trip_and_every_damage_is_a_miss():
    ns, tokens, payload = IDENTITY.namespace(), tuple(range(16)), bytes(range(256)) * 4
    data = encode_block(ns, 7, tokens, payload)
    assert decode_block(data, ns, 7, tokens, len(payload)) == payload
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1
    cases = {"corrupt": [bytes(flipped), data[:-1], data[:40], b"", b"x" * len(data)],
             "foreign": [encode_block("other", 7, tokens, payload), encode_block(ns, 8, tokens, payload),
                         encode_block(ns, 7, tokens[::-1], payload), encode_block(ns, 7, tokens, payload[:-4])]}
    for cause, objects in cases.items():
        for obj in objects:
            with pytest.raises(BlockMiss) as miss:
                decode_block(obj, ns, 7, tokens, len(payload))
            assert miss.value.cause == cause


@pytest.mark.parametrize("change", [dict(weights="v"), dict(dtype="bfloat16"), dict(layout=(((512 + 64,),),)),
                                    dict(block_size=32), dict(tp_rank=1, tp_size=2), dict(rope="yarn"),
                                    dict(version=2)])
def test_namespace_covers_everything_that_makes_the_bytes(change):
    assert dataclasses.replace(IDENTITY, **change).namespace() != IDENTITY.namespace()


def test_host_cache_evicts_least_recently_used_within_budget():
    host = HostCache(3 * 100)
    rows = {h: torch.full((100,), h, dtype=torch.uint8) for h in range(5)}
    for h in range(3):
        host.put(h, (h,), rows[h])
    assert host.get(0, (0,)) is rows[0]  # 0 is now the most recent: 1 goes first
    host.put(3, (3,), rows[3])
    assert host.get(1, (1,)) is None and host.get(0, (0,)) is rows[0] and host.used == 300
    assert host.get(3, (4,)) is None  # same hash, other tokens: not this block
    host.put(9, (9,), torch.zeros(301, dtype=torch.uint8))  # larger than the budget: not kept
    assert host.get(9, (9,)) is None and host.evictions == 1


def test_config_checks_the_new_fields():
    with pytest.raises(ValueError, match="prefix_cache_host_bytes"):
        EngineConfig(model="m", prefix_cache_host_bytes=-1)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(model="m", prefix_cache_store="/tmp/x", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="URL"):
        EngineConfig(model="m", prefix_cache_store=" ")


# ---- job A, then job B over the same documents with a new question ----------------------------------
def jobs(tokenizer, n: int = 4) -> tuple[list[list[int]], list[list[int]]]:
    docs = [tokenizer.encode(f"Document {i}: " + TEXT * (2 + i % 2)) for i in range(n)]
    return ([d + tokenizer.encode(" What is it about?") for d in docs],
            [d + tokenizer.encode(" Which numbers does it name, and why?") for d in docs])


def run(model: Path, prompts, dtype: str = "float32", **options):
    llm = LLM(str(model), dtype=dtype, device="cpu", max_num_batched_tokens=64, **options)
    try:
        return llm.generate(prompts, GREEDY), llm.engine.metrics
    finally:
        llm.close()


def assert_same(got, want) -> None:
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert max(abs(x - y) for a, b in zip(got, want) for x, y in zip(a.logprobs, b.logprobs)) <= LOGPROB_TOL


def full_blocks(prompt: list[int]) -> int:
    return (len(prompt) - 1) // 16


def check_second_pass(model: Path, store: str, **options) -> None:
    llm = LLM(str(model), dtype="float32", device="cpu")
    a, b = jobs(llm.tokenizer)
    llm.close()
    run(model, a, prefix_cache_store=store, **options)
    cold, cold_m = run(model, b)
    hot, m = run(model, b, prefix_cache_store=store, **options)
    assert_same(hot, cold)
    shared = [min(full_blocks(y), sum(1 for s, t in zip(x, y) if s == t) // 16) * 16
              for x, y in zip(a, b)]
    assert [o.num_cached_tokens for o in hot] == shared
    assert m.prefix_cache_store_hits == sum(shared) == m.prefix_cache_hits
    assert m.prompt_tokens_computed == cold_m.prompt_tokens_computed - sum(shared)
    assert m.prefix_store_bytes_read > sum(shared) * 4 and m.prefix_store_misses_corrupt == 0


def test_second_pass_loads_from_a_local_store(tiny_model, tmp_path):
    check_second_pass(tiny_model, str(tmp_path / "kv"))


def test_second_pass_on_latent_attention(tiny_model_factory, tmp_path):
    check_second_pass(tiny_model_factory("deepseek-v2"), str(tmp_path / "kv"), kv_cache_memory=1 << 20)


def test_second_pass_from_s3(tiny_model, s3, caplog):  # noqa: F811
    url = s3.url("kv/")
    with caplog.at_level(logging.INFO):
        check_second_pass(tiny_model, url, storage_options=s3.storage_options)
    assert s3.storage_options["secret"] not in caplog.text
    listed = s3.client().list_objects_v2(Bucket=s3.bucket, Prefix="kv/").get("Contents", [])
    assert listed and all(o["Key"].endswith(".kv") for o in listed)


def store_objects(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kv"))


def test_damaged_and_foreign_blocks_are_never_used(tiny_model, tmp_path):
    store = tmp_path / "kv"
    llm = LLM(str(tiny_model), dtype="float32", device="cpu")
    a, b = jobs(llm.tokenizer, n=3)
    llm.close()
    run(tiny_model, a, prefix_cache_store=str(store))
    (namespace,) = [p.name for p in store.iterdir()]
    first = [LLM_block_hash(p) for p in a]
    # Document 0: a flipped byte in its first block; 1: its first block cut short; 2: its first block
    # replaced by a well-formed block of the same size written for another dtype.
    path = [store / namespace / object_name(h) for h in first]
    data = bytearray(path[0].read_bytes())
    data[100] ^= 0xFF
    path[0].write_bytes(bytes(data))
    path[1].write_bytes(path[1].read_bytes()[:1000])
    foreign = dataclasses.replace(IDENTITY, dtype="bfloat16").namespace()
    size = len(decode_any(path[2].read_bytes()))
    path[2].write_bytes(encode_block(foreign, first[2], tuple(a[2][:16]), b"\x01" * size))
    cold, _ = run(tiny_model, b)
    hot, m = run(tiny_model, b, prefix_cache_store=str(store))
    assert_same(hot, cold)
    assert [o.num_cached_tokens for o in hot] == [0, 0, 0]
    assert (m.prefix_store_misses_corrupt, m.prefix_store_misses_foreign) == (2, 1)
    assert m.prefix_cache_store_hits == 0
    again, m = run(tiny_model, b, prefix_cache_store=str(store))  # the recomputed blocks were written back
    assert_same(again, cold)
    assert m.prefix_cache_store_hits > 0 and m.prefix_store_misses_corrupt == m.prefix_store_misses_foreign == 0


def LLM_block_hash(prompt: list[int]) -> int:
    from batchgen.engine.core.block_manager import chain_hash

    return chain_hash(None, tuple(prompt[:16]))


def decode_any(data: bytes) -> bytes:
    """The payload of a well-formed object, whatever its namespace."""
    import json
    import struct

    (length,) = struct.unpack_from("<I", data, 8)
    header = json.loads(data[12:12 + length])
    return data[12 + length:12 + length + header["nbytes"]]


def test_a_slow_store_falls_back_to_computing(tiny_model, tmp_path, monkeypatch):
    store = str(tmp_path / "kv")
    llm = LLM(str(tiny_model), dtype="float32", device="cpu")
    a, b = jobs(llm.tokenizer, n=2)
    llm.close()
    run(tiny_model, a, prefix_cache_store=store)
    cold, _ = run(tiny_model, b)
    read = KVStore.read

    def slow_read(self, *args):
        time.sleep(1.0)
        return read(self, *args)

    monkeypatch.setattr(KVStore, "read", slow_read)
    monkeypatch.setattr("batchgen.engine.kv_store.tiers.PrefixTiers._wait_limit", lambda self, seq: 0.05)
    start = time.perf_counter()
    hot, m = run(tiny_model, b, prefix_cache_store=store)
    assert_same(hot, cold)
    assert m.prefix_cache_store_hits < sum(full_blocks(p) for p in b) * 16
    # waiting out even one 1 s read would pass 1 s; the slack is for a loaded machine's thread wake-ups
    assert m.prefix_store_wait_time_s <= len(b) * 0.05 + 0.8 and time.perf_counter() - start < 60


def test_host_tier_under_a_tiny_budget(tiny_model):
    """A device cache of 12 blocks (about one document) evicts job A's prefixes, and a host tier of 24 blocks keeps
    the latest ones: B, in the reverse order, finds them there (in A's order, an LRU tier would have evicted each
    prefix just before B asks for it); B's own blocks push A's out, least recently used first, within its budget."""
    llm = LLM(str(tiny_model), dtype="float32", device="cpu")
    a, b = jobs(llm.tokenizer, n=4)
    per_block = llm.engine.executor.kv_layout.bytes_per_block(16, torch.float32)
    llm.close()
    cold, _ = run(tiny_model, b)
    options = dict(kv_cache_memory=per_block * 12, max_num_seqs=1)
    llm = LLM(str(tiny_model), dtype="float32", device="cpu", max_num_batched_tokens=64,
              prefix_cache_host_bytes=per_block * 24, **options)
    try:
        llm.generate(a, GREEDY)
        llm.engine.reset_metrics()
        hot = llm.generate(b[::-1], GREEDY)
        m, host = llm.engine.metrics, llm.engine.prefix_tiers.host
    finally:
        llm.close()
    assert_same(hot, cold[::-1])
    assert m.prefix_cache_host_hits > 0 and m.prefix_cache_store_hits == 0
    assert host.used <= per_block * 24 and host.evictions > 0 and len(host) == 24


WRITER = textwrap.dedent("""
    import sys
    from batchgen.engine import LLM, SamplingParams
    llm = LLM(sys.argv[1], dtype="float32", device="cpu", max_num_batched_tokens=64, prefix_cache_store=sys.argv[2])
    prompts = [[int(t) for t in p.split(",")] for p in sys.argv[3].split(";")]
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    llm.close()
""")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_processes_write_the_same_blocks_at_once(tiny_model, tmp_path):
    store = tmp_path / "kv"
    llm = LLM(str(tiny_model), dtype="float32", device="cpu")
    a, b = jobs(llm.tokenizer)
    llm.close()
    arg = ";".join(",".join(map(str, p)) for p in a)
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tiny_model), str(store), arg],
                              cwd=Path(__file__).parent.parent, stderr=subprocess.PIPE) for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err.decode()[-2000:]
    assert not [p for p in store.rglob("*") if p.is_file() and not p.name.endswith(".kv")]  # no temp left
    cold, _ = run(tiny_model, b)
    hot, m = run(tiny_model, b, prefix_cache_store=str(store))
    assert_same(hot, cold)
    assert m.prefix_cache_store_hits > 0 and m.prefix_store_misses_corrupt == 0


def test_wait_for_a_load_is_bounded_by_the_compute_it_saves():
    from batchgen.engine.kv_store.tiers import DEFAULT_WAIT_S, MIN_WAIT_S, PrefixTiers
    from batchgen.engine.core.sequence import Sequence

    tiers = PrefixTiers(16, 100, 0, None)
    seq = Sequence(0, list(range(1000)), GREEDY, seed=0)
    seq.num_computed_tokens = 200
    assert tiers._wait_limit(seq) == DEFAULT_WAIT_S  # nothing timed yet
    tiers.seconds_per_token = 1e-3
    assert tiers._wait_limit(seq) == pytest.approx(0.8)
    tiers.seconds_per_token = 1e-9
    assert tiers._wait_limit(seq) == MIN_WAIT_S


# ---- the identity of a real engine's blocks ---------------------------------------------------------
def namespace(model: Path, max_model_len: int | None = None, **engine) -> str:
    """The store folder an engine with these settings would read and write, as the engine derives it."""
    config = EngineConfig(model=str(model), dtype="float32", device="cpu", **engine)
    source = load_model_source(config.model, config.storage_options)
    cfg = model_config(source.config)
    positions = cfg.context_len(max_model_len)
    return kv_identity(config, source, cfg, rank_kv_layout(config, cfg, positions), positions).namespace()


def test_a_checkpoint_changed_in_one_tensor_mid_file_has_its_own_blocks(tmp_path):
    """Files of several MiB, equal but for one byte in the middle: another model, so other blocks."""
    original = tmp_path / "a"
    original.mkdir()
    (original / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({f"t{i}": torch.randn(256, 1024) for i in range(6)}, str(original / "model.safetensors"))
    changed = tmp_path / "b"
    shutil.copytree(original, changed)
    data = bytearray((changed / "model.safetensors").read_bytes())
    assert len(data) > 4 * (1 << 20)
    data[len(data) // 2] ^= 0x40
    (changed / "model.safetensors").write_bytes(bytes(data))
    config = json.loads((original / "config.json").read_text())
    assert weights_digest(str(original), config) != weights_digest(str(changed), config)
    assert weights_digest(str(original), config) == weights_digest(str(shutil.copytree(original, tmp_path / "c")),
                                                                   config)  # a copy is the same model


def test_longrope_blocks_are_named_by_the_factors_the_context_picks(tiny_model_factory):
    """LongRoPE's table takes its long factors once max_model_len passes the original context (16 here)."""
    phi3 = tiny_model_factory("phi3")
    short, also_short, long = (namespace(phi3, n) for n in (8, 16, 256))
    assert short == also_short != long
    llama = tiny_model_factory("llama")
    assert namespace(llama, 32) == namespace(llama, 64)  # no other scaling takes anything from the context


def test_fp8_weights_kept_and_dequantized_have_their_own_blocks(tiny_model_factory, tmp_path):
    """FP8 weights kept multiply FP8-quantized activations: other keys and values than the dequantized weights."""
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    convert_folder(tiny_model_factory("llama"), fp8, "block")
    dequantized = namespace(fp8, attention_backend="triton", fp8_weights="dequantize")
    assert namespace(fp8, attention_backend="triton", fp8_weights="fp8") != dequantized
    assert namespace(fp8, attention_backend="triton", fp8_weights="auto") == dequantized  # no FP8 GEMM on a CPU
