"""The engine against HF transformers on the same tiny random weights, for every architecture."""
from __future__ import annotations

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from tests.engine_helpers import TEXT, assert_like_hf, hf_greedy, hf_logprobs, mixed_prompts, model_runner
from tests.tiny_models import MLA_ARCHS, MOE_ARCHS

# Architectures with sliding-window layers (all of them, or interleaved with global ones).
WINDOW_ARCHS = ("mistral", "phi3", "gemma2", "gemma3")

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True)


def make_llm(path, **kw) -> LLM:
    # A small token budget forces chunked prefill of the long prompts and mixed prefill/decode steps.
    return LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=kw.pop("budget", 48), **kw)


def test_logprobs_and_greedy_match_hf(tiny_model_any):
    llm = make_llm(tiny_model_any)
    prompts = mixed_prompts(llm)
    assert max(map(len, prompts)) > 48 * 3, "some prompt must need several prefill chunks"
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == hf_greedy(str(tiny_model_any), prompt, 12)
        ref = hf_logprobs(str(tiny_model_any), prompt, out.token_ids)
        assert len(ref) == len(out.logprobs) and max(abs(a - b) for a, b in zip(out.logprobs, ref)) <= 1e-3
        assert out.finish_reason == "length"


def test_language_model_of_a_vision_checkpoint_matches_hf(tiny_model_factory):
    """Gemma3ForConditionalGeneration: the text model's weights under model.language_model, the vision tower
    skipped; transformers runs the whole checkpoint on text alone."""
    path = tiny_model_factory("gemma3-vlm")
    llm = make_llm(path)
    prompts = mixed_prompts(llm, repeats=(1, 3))
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
        assert out.token_ids == hf_greedy(str(path), prompt, 12)
        ref = hf_logprobs(str(path), prompt, out.token_ids)
        assert len(ref) == len(out.logprobs) and max(abs(a - b) for a, b in zip(out.logprobs, ref)) <= 1e-3


def test_sampled_logprobs_are_raw_and_match_hf(tiny_model):
    llm = make_llm(tiny_model)
    prompts = mixed_prompts(llm)
    params = SamplingParams(max_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=3,
                            ignore_eos=True, logprobs=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        ref = hf_logprobs(str(tiny_model), prompt, out.token_ids)
        assert len(ref) == len(out.logprobs) and max(abs(a - b) for a, b in zip(out.logprobs, ref)) <= 1e-3


def test_batched_equals_one_at_a_time(tiny_model_factory):
    path = tiny_model_factory("qwen3")
    llm = make_llm(path)
    prompts = mixed_prompts(llm)
    batched = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert batched == alone


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen2-moe"])
def test_mlp_in_row_chunks_matches_hf(tiny_model_factory, arch):
    """Steps longer than a layer's chunk run the MLP half chunk by chunk (CPU: 2048 rows); here 7 rows, so
    every step of 48 tokens has several chunks and a remainder (Gemma 2: its extra norms per chunk)."""
    path = tiny_model_factory(arch)
    llm = make_llm(path)
    layers = model_runner(llm).model.layers
    for layer in layers:
        layer.chunk_tokens = 7
    prompts = mixed_prompts(llm, repeats=(1, 3))
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
        assert out.token_ids == hf_greedy(str(path), prompt, 12)
        ref = hf_logprobs(str(path), prompt, out.token_ids)
        assert len(ref) == len(out.logprobs) and max(abs(a - b) for a, b in zip(out.logprobs, ref)) <= 1e-3
    assert all(layer.chunk_tokens == 7 for layer in layers)


def test_tiny_kv_budget_preempts_and_gives_identical_output(tiny_model):
    reference = make_llm(tiny_model)
    # Equal-length prompts that fill the cache when admitted; decoding then needs blocks nobody has.
    prompts = [reference.tokenizer.encode(f"{i} " + TEXT * 3)[:60] for i in range(6)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in reference.generate(prompts, params)]
    per_block = reference.engine.executor.kv_layout.bytes_per_block(16, reference.config.torch_dtype)
    small = make_llm(tiny_model, budget=256, kv_cache_memory=per_block * 16, enable_prefix_caching=False)
    got = [o.token_ids for o in small.generate(prompts, params)]
    assert small.engine.metrics.preemptions > 0
    assert got == expected


def test_prefix_cache_reuses_blocks_and_keeps_output(tiny_model):
    cached = make_llm(tiny_model, budget=512)
    plain = make_llm(tiny_model, budget=512, enable_prefix_caching=False)
    shared = cached.tokenizer.encode("Instruction: " + "summarize carefully. " * 20)
    prompts = [shared + cached.tokenizer.encode(f" doc {i} " + "fox " * i) for i in range(6)]
    a = cached.generate(prompts, GREEDY)
    b = plain.generate(prompts, GREEDY)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert max(abs(x - y) for oa, ob in zip(a, b) for x, y in zip(oa.logprobs, ob.logprobs)) <= 1e-4
    block_aligned = len(shared) // 16 * 16
    assert all(o.num_cached_tokens >= block_aligned for o in a[1:])
    assert all(o.num_cached_tokens == 0 for o in b)


@pytest.mark.parametrize("budget", [16, 1000])
def test_prefix_cache_with_chunked_prefill(tiny_model, budget):
    llm = make_llm(tiny_model, budget=budget)
    prompt = mixed_prompts(llm, repeats=(4,))[0]
    first = llm.generate([prompt], GREEDY)[0]
    second = llm.generate([prompt], GREEDY)[0]
    assert second.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    assert first.token_ids == second.token_ids


@pytest.mark.parametrize("arch", MOE_ARCHS + MLA_ARCHS + WINDOW_ARCHS)
def test_parity_with_chunked_prefill_prefix_cache_and_preemption(tiny_model_factory, arch):
    """Experts, latent attention, and windows crossed by prefill chunks, by cached prefixes and by
    recomputed sequences."""
    path = str(tiny_model_factory(arch))
    probe = LLM(path, dtype="float32", device="cpu", kv_cache_memory=1 << 20)
    tok = probe.tokenizer
    shared = tok.encode("Instruction: summarize carefully. " * 6)
    prompts = [shared + tok.encode(f" doc {i}: " + "fox " * (3 * i)) for i in range(4)]
    prompts += [tok.encode(f"{i}: " + TEXT * r) for i, r in enumerate((1, 3))]
    per_block = probe.engine.executor.kv_layout.bytes_per_block(16, torch.float32)
    # 12 blocks cannot hold every sequence at once: some are preempted and recomputed (unless every layer
    # has a window: then blocks out of it are freed as sequences run, and they all fit).
    llm = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=48, kv_cache_memory=12 * per_block)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=True)
    outs = llm.generate(prompts, params)
    assert (llm.engine.metrics.preemptions > 0) == (llm.engine.block_manager.window is None)
    assert llm.engine.metrics.prefix_cache_hits > 0
    assert max(map(len, prompts)) > 48
    if arch in WINDOW_ARCHS:
        assert len(shared) > llm.engine.model_config.sliding_window  # cached prefixes longer than the window
    assert_like_hf(path, prompts, outs)
