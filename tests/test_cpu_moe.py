"""The CPU kernels' expert op: the torch reference bit for bit, and mixture-of-experts decode steps it lets replay."""
from __future__ import annotations

import shutil

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.backends.cpu import build, ops
from batchgen.engine.backends.cpu.features import cpu_features
from batchgen.engine.backends.torch.ops import fused_moe
from tests.tiny_models import MLA_ARCHS, MOE_ARCHS


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if cpu_features().isa is None or shutil.which(build.compiler()) is None:
        pytest.skip("no AVX2 CPU or no C++ compiler: the engine runs torch's ops (test_cpu_kernels tests that)")
    assert build.load_kernels(), "the fused CPU kernels failed to build; see the warning above"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_experts,top_k,tokens", [(1, 1, 5), (8, 2, 19), (16, 4, 64), (6, 2, 0)])
def test_expert_op_is_the_torch_reference_bit_for_bit(dtype, num_experts, top_k, tokens):
    gen = torch.Generator().manual_seed(num_experts + tokens)
    x = torch.randn(tokens, 32, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 48, 32, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(num_experts, 32, 24, generator=gen) * 0.2).to(dtype)
    ids = torch.rand(tokens, num_experts, generator=gen).argsort(dim=1)[:, :top_k]
    weights = torch.rand(tokens, top_k, generator=gen)
    got = ops.fused_moe(x, w13, w2, weights, ids)
    assert got.shape == (tokens, 32) and got.dtype == dtype
    assert torch.equal(got, fused_moe(x, w13, w2, weights, ids))
    # -1: a pair another expert-parallel rank computes, which adds nothing here.
    elsewhere = ids.masked_fill(torch.rand(tokens, top_k, generator=gen) < 0.5, -1)
    assert torch.equal(ops.fused_moe(x, w13, w2, weights, elsewhere, skip_negative=True),
                       fused_moe(x, w13, w2, weights, elsewhere, skip_negative=True))


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
