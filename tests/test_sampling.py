"""Sampling parameters: seeds, stop strings and ids, max_tokens, finish reasons, request errors, streaming."""
from __future__ import annotations

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.sampling.sampler import SamplingBatch, sample, seeded_uniform
from tests.engine_helpers import TEXT, mixed_prompts


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(str(tiny_model), dtype="float32", device="cpu", max_num_batched_tokens=64)


def test_seed_gives_same_tokens_alone_and_in_any_batch(llm):
    prompts = mixed_prompts(llm)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate([prompts[2]], params)[0].token_ids
    others = [SamplingParams(max_tokens=7, temperature=0.9, ignore_eos=True, seed=s) for s in (1, 2, 3, 4)]
    batch = llm.generate(prompts, others[:2] + [params] + others[2:])
    assert batch[2].token_ids == alone
    assert llm.generate([prompts[2]], SamplingParams(max_tokens=10, temperature=1.0, seed=99,
                                                     ignore_eos=True))[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    prompts = mixed_prompts(llm)
    greedy = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0,
                                                                         ignore_eos=True))]
    for params in (SamplingParams(max_tokens=8, temperature=1.5, top_k=1, seed=5, ignore_eos=True),
                   SamplingParams(max_tokens=8, temperature=1.5, top_p=1e-6, seed=5, ignore_eos=True)):
        assert [o.token_ids for o in llm.generate(prompts, params)] == greedy


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    rows = 20000
    batch = SamplingBatch(temperatures=torch.ones(rows), top_ks=torch.zeros(rows, dtype=torch.int64),
                          top_ps=torch.ones(rows), seeds=torch.arange(rows, dtype=torch.int64),
                          steps=torch.zeros(rows, dtype=torch.int64), want_logprobs=False,
                          all_greedy=False, any_top_k_or_p=False)
    tokens, _ = sample(probs.log().expand(rows, 4), batch)
    freq = torch.bincount(tokens, minlength=4).float() / rows
    assert torch.allclose(freq, probs, atol=0.015)
    noise = seeded_uniform(torch.tensor([7, 7]), torch.tensor([0, 1]), 1000)
    assert 0 < noise.min() and noise.max() < 1 and not torch.equal(noise[0], noise[1])


