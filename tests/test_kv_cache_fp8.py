"""The fp8 KV cache: the setting and its capacity, the CPU decode op over fp8 rows, and whole models against
transformers with the same rounding of K and V (a bf16 cache under fp32 too, where the tests are the same)."""
from __future__ import annotations

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.backends.cpu import ops
from batchgen.engine.backends.cpu.attention import CpuAttentionBackend
from batchgen.engine.backends.interface import AttentionMetadata
from batchgen.engine.backends.torch.attention import TorchAttentionBackend
from batchgen.engine.config import EngineConfig
from batchgen.engine.dtype import as_stored, check_kv_cache_dtype, to_cache_dtype
from tests.engine_helpers import mixed_prompts, model_runner
from tests.test_cpu_decode import (F32, BF16, DecodeStep, assert_as_good_as_torch, decode_step, fp64_decode, fused,
                                   torch_path)
from tests.test_cpu_decode import kernels  # noqa: F401  (the fixture)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=True)


def every_code(fp8: torch.dtype) -> torch.Tensor:
    """The format's 256 codes as values, NaN and inf codes as zeros (a cache never holds them)."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
    return torch.where(values.isfinite(), values, torch.zeros_like(values)).to(fp8)


def random_fp8(shape, fp8: torch.dtype, seed: int) -> torch.Tensor:
    """Codes drawn uniformly (subnormals, the largest values and both signs included), scaled so scores stay
    within fp32 and bf16 reach."""
    codes = every_code(fp8)[torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))]
    return to_cache_dtype(codes.float() / (8 if fp8 == E4M3 else 256), fp8)


def test_stored_values_saturate_at_the_largest_finite_value():
    x = torch.tensor([1e6, -1e6, 500.0, 0.3, 1e-9, float("inf")])
    for fp8 in (E4M3, E5M2):
        limit = torch.finfo(fp8).max
        assert to_cache_dtype(x, fp8).float().tolist()[:2] == [limit, -limit]
        rounded = as_stored(x, fp8)
        assert rounded.dtype == x.dtype and torch.equal(rounded, x.to(fp8).float().clamp(-limit, limit))
    assert torch.equal(to_cache_dtype(x, F32), x)


def test_setting_names_its_choices_and_doubles_the_tokens_of_a_budget(tiny_model):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, fp8, fp8_e4m3, fp8_e5m2"):
        EngineConfig(model="m", kv_cache_dtype="int4")
    assert EngineConfig(model="m", dtype="bfloat16", kv_cache_dtype="fp8_e5m2").kv_torch_dtype == E5M2
    assert EngineConfig(model="m", dtype="float32").kv_torch_dtype == F32
    blocks = {}
    for dtype, kv in (("bfloat16", "auto"), ("bfloat16", "fp8"), ("float32", "fp8_e5m2")):
        llm = LLM(str(tiny_model), dtype=dtype, device="cpu", kv_cache_memory=8 << 20, kv_cache_dtype=kv)
        runner = model_runner(llm)
        blocks[dtype, kv] = runner.num_blocks
        assert all(t.dtype == (BF16 if kv == "auto" else runner.kv_dtype) for layer in runner.kv_cache for t in layer)
    assert blocks["bfloat16", "fp8"] == 2 * blocks["bfloat16", "auto"] == blocks["float32", "fp8_e5m2"]


def test_e4m3_is_refused_on_gpus_whose_kernels_cannot_widen_it(monkeypatch):
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    refusal = r"fp8 \(e4m3\) needs a GPU of compute capability 8.9 or later, this one is 8.0: use .* fp8_e5m2"
    with pytest.raises(ValueError, match=refusal):
        check_kv_cache_dtype(E4M3, gpu)
    check_kv_cache_dtype(E5M2, gpu)
    check_kv_cache_dtype(E4M3, torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_kv_cache_dtype(E4M3, gpu)


@pytest.mark.parametrize("kv, narrow", [("fp8", E4M3), ("bfloat16", BF16)])
def test_latent_attention_over_a_narrow_cache_runs_on_the_cpu_backend_as_in_torch(tiny_model_factory, kv, narrow):
    """DeepSeek's latent rows in an fp8 or bf16 cache under an fp32 model: the CPU backend (decode over widened
    rows) computes what the torch backend does."""
    path = str(tiny_model_factory("deepseek-v3"))
    runs = [LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=48, attention_backend=backend,
                kv_cache_dtype=kv) for backend in ("cpu", "torch")]
    prompts = mixed_prompts(runs[0], repeats=(1, 4))
    cpu, torch_ = (llm.generate(prompts, GREEDY) for llm in runs)
    assert model_runner(runs[0]).kv_cache[0][0].dtype == narrow
    for a, b in zip(cpu, torch_, strict=True):
        assert a.token_ids == b.token_ids and max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


@FP8
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_the_op_widens_every_code_exactly(kernels, fp8, dtype, head_dim):
    """Rows of one key: the output is that key's value row, so it must be the code's value exactly (fp32 rows
    through the portable path, bf16 ones through the AMX tiles where the CPU has them)."""
    values = every_code(fp8).repeat(8 * head_dim // 256 + 1)[:8 * head_dim].view(4, 1, 2, head_dim)
    v_cache = values.repeat_interleave(16, 1)  # 4 blocks of 16 rows; each table reads row 0 of its block
    k_cache = to_cache_dtype(torch.ones_like(v_cache, dtype=F32), fp8)
    q = torch.ones(4, 6, head_dim, dtype=dtype)
    tables = torch.arange(4, dtype=torch.int32)[:, None]
    for amx in (False, None):
        out = ops.paged_decode_attention(q, k_cache, v_cache, tables, torch.ones(4, dtype=torch.int32), 0.1, amx=amx)
        expected = values[:, 0].float().repeat_interleave(3, 1).to(dtype)
        assert torch.equal(out, expected)


@FP8
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group, head_dim, window, softcap", [(3, 64, None, None), (8, 128, None, None),
                                                              (5, 72, 100, None), (3, 32, 37, 2.0)])
def test_fp8_rows_compute_what_their_widened_values_do(kernels, fp8, dtype, group, head_dim, window, softcap):
    """The op over fp8 caches is bit for bit the op over the same values in q's dtype (on and off the AMX
    tiles), and as good as torch's path against fp64."""
    step = decode_step(dtype, group, head_dim, kv_heads=1 if group == 8 else 2, freed_before=window)
    k_cache, v_cache = (random_fp8(step.k_cache.shape, fp8, seed) for seed in (1, 2))
    narrow = DecodeStep(step.q, k_cache, v_cache, step.tables, step.context_lens)
    wide = DecodeStep(step.q, k_cache.to(dtype), v_cache.to(dtype), step.tables, step.context_lens)
    scale = head_dim ** -0.5
    for amx in (False, None):
        ours = ops.paged_decode_attention(narrow.q, k_cache, v_cache, step.tables, step.context_lens, scale, window,
                                          softcap, amx=amx)
        assert torch.equal(ours, ops.paged_decode_attention(wide.q, wide.k_cache, wide.v_cache, step.tables,
                                                            step.context_lens, scale, window, softcap, amx=amx))
    assert_as_good_as_torch(fused(kernels, narrow, scale, window, softcap), torch_path(narrow, scale, window, softcap),
                            fp64_decode(wide, scale, window, softcap), dtype)


