"""The whole model on the Triton kernel set (under TRITON_INTERPRET=1 on CPU) matches the torch backend."""
from __future__ import annotations

import pytest

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.layers.ops import default_backend
from tests.engine_helpers import mixed_prompts

pytest.importorskip("triton")
pytestmark = pytest.mark.slow


def test_triton_backend_matches_torch_logprobs(tiny_model_factory):
    path = str(tiny_model_factory("qwen3"))  # q/k norm, GQA 2:1
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=True)
    kw = dict(dtype="float32", device="cpu", max_num_batched_tokens=40, kv_cache_memory=8 << 20)
    torch_llm = LLM(path, attention_backend="torch", **kw)
    triton_llm = LLM(path, attention_backend="triton", **kw)
    prompts = mixed_prompts(torch_llm, repeats=(1, 2))
    assert max(map(len, prompts)) > 40, "needs a chunked prefill that reads a cached prefix"
    expected = torch_llm.generate(prompts, params)
    got = triton_llm.generate(prompts, params)
    assert triton_llm.engine.runner.kernels.attention.name != "torch"
    for a, b in zip(got, expected):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-3


def test_backend_choice():
    import torch

    assert default_backend(torch.device("cpu")) == "torch"
    assert default_backend(torch.device("cuda")) == "triton"
