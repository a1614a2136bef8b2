"""The fused CPU kernels: attention against fp64 and torch's SDPA, elementwise ops against torch, fallbacks."""
from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.backends.cpu import build, ops
from batchgen.engine.backends.cpu.features import cpu_features
from batchgen.engine.backends.interface import AttentionMetadata
from batchgen.engine.backends.select import make_kernel_set
from batchgen.engine.backends.torch import ops as torch_ops
from batchgen.engine.backends.torch.attention import TorchAttentionBackend
from batchgen.engine.layers.rotary import cos_sin_cache
from tests.engine_helpers import mixed_prompts, model_runner

ROOT = Path(__file__).resolve().parents[1]
F32, BF16 = torch.float32, torch.bfloat16
LENGTHS = [1, 17, 255, 1000, 2000]
PREFIXES = [40, 300, 16, 5, 0]  # cached tokens before each sequence's new ones (block size 16)
BLOCK = 16


@pytest.fixture(scope="module")
def kernels():
    if cpu_features().isa is None or shutil.which(build.compiler()) is None:
        pytest.skip("no AVX2 CPU or no C++ compiler: the engine runs torch's ops (tested below)")
    assert build.load_kernels(), "the fused CPU kernels failed to build; see the warning above"
    assert ops.usable_dtypes() >= {F32} and (BF16 in ops.usable_dtypes()) == cpu_features().avx512
    return ops