def test_the_op_takes_q_s_dtype_or_fp8_caches_only(kernels):
    step = decode_step(F32, 3, 64, contexts=[5, 40])
    with pytest.raises(RuntimeError, match="must hold q's dtype, fp8"):
        kernels.paged_decode_attention(step.q, step.k_cache.half(), step.v_cache.half(), step.tables,
                                       step.context_lens, 0.125)


def random_cache(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    if dtype in (E4M3, E5M2):
        return random_fp8(shape, dtype, seed)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def prefix_step(narrow: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A step of four fp32 sequences in a narrower cache (fp8, or bf16; blocks out of order): two with cached
    prefixes, one without, one decoding; its new K/V stored as the attention layer stores them, and given as the
    cache holds them."""
    gen = torch.Generator().manual_seed(7)
    query_lens, context_lens = [9, 1, 20, 4], [9 + 35, 30, 20, 4 + 16]
    q, k, v = (torch.randn(sum(query_lens), h, 64, generator=gen) for h in (6, 2, 2))
    k_cache, v_cache = (random_cache((12, 16, 2, 64), narrow, seed) for seed in (3, 4))
    tables = torch.tensor([[7, 2, 9, 4], [3, 10, -1, -1], [5, 1, -1, -1], [11, 0, -1, -1]], dtype=torch.int32)
    slots = [int(tables[i, p // 16]) * 16 + p % 16 for i, (n, c) in enumerate(zip(query_lens, context_lens))
             for p in range(c - n, c)]
    meta = AttentionMetadata(cu_seqlens_q=torch.tensor([0, 9, 10, 30, 34], dtype=torch.int32),
                             cu_seqlens_k=torch.tensor([0, 44, 74, 94, 114], dtype=torch.int32),
                             context_lens=torch.tensor(context_lens, dtype=torch.int32), max_seqlen_q=20,
                             max_seqlen_k=44, slot_mapping=torch.tensor(slots), block_tables=tables,
                             query_lens=query_lens, context_lens_list=context_lens)
    CpuAttentionBackend().store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return q, as_stored(k, narrow), as_stored(v, narrow), k_cache, v_cache, meta


@pytest.mark.parametrize("narrow", [E4M3, E5M2, BF16], ids=["e4m3", "e5m2", "bf16"])
def test_prefill_over_a_narrow_prefix_matches_torch(kernels, narrow, monkeypatch):
    """The decoding sequence goes to the decode op alone; the prefill op reads the others' prefixes' blocks
    widened. Torch's path gathers each whole context from the cache."""
    if F32 not in ops.usable_dtypes():
        pytest.skip("the prefill op does not run fp32 here")
    q, k, v, k_cache, v_cache, meta = prefix_step(narrow)
    decoded, decode = [], ops.paged_decode_attention
    monkeypatch.setattr(ops, "paged_decode_attention", lambda q, *a: decoded.append(len(q)) or decode(q, *a))
    ours = CpuAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.125)
    theirs = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.125)
    assert decoded == [1] and (ours - theirs).abs().max() < 1e-4 * theirs.abs().max()


