"""The CPU kernels' expert op against the torch reference (experts of few rows as close to the exact mixture,
the rest bit for bit), the op over experts packed in dot_linear's blocks, and mixture-of-experts decode steps
they let replay."""
from __future__ import annotations

import shutil

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.backends.cpu import build, ops, prepack, row_methods
from batchgen.engine.backends.cpu.features import cpu_features
from batchgen.engine.backends.torch.ops import fused_moe
from tests.engine_helpers import mixed_prompts, model_runner
from tests.test_cpu_decode import assert_as_good_as_torch
from tests.tiny_models import MLA_ARCHS, MOE_ARCHS


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if cpu_features().isa is None or shutil.which(build.compiler()) is None:
        pytest.skip("no AVX2 CPU or no C++ compiler: the engine runs torch's ops (test_cpu_kernels tests that)")
    assert build.load_kernels(), "the fused CPU kernels failed to build; see the warning above"


def exact_moe(x, w13, w2, weights, ids) -> torch.Tensor:
    """The mixture in float64: each token's experts' SwiGLU outputs, weighted and summed (ids -1 add nothing)."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].tolist(), strict=True):
            if e >= 0:
                gate, up = (w13[e].double() @ x[t].double()).chunk(2)
                out[t] += w * (w2[e].double() @ (torch.nn.functional.silu(gate) * up))
    return out


def expert_case(num_experts, top_k, tokens, hidden, inter, dtype):
    gen = torch.Generator().manual_seed(num_experts + tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * 0.2).to(dtype)
    ids = torch.rand(tokens, num_experts, generator=gen).argsort(dim=1)[:, :top_k]
    weights = torch.rand(tokens, top_k, generator=gen)
    elsewhere = ids.masked_fill(torch.rand(tokens, top_k, generator=gen) < 0.5, -1)
    return x, w13, w2, weights, ids, elsewhere


# An expert of more rows than these multiplies as the reference does: csrc/small_linear.h's kSmallRows for fp32,
# csrc/moe.cpp's kFewRows for bf16.
FEW_ROWS = {torch.float32: row_methods.SMALL_ROWS, torch.bfloat16: 128}
# (experts, top_k, tokens, hidden, intermediate): inter 24 leaves bf16's second matmul off the dot tiles' 32-dim
# steps (and fp32's K past its last whole vector); 64 / 32 put both on them; 300 tokens of 2 experts give an
# expert more rows than bf16's few-row tiles take, 700 more than fp32's small-row op takes.
SHAPES = [(1, 1, 5, 32, 24), (8, 2, 19, 32, 24), (16, 4, 64, 32, 24), (6, 2, 0, 32, 24), (8, 2, 19, 64, 32),
          (2, 1, 300, 64, 32), (2, 1, 700, 64, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_experts,top_k,tokens,hidden,inter", SHAPES)
def test_expert_op_against_the_torch_reference(dtype, num_experts, top_k, tokens, hidden, inter):
    """As close to the exact mixture as the reference: experts of few rows take the op's own tiles (bf16: where
    the CPU has AVX512-BF16), which sum in another order; an expert of many rows is the reference's matmul."""
    x, w13, w2, weights, ids, elsewhere = expert_case(num_experts, top_k, tokens, hidden, inter, dtype)
    # -1 (skip_negative): a pair another expert-parallel rank computes, which adds nothing here.
    for routed, skip in ((ids, False), (elsewhere, True)):
        got = ops.fused_moe(x, w13, w2, weights, routed, skip_negative=skip)
        theirs = fused_moe(x, w13, w2, weights, routed, skip_negative=skip)
        assert got.shape == (tokens, hidden) and got.dtype == dtype
        rows = torch.bincount(routed[routed >= 0].flatten()).tolist()
        if min((n for n in rows if n), default=FEW_ROWS[dtype] + 1) > FEW_ROWS[dtype]:  # the reference's matmuls
            assert torch.equal(got, theirs)
        else:
            assert_as_good_as_torch(got, theirs, exact_moe(x, w13, w2, weights, routed), dtype)


