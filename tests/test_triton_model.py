"""The whole model on the Triton kernel set (under TRITON_INTERPRET=1 on CPU) matches the torch backend."""
from __future__ import annotations

import os

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.backends.select import default_backend
from tests.engine_helpers import mixed_prompts, model_runner

pytest.importorskip("triton")
pytestmark = pytest.mark.slow
# Under the interpreter the kernels run on CPU tensors; compiled, they need the GPU.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"


# q/k norm, GQA 2:1; with experts in layers 1-2; soft caps, GeGLU and local/global layers; windows on
# every layer, whose out-of-window blocks are freed (-1 in the block table) as sequences run; latent
# attention (absorbed decode, expanded prefill).
@pytest.mark.parametrize("arch", ["qwen3", "qwen3-moe", "gemma2", "phi3", "deepseek-v3"])
def test_triton_backend_matches_torch_logprobs(tiny_model_factory, arch):
    path = str(tiny_model_factory(arch))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=True)
    kw = dict(dtype="float32", device=DEVICE, max_num_batched_tokens=40, kv_cache_memory=8 << 20)
    torch_llm = LLM(path, attention_backend="torch", **kw)
    triton_llm = LLM(path, attention_backend="triton", **kw)
    prompts = mixed_prompts(torch_llm, repeats=(1, 2))
    assert max(map(len, prompts)) > 40, "needs a chunked prefill that reads a cached prefix"
    expected = torch_llm.generate(prompts, params)
    got = triton_llm.generate(prompts, params)
    assert triton_llm.engine.executor.runner.kernels.attention.name != "torch"
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-3


def test_backend_choice():
    assert default_backend(torch.device("cpu")) == "cpu"  # the fused C++ kernels, or torch where they cannot build
    assert default_backend(torch.device("cuda")) == "triton"


def graphed_and_eager(path: str, repeats: tuple[int, ...], max_tokens: int):
    """The same prompts through the engine with emulated CUDA-graph steps and eagerly; the outputs must
    agree. Returns the graph runner."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=True)
    kw = dict(dtype="float32", device=DEVICE, max_num_batched_tokens=40, max_num_seqs=4,
              kv_cache_memory=8 << 20, attention_backend="triton")
    eager = LLM(path, cuda_graphs="off", **kw)
    graphed = LLM(path, cuda_graphs="emulate", **kw)
    prompts = mixed_prompts(eager, repeats=repeats)
    expected = eager.generate(prompts, params)
    got = graphed.generate(prompts, params)
    assert len(got) == len(expected) == len(prompts)
    for a, b in zip(got, expected):
        assert a.token_ids == b.token_ids
        assert len(a.logprobs) == len(b.logprobs)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-4
    return model_runner(graphed).graphs


@pytest.mark.filterwarnings("ignore:overflow encountered")  # padded rows hold uninitialized values
# Layer 0 dense, layers 1-2 with experts: padded tokens go through both kinds of MLP.
@pytest.mark.parametrize("arch", ["qwen3-moe"])
def test_padded_graph_steps_match_eager(tiny_model_factory, arch):
    """The fixed-shape steps CUDA graphs replay (padded batch, padded tokens, padded sequences),
    run here without capture, give the eager engine's tokens and logprobs."""
    # 5 prompts > max_num_seqs
    runner = graphed_and_eager(str(tiny_model_factory(arch)), repeats=(1, 2, 1, 3, 1), max_tokens=4)
    assert runner.decode_sizes == [1, 2, 4] and runner.mixed_sizes == [16, 32, 40]
    kinds = {kind for kind, _ in runner.replays}
    assert kinds == {"decode", "mixed"}, runner.replays
    padded = [size for (kind, size) in runner.replays if kind == "mixed"]
    assert any(size in (16, 32) for size in padded), "expected a step padded to a smaller graph"


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_latent_attention_replays_decode_steps_only(tiny_model_factory):
    """MLA sizes a prefill's expansion on the host: its mixed steps run eagerly, its decode steps replay."""
    runner = graphed_and_eager(str(tiny_model_factory("deepseek-v3")), repeats=(1, 2), max_tokens=3)
    assert runner.decode_sizes == [1, 2, 4] and runner.mixed_sizes == []
    assert {kind for kind, _ in runner.replays} == {"decode"}


def test_graph_modes_need_triton(tiny_model_factory):
    with pytest.raises(ValueError, match="needs attention_backend='triton'"):
        LLM(str(tiny_model_factory("qwen3")), device="cpu", attention_backend="torch", cuda_graphs="emulate")
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        LLM(str(tiny_model_factory("qwen3")), device="cpu", cuda_graphs="yes")


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(),
                    reason="needs a CUDA device with compiled Triton kernels")
def test_captured_cuda_graphs_match_eager(tiny_model_factory):
    path = str(tiny_model_factory("qwen3"))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True)
    kw = dict(dtype="float32", device="cuda", max_num_batched_tokens=64, max_num_seqs=8)
    eager = LLM(path, cuda_graphs="off", **kw)
    graphed = LLM(path, cuda_graphs="auto", **kw)
    prompts = mixed_prompts(eager, repeats=(1, 4, 2, 1, 3))
    expected = eager.generate(prompts, params)
    got = graphed.generate(prompts, params)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.token_ids == b.token_ids
        assert len(a.logprobs) == len(b.logprobs)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-3
    assert {kind for kind, _ in graphed.engine.executor.runner.graphs.replays} == {"decode", "mixed"}


@pytest.mark.filterwarnings("ignore:overflow encountered")  # padded rows hold uninitialized values
def test_verify_steps_replay_their_graphs(tiny_model_factory, monkeypatch):
    """Drafts verified on the Triton kernel set (attention over the extra query positions, the acceptance
    kernel) keep plain decode's tokens and logprobs. Steps that verify replay the verify graphs (padded to a
    captured token count, every position's logits), run here without capture; a verify step with prompt tokens
    runs eagerly. Plain decode's graphed steps are checked against eager ones above."""
    from batchgen.engine.speculative import speculator as speculator_module

    monkeypatch.setattr(speculator_module, "choose_draft_lengths", lambda rates, caps, *costs: list(caps))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=True)
    llm = LLM(str(tiny_model_factory("qwen3")), dtype="float32", device=DEVICE, max_num_batched_tokens=40,
              max_num_seqs=4, kv_cache_memory=8 << 20, attention_backend="triton", cuda_graphs="emulate",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    engine = llm.engine
    prompts = mixed_prompts(llm, repeats=(3, 1, 2))
    speculator, engine.speculator = engine.speculator, None
    expected = llm.generate(prompts, params)
    runner = model_runner(llm).graphs
    assert runner.verify_sizes == [8, 16] and not any(kind == "verify" for kind, _ in runner.replays)
    engine.speculator = speculator
    engine.reset_metrics()
    got = llm.generate(prompts, params)
    assert any(kind == "verify" for kind, _ in runner.replays), runner.replays  # 4 sequences x (3 drafts + 1)
    assert llm.metrics()["speculative"]["ngram"]["accepted_tokens"] > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for a, b in zip(got, expected, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-4