def test_decode_steps_over_fp8_run_the_op(kernels, monkeypatch):
    step = decode_step(BF16, 3, 64, contexts=[3, 70, 300], seed=3)
    k_cache, v_cache = (to_cache_dtype(c, E4M3) for c in (step.k_cache, step.v_cache))
    meta = AttentionMetadata(cu_seqlens_q=torch.arange(4, dtype=torch.int32),
                             cu_seqlens_k=torch.tensor([0, 3, 73, 373], dtype=torch.int32),
                             context_lens=step.context_lens, max_seqlen_q=1, max_seqlen_k=300,
                             slot_mapping=torch.zeros(3, dtype=torch.int64), block_tables=step.tables,
                             query_lens=[1, 1, 1], context_lens_list=[3, 70, 300])
    calls = []
    monkeypatch.setattr(ops, "paged_decode_attention", lambda *a, **k: calls.append(a[1].dtype) or torch.zeros(1))
    CpuAttentionBackend().forward(step.q, None, None, k_cache, v_cache, meta, 0.125)
    assert calls == [E4M3]


def hf_with_rounded_kv(path: str, fp8: torch.dtype):
    """transformers' eager attention over K (after rotary) and V rounded as the cache rounds them."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward

    def rounded(module, query, key, value, *args, **kwargs):
        return eager_attention_forward(module, query, as_stored(key, fp8), as_stored(value, fp8), *args, **kwargs)

    name = f"batchgen_{str(fp8).removeprefix('torch.')}"
    AttentionInterface.register(name, rounded)
    AttentionMaskInterface.register(name, eager_mask)  # else transformers builds no causal mask for it
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=name).eval()


@torch.inference_mode()
def reference(model, prompt: list[int], completion: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens after the prompt, and the log-probabilities of ``completion``."""
    ids = torch.tensor([prompt + completion])
    logprobs = model(ids).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
    return logprobs.argmax(-1).tolist(), logprobs.gather(1, torch.tensor(completion)[:, None]).squeeze(1).tolist()


@pytest.mark.parametrize("kv, fp8, apart_at_least", [("fp8", E4M3, 1e-2), ("fp8_e5m2", E5M2, 1e-2),
                                                     ("bfloat16", BF16, 1e-3)])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_model_matches_transformers_with_k_and_v_rounded_alike(tiny_model, kv, fp8, apart_at_least, backend):
    """Chunked prefill (a cached prefix), mixed and decode steps of an fp32 model: the engine's logprobs are
    those of transformers with K and V rounded to fp8 (or bf16), and not those of the unrounded model."""
    hf = hf_with_rounded_kv(str(tiny_model), fp8)
    plain = LLM(str(tiny_model), dtype="float32", device="cpu", max_num_batched_tokens=48, attention_backend=backend)
    llm = LLM(str(tiny_model), dtype="float32", device="cpu", max_num_batched_tokens=48, attention_backend=backend,
              kv_cache_dtype=kv)
    prompts = mixed_prompts(llm)
    outs, unrounded = llm.generate(prompts, GREEDY), plain.generate(prompts, GREEDY)
    assert len(outs) == len(unrounded) == len(prompts)
    apart = 0.0
    for prompt, out, other in zip(prompts, outs, unrounded):
        greedy, logprobs = reference(hf, prompt, out.token_ids)
        assert out.token_ids == greedy
        assert len(logprobs) == len(out.logprobs) and max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) <= 1e-3
        apart = max([apart, *(abs(a - b) for a, b in zip(out.logprobs, other.logprobs))])
    assert apart > apart_at_least, "the narrower cache changed nothing: is the setting applied?"