def test_max_tokens_and_length_finish(llm):
    out = llm.generate([TEXT], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_token_ids(llm):
    base = llm.generate([TEXT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    stop_id = base.token_ids[3]
    first = base.token_ids.index(stop_id)
    out = llm.generate([TEXT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                              stop_token_ids=[stop_id]))[0]
    assert out.token_ids == base.token_ids[:first + 1] and out.finish_reason == "stop"


def test_eos_stops_unless_ignored(llm):
    base = llm.generate([TEXT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    eos = base.token_ids[4]
    saved = llm.engine.eos_ids
    llm.engine.eos_ids = frozenset({eos})
    try:
        stopped = llm.generate([TEXT], SamplingParams(max_tokens=10, temperature=0))[0]
        ignored = llm.generate([TEXT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    finally:
        llm.engine.eos_ids = saved
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == eos
    assert len(stopped.token_ids) == base.token_ids.index(eos) + 1
    assert ignored.token_ids == base.token_ids


def test_stop_strings_are_left_out_of_the_text(llm):
    base = llm.generate([TEXT], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    text = base.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), f"need a printable stop string, got {stop!r} from {text!r}"
    out = llm.generate([TEXT], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:text.index(stop)]
    assert stop not in out.text
    assert out.token_ids == base.token_ids[:len(out.token_ids)]


def test_prompt_longer_than_max_model_len_fails_that_request_only(tiny_model):
    llm = LLM(str(tiny_model), dtype="float32", device="cpu", max_model_len=64)
    long_prompt = llm.tokenizer.encode(TEXT * 5)
    assert len(long_prompt) > 64
    outs = llm.generate([TEXT, long_prompt, TEXT], SamplingParams(max_tokens=4, temperature=0))
    assert outs[1].finish_reason == "error" and "max_model_len" in outs[1].error
    assert outs[0].finish_reason in ("stop", "length") and outs[0].token_ids == outs[2].token_ids


def test_generation_stops_at_max_model_len(tiny_model):
    llm = LLM(str(tiny_model), dtype="float32", device="cpu", max_model_len=40)
    prompt = llm.tokenizer.encode(TEXT)[:30]
    out = llm.generate([prompt], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == 40


def test_stream_yields_each_request_once_and_reads_lazily(llm):
    pulled = []

    def requests():
        for i in range(12):
            pulled.append(i)
            yield i, TEXT[: 20 + 7 * i], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    seen = []
    for key, out in llm.generate_stream(requests(), max_pending=4):
        seen.append(key)
        assert len(pulled) - len(seen) <= 4  # never more than max_pending requests in flight
        assert len(out.token_ids) == 3
    assert sorted(seen) == list(range(12))


def test_stream_abandoned_midway_leaves_the_engine_empty(llm):
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    stream = llm.generate_stream(((i, TEXT[: 20 + i], params) for i in range(8)), max_pending=4)
    next(stream)
    stream.close()  # e.g. the job consuming it failed
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.executor.num_blocks
    alone = llm.generate([TEXT], params)[0]  # a later stream on the same LLM works
    again = dict(llm.generate_stream([("k", TEXT, params)]))
    assert again["k"].token_ids == alone.token_ids


def test_bad_sampling_params_raise():
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    for bad in ({"temperature": "0.5"}, {"top_k": 2.5}, {"top_p": True}, {"stop": [1]}, {"stop_token_ids": ["2"]},
                {"stop_token_ids": 2}, {"logprobs": 3}, {"logprobs": "yes"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_vllm_spellings_of_off_are_taken():
    params = SamplingParams(top_k=-1, stop=None, stop_token_ids=None, logprobs=None)
    assert (params.top_k, params.stop, params.stop_token_ids, params.logprobs) == (0, [], [], False)
    assert SamplingParams(logprobs=0).logprobs is True  # the sampled token's, no alternatives
    import numpy as np

    params = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), seed=np.int64(7))
    assert (params.temperature, params.top_k, params.seed) == (0.5, 3, 7) and type(params.top_k) is int


# chi-square critical values at p = 0.001 by degrees of freedom (scipy.stats.chi2.ppf(0.999, df))
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}
PROBS = [0.28, 0.2, 0.14, 0.11, 0.08, 0.065, 0.05, 0.035, 0.025, 0.015]


def truncated_reference(probs: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """The distribution sampling should follow, in fp64: probs at the temperature, the top_k most likely
    tokens kept (0: all), then the smallest most-likely set whose mass reaches top_p, renormalised."""
    weights = [p ** (1 / temperature) for p in probs]
    order = sorted(range(len(probs)), key=lambda i: -weights[i])
    kept = order[:top_k] if top_k > 0 else order
    total = sum(weights[i] for i in kept)
    nucleus, mass = [], 0.0
    for i in kept:
        if mass >= top_p:
            break
        nucleus.append(i)
        mass += weights[i] / total
    z = sum(weights[i] for i in nucleus)
    return [weights[i] / z if i in nucleus else 0.0 for i in range(len(probs))]


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 3, 1.0), (1.0, 6, 1.0), (1.0, 0, 0.7), (1.0, 0, 0.9), (1.0, 5, 0.6), (0.7, 0, 0.8), (1.5, 4, 0.95)])
def test_top_k_and_top_p_sample_the_renormalised_truncated_distribution(temperature, top_k, top_p):
    rows, vocab = 40000, len(PROBS)
    expected = torch.tensor(truncated_reference(PROBS, temperature, top_k, top_p), dtype=torch.float64)
    allowed = expected > 0
    assert 1 < int(allowed.sum()) < vocab  # the filter really cuts, and leaves a choice
    batch = SamplingBatch(temperatures=torch.full((rows,), temperature),
                          top_ks=torch.full((rows,), top_k, dtype=torch.int64),
                          top_ps=torch.full((rows,), top_p), seeds=torch.arange(rows, dtype=torch.int64) * 7919,
                          steps=torch.full((rows,), 3, dtype=torch.int64), want_logprobs=False,
                          all_greedy=False, any_top_k_or_p=True)
    tokens, _ = sample(torch.tensor(PROBS).log().expand(rows, vocab).clone(), batch)
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[~allowed].sum() == 0, f"tokens outside the allowed set: {counts.tolist()}"
    want = expected[allowed] * rows
    chi2 = float(((counts[allowed] - want) ** 2 / want).sum())
    assert chi2 < CHI2_999[int(allowed.sum()) - 1], (chi2, counts.tolist(), want.tolist())


def test_ties_and_a_top_p_below_float32_keep_argmax_token():
    """top_k=1 takes the first of equal logits as greedy does; a top_p that float32 rounds to 0 keeps the top token."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0, 1.0]] * 2)
    batch = SamplingBatch(temperatures=torch.ones(2), top_ks=torch.tensor([1, 0]),
                          top_ps=torch.tensor([1.0, 1e-300], dtype=torch.float64).float(),
                          seeds=torch.tensor([3, 4]), steps=torch.zeros(2, dtype=torch.int64), want_logprobs=False,
                          all_greedy=False, any_top_k_or_p=True)
    assert batch.top_ps[1] == 0
    tokens, _ = sample(logits, batch)
    assert tokens.tolist() == [1, 1] == logits.max(dim=-1).indices.tolist()


def test_a_single_prompt_is_a_batch_of_one(llm):
    params = SamplingParams(max_tokens=4, temperature=0)
    [one] = llm.generate(TEXT, params)
    [ids] = llm.generate(llm.tokenizer.encode(TEXT), params)
    assert one.token_ids == ids.token_ids == llm.generate([TEXT], params)[0].token_ids


@pytest.mark.parametrize("fields", [{"seed": 2**63}, {"seed": -(2**63) - 1}, {"seed": 1.5}, {"max_tokens": None},
                                    {"max_tokens": 2.0}])
def test_out_of_range_seeds_and_max_tokens_raise(fields):
    with pytest.raises(ValueError, match=next(iter(fields))):
        SamplingParams(**fields)
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1 and SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_noise_at_the_top_of_its_range_never_picks_a_filtered_token():
    """Noise values that float32 rounds up to 1.0 (about 1 a step in 20 over a 49K vocabulary) once made a
    token outside top-k, top-p or a grammar score NaN, which argmax took."""
    vocab, steps = 49152, torch.arange(3000, dtype=torch.int64)
    noise = seeded_uniform(torch.zeros(len(steps), dtype=torch.int64), steps, vocab)
    assert float(noise.min()) > 0 and float(noise.max()) < 1
    rows, cols = (noise >= 1 - 2.0 ** -24).nonzero(as_tuple=True)
    assert len(rows) >= 3  # the scan reaches the top of the range
    logits = torch.zeros(len(rows), vocab)
    top = (cols + 1) % vocab  # the only token top-k 1 keeps; every hit column is filtered out
    logits[torch.arange(len(rows)), top] = 5.0
    for top_k, top_p in ((1, 1.0), (0, 1e-6)):
        batch = SamplingBatch(temperatures=torch.ones(len(rows)), top_ks=torch.full((len(rows),), top_k),
                              top_ps=torch.full((len(rows),), top_p), seeds=torch.zeros(len(rows), dtype=torch.int64),
                              steps=steps[rows], want_logprobs=False, all_greedy=False, any_top_k_or_p=True)
        tokens, _ = sample(logits, batch)
        assert tokens.tolist() == top.tolist()


def test_chat_and_array_prompts_as_vllm_takes_them(llm):
    import numpy as np

    params = SamplingParams(max_tokens=3, temperature=0)
    chat = [{"role": "user", "content": TEXT}]
    ids = llm.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    [one] = llm.chat(chat, params)
    two = llm.chat([chat, chat], params)
    [plain] = llm.generate([ids], params)
    assert len(two) == 2 and one.token_ids == plain.token_ids == two[0].token_ids == two[1].token_ids
    [array] = llm.generate(np.array(ids), params)
    assert array.token_ids == plain.token_ids