def attention_step(dtype, group: int, head_dim: int, prefixes: list[int], seed: int = 0):
    """A packed step over LENGTHS with cached prefixes, laid out as the engine does: q/k/v are views of one
    fused qkv; the caches hold every sequence's prefix and new keys in shuffled blocks. Values are
    bf16-representable, so the fp32 and bf16 steps hold the same numbers and share one fp64 reference."""
    kv_heads = 2 if group == 1 else 1
    heads = group * kv_heads
    gen = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    qkv = torch.randn(total, (heads + 2 * kv_heads) * head_dim, generator=gen).bfloat16().to(dtype)
    q, k, v = (x.view(total, -1, head_dim) for x in qkv.split([heads * head_dim] + [kv_heads * head_dim] * 2, -1))
    ctx = [n + p for n, p in zip(LENGTHS, prefixes)]
    per_seq = [-(-c // BLOCK) for c in ctx]
    order = torch.randperm(sum(per_seq), generator=gen)  # physical blocks in no particular order
    tables = torch.full((len(ctx), max(per_seq)), -1, dtype=torch.int32)
    start = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = order[start:start + n]
        start += n
    shape = (sum(per_seq), BLOCK, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).bfloat16().to(dtype) for _ in range(2))
    slots = torch.cat([tables[i].long().repeat_interleave(BLOCK)[p:c] * BLOCK + torch.arange(p, c) % BLOCK
                       for i, (p, c) in enumerate(zip(prefixes, ctx))])
    TorchAttentionBackend().store_kv(k, v, k_cache, v_cache, slots)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(cu_seqlens_q=cu, cu_seqlens_k=cu, context_lens=torch.tensor(ctx, dtype=torch.int32),
                             max_seqlen_q=max(LENGTHS), max_seqlen_k=max(ctx), slot_mapping=slots,
                             block_tables=tables, query_lens=list(LENGTHS), context_lens_list=ctx)
    return q, k, v, k_cache, v_cache, meta


# The fp64 reference costs most of these tests, so it covers every 4th query row and each sequence's last.
ROW_STRIDE = 4


def checked_rows(meta: AttentionMetadata) -> torch.Tensor:
    ends = meta.cu_seqlens_q[1:].long() - 1
    return torch.cat([torch.arange(0, int(ends[-1]) + 1, ROW_STRIDE), ends]).unique()


@functools.lru_cache(maxsize=None)
def exact_attention(group: int, head_dim: int, cached: bool) -> torch.Tensor:
    q, _, _, k_cache, v_cache, meta = attention_step(F32, group, head_dim, PREFIXES if cached else [0] * len(LENGTHS))
    return fp64_attention(q, k_cache, v_cache, meta, head_dim ** -0.5, checked_rows(meta))


def fp64_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax attention in float64 from the caches (which hold every key) for query ``rows``
    (default all), sequence by sequence."""
    rows = torch.arange(q.shape[0]) if rows is None else rows
    out = torch.empty(len(rows), *q.shape[1:], dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    starts = meta.cu_seqlens_q.tolist()
    for i, ctx in enumerate(meta.context_lens_list):
        n = meta.query_lens[i]
        picked = ((rows >= starts[i]) & (rows < starts[i] + n)).nonzero().flatten()
        local = rows[picked] - starts[i]
        blocks = meta.block_tables[i, :-(-ctx // BLOCK)].long()
        keys, values = (c[blocks].flatten(0, 1)[:ctx].double().repeat_interleave(group, 1).transpose(0, 1)
                        for c in (k_cache, v_cache))
        queries = q[starts[i] + local].double().transpose(0, 1)
        scores = queries @ keys.transpose(1, 2) * scale
        mask = torch.arange(ctx)[None, :] <= (local + ctx - n)[:, None]
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out[picked] = (probs @ values).transpose(0, 1)
    return out


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("cached", [False, True], ids=["fresh", "cached-prefix"])
def test_attention_against_fp64_and_sdpa(kernels, dtype, head_dim, group, cached):
    if dtype not in kernels.usable_dtypes():
        pytest.skip(f"{dtype} runs through torch on this CPU")
    prefixes = PREFIXES if cached else [0] * len(LENGTHS)
    q, k, v, k_cache, v_cache, meta = attention_step(dtype, group, head_dim, prefixes)
    scale = head_dim ** -0.5
    fused = kernels.varlen_causal_attention(q, k, v, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens,
                                            meta.block_tables, scale)
    sdpa = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, scale)
    rows, exact = checked_rows(meta), exact_attention(group, head_dim, cached)
    assert fused.shape == sdpa.shape == q.shape and fused.dtype == dtype and exact.shape[0] == len(rows)
    fused_err, sdpa_err = (fused[rows].double() - exact).abs(), (sdpa[rows].double() - exact).abs()
    # As good as SDPA: the same worst error up to a rounding step of the dtype, and a mean error within a quarter
    # of SDPA's (on AVX2 the 8-lane sums round in another order than oneDNN's: fp32 means differ by up to ~10 %).
    ulp = torch.finfo(dtype).eps * exact.abs().max().item()
    assert fused_err.max() <= sdpa_err.max() + ulp, (fused_err.max(), sdpa_err.max())
    assert fused_err.mean() <= 1.25 * sdpa_err.mean(), (fused_err.mean(), sdpa_err.mean())


@pytest.mark.parametrize("blocks", sorted(set(ops.VARLEN_BLOCKS.values())), ids=lambda b: f"{b[0]}x{b[1]}")
def test_attention_key_blocks_of_every_cpu_kind(kernels, blocks):
    """Each vector level's key and query blocks (whichever this CPU picks by default) against fp64, fp32."""
    q, k, v, k_cache, v_cache, meta = attention_step(F32, 3, 64, PREFIXES)
    fused = kernels.varlen_causal_attention(q, k, v, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens,
                                            meta.block_tables, 0.125, kv_block=blocks[0], q_rows=blocks[1])
    sdpa = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.125)
    rows, exact = checked_rows(meta), exact_attention(3, 64, True)
    assert exact.shape[0] == len(rows)
    fused_err, sdpa_err = (fused[rows].double() - exact).abs(), (sdpa[rows].double() - exact).abs()
    assert fused_err.max() <= sdpa_err.max() + torch.finfo(F32).eps * exact.abs().max().item()
    assert fused_err.mean() <= 1.25 * sdpa_err.mean(), (fused_err.mean(), sdpa_err.mean())