@pytest.mark.parametrize("kv, other", [("fp8", "float32"), ("bfloat16", "bfloat16")], ids=["fp8", "bf16"])
def test_the_prefix_store_reuses_narrow_blocks_and_keeps_them_apart(tiny_model, tmp_path, kv, other):
    """A second fp32 job with a narrower cache loads the first one's blocks and computes what it would have. An
    engine whose blocks hold other bytes finds none of them: an fp32 cache beside fp8; beside a bf16 cache under
    fp32, a bf16 model's (also bf16). The KV dtype, and the model's where they differ, name the namespace."""
    from tests.test_kv_store import assert_same, jobs, run

    store = str(tmp_path / "kv")
    first, second = jobs(LLM(str(tiny_model), dtype="float32", device="cpu").tokenizer)
    run(tiny_model, first, prefix_cache_store=store, kv_cache_dtype=kv)
    cold, _ = run(tiny_model, second, kv_cache_dtype=kv)
    hot, metrics = run(tiny_model, second, prefix_cache_store=store, kv_cache_dtype=kv)
    assert_same(hot, cold)
    assert metrics.prefix_cache_store_hits > 0 and metrics.prefix_store_misses_corrupt == 0
    _, others = run(tiny_model, second, dtype=other, prefix_cache_store=store)
    assert others.prefix_cache_store_hits == 0
    assert len([p for p in (tmp_path / "kv").iterdir() if p.is_dir()]) == 2


@FP8
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_the_cpu_store_writes_the_bytes_torch_would(kernels, fp8, dtype):
    """Values past the format's range, subnormal ones, ties and a row width with a scalar tail (3 x 24); slots
    of -1 (padding) write nothing."""
    gen = torch.Generator().manual_seed(9)
    k, v = (torch.randn(40, 3, 24, generator=gen).mul(torch.logspace(-7, 5, 40)[:, None, None]).to(dtype)
            for _ in range(2))
    k[0, 0, :4] = torch.tensor([1e6, -1e6, 448.0, 57344.0])
    caches = [random_fp8((8, 16, 3, 24), fp8, seed) for seed in (5, 6)]
    before = [c.clone() for c in caches]
    slots = torch.randperm(128, generator=gen)[:40]
    slots[3] = -1
    if dtype not in ops.usable_dtypes():  # bf16 without AVX-512: the op declines, and the caller stores in torch
        assert not ops.store_kv(k, v, *caches, slots)
        assert all(torch.equal(c.view(torch.uint8), b.view(torch.uint8)) for c, b in zip(caches, before, strict=True))
        return
    assert ops.store_kv(k, v, *caches, slots)
    kept = torch.ones(128, dtype=torch.bool)
    kept[slots[slots >= 0]] = False
    for cache, rows, old in zip(caches, (k, v), before, strict=True):
        flat, written = cache.view(128, 3, 24).view(torch.uint8), slots >= 0
        assert torch.equal(flat[slots[written]], to_cache_dtype(rows[written], fp8).view(torch.uint8))
        assert torch.equal(flat[kept], old.view(128, 3, 24).view(torch.uint8)[kept])


@FP8
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_the_cpu_rounding_of_a_step_s_keys_is_torch_s(kernels, fp8, dtype):
    """The CPU backend's as_stored (one pass) against dtype.as_stored, on k as the model makes it: a strided
    view of the fused qkv rows."""
    qkv = torch.randn(50, 15 * 24, generator=torch.Generator().manual_seed(4)).mul(300).to(dtype)
    k = qkv[:, 9 * 24:12 * 24].view(50, 3, 24)
    ours = CpuAttentionBackend().as_stored(k, k, fp8)
    assert all(torch.equal(x, as_stored(k, fp8)) for x in ours)


@FP8
def test_the_cpu_store_rounds_every_tie_and_edge_as_torch(kernels, fp8):
    """Each pair of neighbouring codes' midpoint and the fp32 values either side of it (ties to even, the
    subnormal steps, the largest values), both signs, plus NaN: the bytes torch's cast writes."""
    codes = every_code(fp8).float().unique()
    mid = (codes[:-1] + codes[1:]) / 2
    edges = torch.tensor([torch.nan, 1e-30, -1e-30, 1e-45, 0.0, -0.0, 1e9, -1e9])
    near = torch.cat([edges, mid, mid.nextafter(torch.tensor(-torch.inf)), mid.nextafter(torch.tensor(torch.inf)),
                      codes])
    near = torch.cat([near, -near])
    rows = near[:near.numel() // 48 * 48].view(-1, 2, 24)  # a few of the last codes left out: whole rows only
    caches = [torch.zeros(len(rows), 1, 2, 24).to(fp8) for _ in range(2)]
    assert ops.store_kv(rows, rows, *caches, torch.arange(len(rows)))
    assert torch.equal(caches[0].view(torch.uint8).flatten(), to_cache_dtype(rows, fp8).view(torch.uint8).flatten())