def test_expert_op_is_bit_identical_across_thread_counts():
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: nothing to compare against")
    cases = [expert_case(8, 2, tokens, 64, inter, dtype) for tokens in (1, 3, 19, 300)
             for dtype in (torch.float32, torch.bfloat16) for inter in (24, 32)]
    previous = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            runs.append([ops.fused_moe(*case[:5]) for case in cases])
    finally:
        torch.set_num_threads(previous)
    for run in runs[1:]:
        for got, expected in zip(run, runs[0], strict=True):
            assert torch.equal(got, expected)


def test_fp32_tokens_results_do_not_depend_on_the_other_tokens():
    """fp32 experts of up to SMALL_ROWS rows sum each row in one order: a token's output in a step of 250 (about
    125 rows an expert) is its output alone, bit for bit, as a verification step's rows must be."""
    x, w13, w2, weights, ids, _ = expert_case(4, 2, 250, 64, 24, torch.float32)
    assert max(torch.bincount(ids.flatten()).tolist()) <= FEW_ROWS[torch.float32]
    together = ops.fused_moe(x, w13, w2, weights, ids)
    alone = [ops.fused_moe(x[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1]) for t in range(len(x))]
    assert len(alone) == together.shape[0]
    for t, row in enumerate(alone):
        assert torch.equal(row[0], together[t]), t


def test_expert_ids_outside_the_experts_are_refused():
    x, w13, w2 = torch.randn(3, 32), torch.randn(6, 48, 32), torch.randn(6, 32, 24)
    weights = torch.rand(3, 2)
    for bad in ([[0, 6], [1, 2], [3, 4]], [[0, -1], [1, 2], [3, 4]]):
        with pytest.raises(RuntimeError, match=r"expert ids must lie in \[0, 6\)"):
            ops.fused_moe(x, w13, w2, weights, torch.tensor(bad))


def generate(folder, mode: str):
    llm = LLM(str(folder), dtype="float32", device="cpu", max_num_seqs=4, cuda_graphs=mode, kv_cache_memory=1 << 22)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 100, (4 + 3 * i,), generator=gen).tolist() for i in range(5)]
    params = [SamplingParams(max_tokens=5 + 4 * i, temperature=0, logprobs=True, ignore_eos=True) for i in range(5)]
    return llm.generate(prompts, params), llm.engine.executor.runner.graphs


@pytest.mark.parametrize("arch", MOE_ARCHS + MLA_ARCHS)
def test_moe_decode_steps_replay_as_they_ran(tiny_model_factory, arch):
    folder = tiny_model_factory(arch)
    eager, none = generate(folder, "off")
    replayed, replays = generate(folder, "auto")
    assert none is None and replays is not None and replays.refused is None
    assert sum(replays.replays.values()) >= 10 and replays.recordings
    assert len(eager) == len(replayed) == 5
    for a, b in zip(eager, replayed):
        assert a.token_ids == b.token_ids
        assert len(a.logprobs) == len(b.logprobs) and a.logprobs == b.logprobs


def needs_dot_tiles():
    if not prepack.dot_linear_runs():
        pytest.skip("no AVX512-BF16 dot tiles here (or an AMX CPU): bf16 experts stay stacked as loaded")


def packed_moe(x, w13, w2, weights, ids, skip=False):
    return ops.fused_moe_packed(x, *prepack.pack_dot_moe(w13, w2), w2.shape[2], weights, ids, skip_negative=skip)


# (experts, top_k, tokens, hidden, intermediate): 2I and H under one block of 48 columns, past whole blocks (2I
# 80, H 50), on them (2I 96, H 48); K of one pair (inter 2); 800 rows of 2 experts at 4,096 inputs: each expert's
# rows in pieces (384 rows at most) that dot_linear's chunks would make.
PACKED_SHAPES = [(1, 1, 5, 32, 12), (8, 2, 19, 50, 40), (16, 4, 64, 48, 48), (6, 2, 0, 32, 24), (4, 2, 9, 32, 2),
                 (2, 2, 400, 4096, 48)]