def test_attention_rejects_mismatched_inputs(kernels):
    q, k, v, k_cache, v_cache, meta = attention_step(F32, 3, 64, [0] * len(LENGTHS))
    with pytest.raises(RuntimeError, match="share one dtype"):
        kernels.varlen_causal_attention(q, k.bfloat16(), v, k_cache, v_cache, meta.cu_seqlens_q,
                                        meta.context_lens, meta.block_tables, 0.125)
    with pytest.raises(RuntimeError, match="context_lens must be >= query lengths"):
        kernels.varlen_causal_attention(q, k, v, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens - 2,
                                        meta.block_tables, 0.125)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_elementwise_ops_against_torch(kernels, dtype):
    if dtype not in kernels.usable_dtypes():
        pytest.skip(f"{dtype} runs through torch on this CPU")
    gen = torch.Generator().manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    def no_worse(ours, theirs, exact):
        ours_err, theirs_err = (ours.double() - exact).abs().max(), (theirs.double() - exact).abs().max()
        assert ours_err <= theirs_err + torch.finfo(dtype).eps * exact.abs().max(), (ours_err, theirs_err)

    x, residual, weight = rand(37, 576), rand(37, 576), 1 + 0.1 * rand(576)
    for res in (None, residual):
        out, new_res = kernels.rms_norm(x, weight, 1e-5, res)
        ref, ref_res = torch_ops.rms_norm(x, weight, 1e-5, res)
        exact = torch_ops.rms_norm(x.double(), weight.double(), 1e-5, None if res is None else res.double())[0]
        if res is None:
            assert new_res is None
            no_worse(out, ref, exact)
        else:
            assert torch.equal(new_res, ref_res)  # the residual stream rounds the sum to the dtype, as torch does
            no_worse(out, ref, torch_ops.rms_norm(ref_res.double(), weight.double(), 1e-5)[0])
    if dtype == BF16:  # every bf16 bit pattern: sums that round halfway, to subnormals, infinities and NaN
        patterns = torch.randint(-(1 << 15), 1 << 15, (2, 64, 576), generator=gen, dtype=torch.int32)
        x_bits, res_bits = patterns.to(torch.int16).view(BF16)
        sums = kernels.rms_norm(x_bits, weight, 1e-5, res_bits)[1]
        expected = (x_bits.float() + res_bits.float()).to(BF16)
        nan = expected.isnan()
        assert nan.any() and (expected.float().abs() < torch.finfo(F32).tiny).logical_and(expected != 0).any()
        assert torch.equal(sums[~nan].view(torch.int16), expected[~nan].view(torch.int16)) and sums[nan].isnan().all()
    heads = rand(37, 9, 64)  # a 3-D view, as the per-head norms of Qwen3 see it
    no_worse(kernels.rms_norm(heads, weight[:64], 1e-6)[0], torch_ops.rms_norm(heads, weight[:64], 1e-6)[0],
             torch_ops.rms_norm(heads.double(), weight[:64].double(), 1e-6)[0])

    qkv = rand(37, 15 * 64)  # q and k are strided views of it, as the model makes them
    table = cos_sin_cache(64, 10000.0, None, 128)
    positions = torch.randint(0, 128, (37,), generator=gen)
    copies = [qkv, qkv.clone(), qkv.double()]
    views = [(t[:, :576].view(37, 9, 64), t[:, 576:768].view(37, 3, 64)) for t in copies]
    kernels.apply_rotary(*views[0], positions, table)
    torch_ops.apply_rotary(*views[1], positions, table)
    torch_ops.apply_rotary(*views[2], positions, table.double())
    no_worse(copies[0][:, :768], copies[1][:, :768], copies[2][:, :768])
    assert torch.equal(copies[0][:, 768:], copies[1][:, 768:])  # v untouched

    gate_up = rand(37, 2 * 1536)
    no_worse(kernels.silu_and_mul(gate_up), torch_ops.silu_and_mul(gate_up), torch_ops.silu_and_mul(gate_up.double()))

    k, v = rand(37, 3, 64), rand(37, 3, 64)
    caches = [torch.zeros(8, 16, 3, 64, dtype=dtype) for _ in range(4)]
    slots = torch.randperm(8 * 16, generator=gen)[:37]
    assert kernels.store_kv(k, v, caches[0], caches[1], slots)
    TorchAttentionBackend().store_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_row_argmax_matches_torch_max_with_ties_nans_and_tails(kernels, dtype):
    if dtype not in kernels.usable_dtypes():
        pytest.skip(f"{dtype} runs through torch on this CPU")
    gen = torch.Generator().manual_seed(2)
    for rows, width in ((1, 49152), (64, 49152), (5, 1), (7, 37), (3, 33)):
        x = torch.randn(rows, width, generator=gen).to(dtype)
        assert torch.equal(kernels.row_argmax(x), x.max(dim=-1).indices), (rows, width)
    x = torch.randn(6, 1000, generator=gen).round().to(dtype)  # many ties: the first index wins
    x[1, 500], x[1, 900] = 9.0, 9.0
    x[2, 999] = 9.0  # in the tail past the last full vector of 32
    x[3, 40], x[3, 10] = float("nan"), float("nan")
    x[4, :] = float("-inf")
    x[5, 3], x[5, 998] = float("inf"), float("nan")
    ours, ref = kernels.row_argmax(x), x.max(dim=-1).indices
    assert ours.tolist() == ref.tolist() and ours[1] == 500 and ours[3] == 10 and ours[5] == 998
    wide = torch.randn(4, 3000, generator=gen).to(dtype)
    assert torch.equal(kernels.row_argmax(wide[:, 7:2000]), wide[:, 7:2000].max(dim=-1).indices)  # strided rows


