"""Overlapped scheduling: the same tokens and log-probabilities as step-by-step scheduling, no KV leak."""
from __future__ import annotations

import pytest

from batchgen.engine import LLM, SamplingParams
from tests.engine_helpers import TEXT, mixed_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True)


def make_llm(path, overlap: str, budget: int = 48, **kw) -> LLM:
    # A small token budget forces chunked prefill and mixed prefill/decode steps.
    kw.setdefault("kv_cache_memory", 16 << 20)
    return LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=budget, overlap_schedule=overlap,
               **kw)


def make_pair(path, **kw) -> dict[str, LLM]:
    return {mode: make_llm(path, mode, **kw) for mode in ("off", "on")}


@pytest.fixture(scope="module")
def llms(tiny_model):
    pair = make_pair(tiny_model)
    yield pair
    for llm in pair.values():
        llm.close()


def results(outs, logprobs: bool = True) -> list[tuple]:
    return [(o.token_ids, o.logprobs if logprobs else None, o.finish_reason, o.text, o.num_cached_tokens)
            for o in outs]


def assert_same_and_no_leak(llms, prompts, params, exact: bool = True) -> list:
    """Generates with overlap off and on; both give the same outputs and return every KV block.

    Not ``exact``: a stop found a step late leaves one more row in that step's batch, and fp32 matmuls
    over a different number of rows may round the others' logits differently (by ~1e-7).
    """
    got = {}
    for mode, llm in llms.items():
        got[mode] = llm.generate(prompts, params)
        engine = llm.engine
        assert not engine.has_unfinished()
        assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)
    assert len(got["on"]) == len(got["off"]) == len(prompts)
    assert results(got["on"], exact) == results(got["off"], exact)
    for on, off in zip(got["on"], got["off"]):
        assert len(on.logprobs or []) == len(off.logprobs or [])
        assert all(abs(a - b) <= 1e-5 for a, b in zip(on.logprobs or [], off.logprobs or []))
    return got["on"]


def test_overlap_keeps_a_step_in_flight(llms):
    assert llms["on"].engine.overlap and not llms["off"].engine.overlap
    engine = llms["on"].engine
    engine.add_request(engine.tokenizer.encode("in flight " * 9), GREEDY)  # a prompt no other test shares
    engine.step()  # the prompt, still running when step returns
    assert engine._in_flight is not None and engine.has_unfinished()
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert len(outs) == 1 and len(outs[0].token_ids) == 12


def test_greedy_with_chunked_prefill_and_varied_max_tokens(llms):
    prompts = mixed_prompts(llms["on"]) * 2
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=True)
              for n in (1, 12, 3, 7, 2, 9, 12, 5, 4, 1)]
    outs = assert_same_and_no_leak(llms, prompts, params)
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
    assert max(map(len, prompts)) > 3 * 48  # several prefill chunks


def test_stops_discovered_a_step_late_emit_no_extra_token(llms):
    prompts = mixed_prompts(llms["on"])
    free = [o.token_ids for o in llms["off"].generate(prompts, GREEDY)]
    stop_ids = [SamplingParams(max_tokens=12, temperature=0, logprobs=True, stop_token_ids=[t[3]]) for t in free]
    outs = assert_same_and_no_leak(llms, prompts, stop_ids, exact=False)
    for tokens, out in zip(free, outs):
        cut = tokens.index(tokens[3]) + 1
        assert out.token_ids == tokens[:cut] and out.finish_reason == "stop"
    tokenizer = llms["on"].tokenizer
    texts = [tokenizer.decode(t[4:6]) for t in free]
    stop_strings = [SamplingParams(max_tokens=12, temperature=0, logprobs=True, stop=[s]) for s in texts if s.strip()]
    outs = assert_same_and_no_leak(llms, prompts[:len(stop_strings)], stop_strings, exact=False)
    assert all(o.finish_reason == "stop" and len(o.token_ids) < 12 for o in outs)


def test_seeded_sampling_matches(llms):
    params = SamplingParams(max_tokens=10, temperature=0.9, top_k=30, top_p=0.9, seed=5, ignore_eos=True,
                            logprobs=True)
    assert_same_and_no_leak(llms, mixed_prompts(llms["on"]), params)


def test_prefix_caching_hits_are_the_same(tiny_model):
    fresh = make_pair(tiny_model)  # both caches start empty
    shared = fresh["on"].tokenizer.encode(TEXT * 4)
    prompts = [shared + fresh["on"].tokenizer.encode(f" question {i}") for i in range(6)]
    assert_same_and_no_leak(fresh, prompts[:2], GREEDY)
    outs = assert_same_and_no_leak(fresh, prompts, GREEDY)  # the shared prefix is cached by now
    assert all(o.num_cached_tokens >= len(shared) - 16 for o in outs)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_under_a_small_kv_cache(tiny_model, llms, prefix_caching):
    prompts = [llms["on"].tokenizer.encode(f"{i} " + TEXT * 3)[:60] for i in range(6)]
    per_block = llms["on"].engine.executor.kv_layout.bytes_per_block(16, llms["on"].config.torch_dtype)
    small = make_pair(tiny_model, budget=256, kv_cache_memory=per_block * 16, enable_prefix_caching=prefix_caching)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=True)
    outs = assert_same_and_no_leak(small, prompts, params)
    assert all(llm.engine.metrics.preemptions > 0 for llm in small.values())
    assert [o.token_ids for o in outs] == [o.token_ids for o in llms["off"].generate(prompts, params)]


def test_abort_of_a_request_in_flight(llms):
    prompts = mixed_prompts(llms["on"])
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=True) for n in (2, 30, 30, 30, 30)]
    expected = results(llms["off"].generate(prompts, params))
    llm = llms["on"]
    stream = llm.generate_stream((i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params)))
    key, first = next(stream)
    assert key == 0 and llm.engine._in_flight is not None  # the others' next step is running
    stream.close()
    engine = llm.engine
    assert not engine.has_unfinished() and engine._in_flight is None
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)
    assert results([first]) == expected[:1]
    assert results(llm.generate(prompts, params)) == expected  # the engine runs on as before


def test_grammar_rows_and_free_rows_together(tiny_model):
    pytest.importorskip("xgrammar")
    pair = make_pair(tiny_model, budget=256)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    prompts = mixed_prompts(pair["on"], repeats=(1, 2, 3))
    params = [SamplingParams(max_tokens=40, temperature=0, json_schema=schema, logprobs=True), GREEDY,
              SamplingParams(max_tokens=8, temperature=0, regex="[a-z]{3}", logprobs=True)]
    outs = assert_same_and_no_leak(pair, prompts, params, exact=False)
    assert outs[0].grammar_complete and outs[2].grammar_complete and len(outs[1].token_ids) == 12


def test_padded_graph_steps_with_the_triton_kernels(tiny_model):
    """The CUDA-graph path (padded fixed-shape steps, run eagerly) takes the deferred tokens too."""
    pair = make_pair(tiny_model, budget=64, max_num_seqs=8, cuda_graphs="emulate", attention_backend="triton")
    outs = assert_same_and_no_leak(pair, mixed_prompts(pair["on"], repeats=(1, 2, 1)),
                                   SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=True))
    assert all(len(o.token_ids) == 5 for o in outs)
    assert all(llm.engine.metrics.padded_tokens > 0 for llm in pair.values())


def test_config_choices(tiny_model):
    with pytest.raises(ValueError, match="overlap_schedule"):
        make_llm(tiny_model, "sometimes")
    llm = make_llm(tiny_model, "auto")
    assert llm.engine.overlap is False  # auto: overlap only on CUDA
    llm.close()
