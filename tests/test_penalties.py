"""Presence, frequency and repetition penalties and min_tokens, against a greedy loop over HF transformers' logits."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.sampling.penalties import RowPenalties, apply_penalties
from tests.engine_helpers import hf_model

N = 10


@pytest.fixture(scope="module")
def llms(tiny_model) -> dict[str, LLM]:
    return {mode: LLM(str(tiny_model), dtype="float32", device="cpu", max_num_batched_tokens=48,
                      overlap_schedule=mode, kv_cache_memory=16 << 20) for mode in ("off", "on")}


@pytest.fixture(scope="module")
def prompts(llms) -> list[list[int]]:
    tok = llms["off"].tokenizer
    return [tok.encode(t) for t in ("the the the the the", "A quick brown fox jumps over the lazy dog again",
                                    "one two one two one two")]


@torch.inference_mode()
def reference(path, prompt: list[int], presence=0.0, frequency=0.0, repetition=1.0, min_tokens=0,
              stop_ids=()) -> list[int]:
    """Greedy tokens, each step's HF logits penalized one token at a time in fp64."""
    model, out = hf_model(str(path)), []
    for k in range(N):
        logits = model(torch.tensor([prompt + out])).logits[0, -1].double()
        if repetition != 1:
            for t in set(prompt) | set(out):
                logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t, count in Counter(out).items():
            logits[t] -= frequency * count + presence
        if k < min_tokens:
            logits[list(stop_ids)] = float("-inf")
        out.append(int(logits.argmax()))
        if out[-1] in stop_ids:
            break
    return out


def test_apply_penalties_follows_the_rule_token_by_token():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen) * 3
    rows = [RowPenalties(1, 0.5, 0.25, 1.0, [3, 3, 7]), RowPenalties(3, -0.3, 0.0, 1.7, [9, 9, 2], [2, 40, 41])]
    expected = logits.clone().double()
    for p in rows:
        x = expected[p.row]
        for t in set(p.completion_ids) | set(p.prompt_ids):
            x[t] = x[t] / p.repetition if x[t] > 0 else x[t] * p.repetition
        for t, count in Counter(p.completion_ids).items():
            x[t] -= p.frequency * count + p.presence
    apply_penalties(logits, rows)
    assert torch.allclose(logits.double(), expected, atol=1e-5)


@pytest.mark.parametrize("penalties", [dict(repetition=1.6), dict(presence=1.5), dict(frequency=0.8),
                                       dict(presence=-0.5, frequency=0.6, repetition=1.3)])
def test_greedy_with_penalties_is_the_reference_overlapped_or_not(llms, prompts, tiny_model, penalties):
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, presence_penalty=penalties.get("presence", 0.0),
                            frequency_penalty=penalties.get("frequency", 0.0),
                            repetition_penalty=penalties.get("repetition", 1.0))
    expected = [reference(tiny_model, p, **penalties) for p in prompts]
    assert expected != [reference(tiny_model, p) for p in prompts]  # the penalties change the greedy tokens
    for mode, llm in llms.items():
        outs = llm.generate(prompts, params)
        assert len(outs) == len(prompts)
        assert [o.token_ids for o in outs] == expected, mode


def test_min_tokens_keeps_the_stop_ids_out_until_then(llms, prompts, tiny_model):
    first = [reference(tiny_model, p)[0] for p in prompts]
    for mode, llm in llms.items():
        for prompt, stop in zip(prompts, first):
            [early] = llm.generate([prompt], SamplingParams(max_tokens=N, temperature=0, stop_token_ids=[stop]))
            assert early.token_ids == [stop] and early.finish_reason == "stop"
            params = SamplingParams(max_tokens=N, temperature=0, stop_token_ids=[stop], min_tokens=4)
            [out] = llm.generate([prompt], params)
            assert out.token_ids == reference(tiny_model, prompt, min_tokens=4, stop_ids=[stop]), mode
            assert len(out.token_ids) >= 4 and stop not in out.token_ids[:4]


def test_min_tokens_holds_back_stop_strings_that_end_within_it(llms, prompts):
    llm = llms["off"]
    [free] = llm.generate([prompts[1]], SamplingParams(max_tokens=N, temperature=0, ignore_eos=True))
    stop = free.text[:3]  # the completion's own first characters
    assert stop.strip()
    [cut] = llm.generate([prompts[1]], SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, stop=[stop]))
    assert cut.text == "" and cut.finish_reason == "stop"
    [held] = llm.generate([prompts[1]], SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, stop=[stop],
                                                       min_tokens=N))
    assert (held.token_ids, held.text, held.finish_reason) == (free.token_ids, free.text, "length")


def test_penalties_are_refused_with_speculative_decoding(tiny_model):
    llm = LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory=16 << 20,
              speculative_config={"method": "ngram"})
    for params in (SamplingParams(max_tokens=4, repetition_penalty=1.2), SamplingParams(max_tokens=4, min_tokens=2)):
        [out] = llm.generate([[1, 2, 3]], params)
        assert out.finish_reason == "error" and "speculative" in out.error


def test_min_tokens_passes_over_stop_ids_outside_the_vocabulary(llms, prompts, tiny_model):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, min_tokens=2, stop_token_ids=[10**6, -1])
    [out] = llms["off"].generate([prompts[0]], params)
    assert out.finish_reason == "length" and out.token_ids == reference(tiny_model, prompts[0])[:4]