def test_engine_runs_the_fused_kernels_and_matches_the_torch_backend(kernels, tiny_model, monkeypatch):
    """Chunked prefill, mixed prefill/decode steps and prefix-cache hits all go through the fused op, the
    decode-only steps through the decode op (all their rows in one call per layer)."""
    decode_rows, decode = [], ops.paged_decode_attention
    monkeypatch.setattr(ops, "paged_decode_attention",
                        lambda q, *a, **k: decode_rows.append(len(q)) or decode(q, *a, **k))
    kw = dict(dtype="float32", device="cpu", max_num_batched_tokens=64, kv_cache_memory=16 << 20)
    fused, plain = LLM(str(tiny_model), **kw), LLM(str(tiny_model), attention_backend="torch", **kw)
    assert model_runner(fused).kernels.attention.name == "cpu"
    assert model_runner(plain).kernels.attention.name == "torch"
    shared = fused.tokenizer.encode("Instruction: " + "summarize carefully. " * 12)
    prompts = mixed_prompts(fused) + [shared + fused.tokenizer.encode(f" doc {i}") for i in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True)
    a, b = fused.generate(prompts, params), plain.generate(prompts, params)
    assert len(a) == len(b) == len(prompts)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    diffs = [abs(x - y) for oa, ob in zip(a, b) for x, y in zip(oa.logprobs, ob.logprobs, strict=True)]
    assert max(diffs) <= 1e-4
    assert sum(o.num_cached_tokens for o in a) > 0
    assert decode_rows and max(decode_rows) > 1


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """load_kernels() as on a machine that never built them; the real state comes back afterwards."""
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path))
    build.load_kernels.cache_clear()
    yield
    monkeypatch.undo()
    build.load_kernels.cache_clear()
    build.load_kernels()  # from the real cache again, where the build already is


def test_missing_compiler_falls_back_to_torch_with_one_warning(fresh_build, monkeypatch, caplog, tiny_model):
    monkeypatch.setenv("CXX", str(Path("/nonexistent/bin/c++")))
    with caplog.at_level(logging.WARNING):
        first, second = make_kernel_set("cpu"), make_kernel_set("cpu")
        llm = LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory=4 << 20)
        out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert first.attention.name == second.attention.name == first.mla.name == "torch"
    assert model_runner(llm).kernels.attention.name == "torch" and len(out.token_ids) == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no C++ compiler found" in warnings[0], warnings