@pytest.mark.parametrize("num_experts,top_k,tokens,hidden,inter", PACKED_SHAPES)
def test_packed_experts_against_the_torch_reference(num_experts, top_k, tokens, hidden, inter):
    """As close to the exact mixture as the reference's bf16 matmuls, skipped pairs (-1) adding nothing."""
    needs_dot_tiles()
    x, w13, w2, weights, ids, elsewhere = expert_case(num_experts, top_k, tokens, hidden, inter, torch.bfloat16)
    for routed, skip in ((ids, False), (elsewhere, True)):
        got = packed_moe(x, w13, w2, weights, routed, skip)
        assert got.shape == (tokens, hidden) and got.dtype == torch.bfloat16
        theirs = fused_moe(x, w13, w2, weights, routed, skip_negative=skip)
        if tokens:
            assert_as_good_as_torch(got, theirs, exact_moe(x, w13, w2, weights, routed), torch.bfloat16)


def test_packed_experts_are_bit_identical_across_thread_counts_and_refuse_bad_shapes():
    needs_dot_tiles()
    cases = [expert_case(8, 2, tokens, 64, inter, torch.bfloat16) for tokens in (1, 3, 19, 300) for inter in (24, 40)]
    previous = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, max(2, previous), 1):
            torch.set_num_threads(threads)
            runs.append([packed_moe(*case[:5]) for case in cases])
    finally:
        torch.set_num_threads(previous)
    assert len(runs) == 3 and all(len(run) == len(cases) for run in runs)
    for run in runs[1:]:
        for got, expected in zip(run, runs[0], strict=True):
            assert torch.equal(got, expected)
    x, w13, w2, weights, ids, _ = cases[0]
    p13, p2 = prepack.pack_dot_moe(w13, w2)
    with pytest.raises(RuntimeError, match="packed experts must be"):
        ops.fused_moe_packed(x, p13, p2, 26, weights, ids)  # not the intermediate size they were packed with
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.fused_moe_packed(x.float(), p13, p2, 24, weights, ids)
    with pytest.raises(RuntimeError, match=r"expert ids must lie in \[0, 8\)"):
        ops.fused_moe_packed(x, p13, p2, 24, weights, ids + 8)


@pytest.mark.parametrize("arch", ["qwen2-moe", "deepseek-v3"])
def test_bf16_engines_pack_their_experts(tiny_model_factory, arch):
    """A bf16 MoE model's experts (and DeepSeek's absorbed W_UK, W_UV) in dot_linear's blocks: its tokens' first
    logprobs as the torch backend's (bf16 rounding apart), and its decode steps replayed."""
    needs_dot_tiles()
    kw = dict(dtype="bfloat16", device="cpu", max_num_seqs=4, max_num_batched_tokens=512, kv_cache_memory=8 << 20)
    folder = tiny_model_factory(arch)
    packed, plain = LLM(str(folder), **kw), LLM(str(folder), attention_backend="torch", **kw)
    layers = [m for m in model_runner(packed).model.modules() if getattr(m, "quant_method", None) is
              prepack.DOT_EXPERTS_METHOD]
    assert layers and all(m.gate_up_proj.dim() == 5 for m in layers)
    latent = [m for m in model_runner(packed).model.modules() if hasattr(m, "absorbed")]
    assert all(isinstance(m.absorbed, prepack.DotAbsorbedProducts) for m in latent)
    assert bool(latent) == (arch == "deepseek-v3")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True)
    prompts = mixed_prompts(packed, repeats=(1, 3, 2, 4))
    a, b = packed.generate(prompts, params), plain.generate(prompts, params)
    assert len(a) == len(b) == len(prompts)
    first = [(x.logprobs[0], y.logprobs[0]) for x, y in zip(a, b, strict=True)]
    assert max(abs(p - q) for p, q in first) <= 0.1, first
    replays = model_runner(packed).graphs
    assert replays is not None and replays.refused is None and sum(replays.replays.values()) > 0