def test_failing_build_falls_back(fresh_build, monkeypatch, tmp_path, caplog):
    if cpu_features().isa is None:
        pytest.skip("no AVX2: nothing is built")
    monkeypatch.setenv("CXX", shutil.which("false") or "/bin/false")  # a "compiler" that always fails
    with caplog.at_level(logging.INFO, logger="batchgen.engine.backends.cpu.build"):
        reason = build.build_and_load(cpu_features())
    assert [r.getMessage().split(" (into")[0] for r in caplog.records] == [
        "compiling CPU kernels, about a minute, once"]
    assert reason is not None and reason.startswith("building them in") and str(tmp_path) in reason


@pytest.mark.timeout(120)
def test_a_killed_builds_lock_file_does_not_block_loading(kernels):
    """A process killed while cpp_extension held its lock file leaves the file behind; later processes
    must still load the built kernels rather than wait for it forever."""
    stale = build.build_dir(cpu_features()) / "lock"
    stale.touch()
    try:
        code = "from batchgen.engine.backends.cpu import build; assert build.load_kernels(); print('loaded')"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
        assert done.returncode == 0 and "loaded" in done.stdout, done.stderr
    finally:
        stale.unlink(missing_ok=True)


# A CPU of the other kind, simulated in a fresh process: torch dispatches AVX2 code and oneDNN's
# micro-kernels stop at AVX2 (so bf16 has no fused path); or oneDNN has AVX512-BF16 but no AMX.
SIMULATED = textwrap.dedent("""
    import torch
    from batchgen.engine.backends.cpu import build, ops
    from batchgen.engine.backends.cpu.features import cpu_features
    from batchgen.engine.dtype import resolve_dtype
    from tests.test_cpu_kernels import attention_step, fp64_attention
    assert cpu_features().isa == "{isa}", cpu_features()
    assert build.load_kernels()
    assert ops.usable_dtypes() == {{{dtypes}}}, ops.usable_dtypes()
    print("auto", resolve_dtype("auto", torch.device("cpu")).name)
    for dtype in ops.usable_dtypes():
        q, k, v, kc, vc, meta = attention_step(dtype, 3, 64, [40, 300, 16, 5, 0])
        out = ops.varlen_causal_attention(q, k, v, kc, vc, meta.cu_seqlens_q, meta.context_lens, meta.block_tables, 0.125)
        err = (out.double() - fp64_attention(q, kc, vc, meta, 0.125)).abs().max().item()
        assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), (dtype, err)
    print("ok")
""")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("env, isa, dtypes, auto", [
    ({"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}, "avx2", "torch.float32", "float32"),
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, "avx512", "torch.float32, torch.bfloat16", None),
], ids=["avx2", "avx512-bf16-no-amx"])
def test_other_cpu_kinds(kernels, env, isa, dtypes, auto):
    if not cpu_features().avx512:
        pytest.skip("simulating these needs an AVX-512 CPU")
    script = SIMULATED.format(isa=isa, dtypes=dtypes)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, **env, "PYTHONPATH": str(ROOT)}, timeout=560)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
    if auto:
        assert f"auto {auto}" in result.stdout


def test_prepacked_bf16_linears(kernels, tiny_model):
    from batchgen.engine.backends.cpu.prepack import PrepackedLinear, prepack_linears, prepacking_works
    from batchgen.engine.backends.cpu.row_methods import AMX_ROWS_METHOD, SMALL_ROWS_METHOD
    from batchgen.engine.layers.linear import ColumnParallelLinear, ReplicatedLinear
    from batchgen.engine.layers.moe import TopKRouter

    if not prepacking_works():
        pytest.skip("this CPU has no bf16 weight prepacking (oneDNN needs AVX-512 or AVX-NE-CONVERT)")

    weight, bias = torch.randn(40, 96).to(BF16), torch.randn(40).to(BF16)
    x = torch.randn(3, 7, 96).to(BF16)
    torch.testing.assert_close(PrepackedLinear(weight, bias)(x).float(),
                               torch.nn.functional.linear(x, weight, bias).float(), atol=2e-2, rtol=2e-2)
    bf16_layer, fp32_layer = ReplicatedLinear(8, 8, params_dtype=BF16), ColumnParallelLinear(8, 8)
    router = TopKRouter(8, 4, 2, renormalize=True, params_dtype=BF16)  # its forward also picks experts
    model = torch.nn.Sequential(bf16_layer, fp32_layer, torch.nn.Sequential(torch.nn.Linear(8, 8)), router)
    assert prepack_linears(model) == 2  # fp32: the small-row method (prepacking gains nothing there); not our layers
    assert isinstance(model[0], PrepackedLinear) and model[1] is fp32_layer and model[3] is router
    assert fp32_layer.quant_method is SMALL_ROWS_METHOD
    kw = dict(dtype="bfloat16", device="cpu", max_num_batched_tokens=64, kv_cache_memory=8 << 20)
    fused, plain = LLM(str(tiny_model), **kw), LLM(str(tiny_model), attention_backend="torch", **kw)
    # On AMX CPUs the layers whose shapes amx_linear takes keep their weight and multiply through it instead.
    readied = [m for m in model_runner(fused).model.modules()
               if isinstance(m, PrepackedLinear) or getattr(m, "quant_method", None) is AMX_ROWS_METHOD]
    assert len(readied) > 2
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=True)
    prompts = mixed_prompts(fused)
    a, b = fused.generate(prompts, params), plain.generate(prompts, params)
    assert len(a) == len(b) == len(prompts)
    first = [(x.logprobs[0], y.logprobs[0]) for x, y in zip(a, b)]  # same prefix: bf16 rounding apart
    assert max(abs(p - q) for p, q in first) <= 0.1, first


@pytest.mark.parametrize("arch", ["gemma2", "phi3"])
def test_windowed_and_soft_capped_layers_match_the_torch_backend(kernels, tiny_model_factory, arch):
    """Gemma 2 (soft caps; local layers beside global ones, which the fused op runs) and Phi-3 (a window on
    every layer, freed blocks in the tables) give the torch backend's tokens and logprobs: their prefill goes
    through torch, their decode steps through the fused decode op."""
    path = str(tiny_model_factory(arch))
    kw = dict(dtype="float32", device="cpu", max_num_batched_tokens=48, kv_cache_memory=16 << 20)
    fused, plain = LLM(path, **kw), LLM(path, attention_backend="torch", **kw)
    assert model_runner(fused).kernels.attention.name == "cpu"
    prompts = mixed_prompts(fused, repeats=(1, 4, 2))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=True)
    got, expected = fused.generate(prompts, params), plain.generate(prompts, params)
    for a, b in zip(got, expected, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-4


ROTARY_AFTER_LOAD = textwrap.dedent("""
    import numpy as np, torch
    torch.set_num_threads(2)
    from batchgen.engine.backends.cpu import build
    from batchgen.engine.layers.rotary import cos_sin_cache, rope_inv_freq
    assert build.load_kernels()
    table = cos_sin_cache(64, 100000.0, None, 8192).numpy()
    angles = np.outer(np.arange(8192, dtype=np.float32), rope_inv_freq(64, 100000.0, None).numpy()).astype(np.float64)
    expected = np.concatenate((np.cos(angles), np.sin(angles)), axis=-1).astype(np.float32)
    print(int((table != expected).sum()), float(np.abs(table - expected).max()))
""")


@pytest.mark.timeout(300)
def test_rotary_table_is_right_when_built_just_after_the_kernels_load(kernels):
    """The rotary table is a model's one long-lived transcendental result, built once as the model is made,
    after the CPU kernels load. On an AMX machine torch's threaded fp32 cos, as the first such call after the
    load, returned one thread's half of it up to 1.5e-4 off in 1 of 5-15 fresh processes; the table comes from
    float64 instead: each fresh process's table must be the float64 values rounded once, bit for bit."""
    for _ in range(6):
        done = subprocess.run([sys.executable, "-c", ROTARY_AFTER_LOAD], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert done.returncode == 0, done.stderr
        differing, largest = done.stdout.strip().splitlines()[-1].split()
        assert int(differing) == 0, f"{differing} entries differ, by up to {largest}"
