"""The ``draft_model`` method on tiny models: lossless against spec off, a target drafting for itself accepts
its drafts, mismatched vocabularies and bad settings are refused, a slow proposer is left unused."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.backends.torch import ops as torch_ops
from batchgen.engine.speculative import speculator as speculator_module
from batchgen.engine.speculative.config import SpeculativeConfig
from batchgen.engine.speculative.policy import DraftCost, choose_draft_lengths
from batchgen.engine.speculative.speculator import Speculator
from tests.engine_helpers import TEXT, hf_logprobs, mixed_prompts
from tests.test_speculative import chi2_999, chi_square, seeded
from tests.tiny_models import build_tiny_model

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True)


def draft_llm(target, draft, draft_sampling: str | None = None, **kw) -> LLM:
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    if draft_sampling is not None:
        spec["draft_sampling"] = draft_sampling
    kw = {"kv_cache_memory": 16 << 20, "max_num_batched_tokens": 64, **kw}
    return LLM(str(target), dtype="float32", device="cpu", speculative_config=spec, **kw)


def run(llm: LLM, speculator, prompts, params):
    llm.engine.speculator = speculator
    llm.engine.reset_metrics()
    outs = llm.generate(prompts, params)
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished() and bm.num_free_blocks == len(bm.blocks)
    return outs


@pytest.fixture
def always_draft(monkeypatch):
    """The cost model out of the way: every decoding sequence drafts as many tokens as it may."""
    monkeypatch.setattr(speculator_module, "choose_draft_lengths", lambda rates, caps, *costs: list(caps))


def noisy_copy(model: Path, out: Path, scale: float = 0.05) -> Path:
    """The model with noise on every weight (``scale`` times each tensor's spread): a draft that agrees with
    it often, not always."""
    shutil.copytree(model, out)
    weights = load_file(str(model / "model.safetensors"))
    noise = torch.Generator().manual_seed(1)
    save_file({name: w + scale * w.std() * torch.randn(w.shape, generator=noise) for name, w in weights.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory, tiny_model):
    """The tiny llama target with another model of the same tokenizer drafting: a noisy copy of it."""
    llm = draft_llm(tiny_model, noisy_copy(tiny_model, tmp_path_factory.mktemp("draft") / "noisy"))
    yield llm
    llm.close()


def test_greedy_with_a_tiny_draft_equals_spec_off(other_draft, always_draft):
    llm = other_draft
    speculator = llm.engine.speculator
    prompts = mixed_prompts(llm, repeats=(1, 2))
    off = run(llm, None, prompts, GREEDY)
    draft = speculator.proposer.engine
    draft.reset_metrics()
    on = run(llm, speculator, prompts, GREEDY)
    for x, y in zip(on, off, strict=True):
        assert (x.token_ids, x.finish_reason, x.text) == (y.token_ids, y.finish_reason, y.text)
        assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs, strict=True)) < 1e-5
    (figures,) = llm.metrics()["speculative"].values()
    assert 0 < figures["accepted_tokens"] < figures["proposed_tokens"]  # kept and rejected drafts both
    assert speculator.figures()["draft_ms_per_step"] > 0  # the draft's time was measured
    assert speculator.proposer.steady_seconds > 0
    # Each call hands the draft whole contexts; its prefix cache keeps all but the new tokens' KV.
    assert 0 < draft.metrics.prompt_tokens_computed < 0.5 * draft.metrics.prefix_cache_queries


def test_greedy_drafts_give_a_seeded_row_spec_offs_tokens(other_draft, always_draft, monkeypatch):
    """``draft_sampling: "greedy"``: argmax drafts under the deterministic rule, the plain sampler's noise."""
    llm = other_draft
    speculator = llm.engine.speculator
    monkeypatch.setattr(speculator.proposer, "sampling", "greedy")
    prompts = mixed_prompts(llm, repeats=(1, 3))
    params = [SamplingParams(max_tokens=6, temperature=0.7, seed=seed, ignore_eos=True) for seed in (3, 4)]
    off = run(llm, None, prompts, params)
    on = run(llm, speculator, prompts, params)
    assert [len(o.token_ids) for o in on] == [6, 6]
    assert [o.token_ids for o in on] == [o.token_ids for o in off]


def test_greedy_rows_beside_sampled_drafts_equal_spec_off(other_draft, always_draft, monkeypatch):
    """A step verifying sampled drafts (rejection sampling) keeps the exact rule for its greedy rows: their tokens
    and logprobs are spec off's."""
    llm = other_draft
    speculator = llm.engine.speculator
    monkeypatch.setattr(speculator.proposer, "sampling", "probabilistic")
    prompts = mixed_prompts(llm, repeats=(1, 2, 1, 3))
    params = [GREEDY if i % 2 else SamplingParams(max_tokens=12, temperature=1.0, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    verified = []
    monkeypatch.setattr(llm.engine.executor.runner.kernels, "reject_drafts", spy(torch_ops.reject_drafts, verified))
    off = run(llm, None, prompts, params)
    on = run(llm, speculator, prompts, params)
    for x, y in list(zip(on, off, strict=True))[1::2]:
        assert x.token_ids == y.token_ids
        assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs, strict=True)) < 1e-5
    q_starts = [args[3].tolist() for args in verified]  # -1: a row of deterministic drafts
    assert any(min(q) < 0 <= max(q) for q in q_starts)  # greedy rows shared steps with sampled drafts


def spy(fn, calls: list):
    def record(*args):
        calls.append(args)
        return fn(*args)
    return record


def test_the_target_as_its_own_draft_accepts_its_drafts(tiny_model, always_draft):
    with draft_llm(tiny_model, tiny_model, draft_sampling="greedy") as llm:
        speculator = llm.engine.speculator
        assert speculator.proposer.sampling == "greedy"
        prompts = mixed_prompts(llm, repeats=(1, 2))
        off = run(llm, None, prompts, GREEDY)
        on = run(llm, speculator, prompts, GREEDY)
        (figures,) = llm.metrics()["speculative"].values()
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert figures["proposed_tokens"] >= 12
    assert figures["acceptance_rate"] >= 0.9


def test_a_draft_with_another_vocabulary_is_refused(tmp_path, tiny_model):
    other = build_tiny_model(tmp_path / "other", "llama", num_layers=1, vocab_size=500)
    with pytest.raises(ValueError, match="same tokenizer") as refused:
        draft_llm(tiny_model, other)
    assert "500 token ids" in str(refused.value)


def test_a_draft_that_cannot_load_is_named_as_the_draft(tmp_path, tiny_model):
    with pytest.raises(FileNotFoundError, match=rf"speculative_config draft model '{tmp_path / 'nope'}': "):
        draft_llm(tiny_model, tmp_path / "nope")


def test_a_draft_whose_tokenizer_numbers_tokens_otherwise_is_refused(tmp_path, tiny_model):
    other = Path(shutil.copytree(tiny_model, tmp_path / "swapped"))
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    first, second = (token for token, i in vocab.items() if i in (6, 7))
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="token id 6 is .* to the draft's tokenizer.*same tokenizer"):
        draft_llm(tiny_model, other)


def test_a_job_spec_names_its_draft_model(tmp_path, tiny_model, always_draft):
    from batchgen.pipeline.runner import run_job
    from tests.job_helpers import make_spec, records, write_jsonl

    inp, out = write_jsonl(tmp_path / "in.jsonl", records(3)), tmp_path / "out"
    engine = {"speculative_config": {"method": "draft_model", "model": str(tiny_model)}, "kv_cache_memory": 16 << 20}
    stats = run_job(make_spec(tiny_model, inp, out, engine=engine, sampling={"max_tokens": 8, "ignore_eos": True}),
                    quiet=True)
    figures = stats["engine"]["speculative"]["draft_model"]
    assert figures["proposed_tokens"] > 0 and figures["acceptance_rate"] >= 0.9


@pytest.mark.parametrize("config, message", [
    ({"method": "draft_model"}, "needs 'model'"),
    ({"method": "draft_model", "model": ""}, "needs 'model'"),
    ({"method": "draft_model", "model": "m", "draft_tensor_parallel_size": 2}, "unknown speculative_config key"),
    ({"method": "draft_model", "model": "m", "prompt_lookup_max": 3}, "keys of method 'ngram'"),
    ({"method": "draft_model", "model": "m", "draft_sampling": "typical"},
     "'draft_sampling' must be one of 'coupled', 'probabilistic', 'greedy', got 'typical'"),
])
def test_bad_draft_model_settings_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(config)


def test_draft_model_settings_parse():
    spec = SpeculativeConfig.from_dict({"method": "draft_model", "model": "m", "num_speculative_tokens": 5})
    assert (spec.method, spec.options, spec.num_speculative_tokens) == ("draft_model", {"model": "m"}, 5)
    spec = SpeculativeConfig.from_dict({"method": "draft_model", "model": "m", "draft_sampling": "greedy"})
    assert spec.options == {"model": "m", "draft_sampling": "greedy"}


def test_an_expensive_proposer_gets_no_drafts():
    a, b = 0.1, 0.001  # memory-bound steps: drafts pay for themselves when proposing is free
    assert choose_draft_lengths([0.8] * 4, [4] * 4, a, b) == [4] * 4
    assert choose_draft_lengths([0.8] * 4, [4] * 4, a, b, draft_s=0.05) == [0] * 4
    cost = DraftCost()
    cost.observe(4, 0.2)  # 4 draft steps in 0.2 s
    cost.observe(2, 0.1)
    assert cost.seconds_per_step == pytest.approx(0.05)
    assert cost.per_token(5) == pytest.approx(0.01)  # a step drafts one token for each of 5 sequences


class SlowProposer:
    """Drafts the target's own greedy continuation (``outputs`` of spec off), taking ``delay`` seconds a call."""

    def __init__(self, outputs, delay: float):
        self.continuations = {tuple(o.prompt_token_ids): o.token_ids for o in outputs}
        self.delay, self.prompts = delay, {}

    def add_request(self, seq_id, prompt):
        self.prompts[seq_id] = tuple(prompt)

    def propose(self, seq_id, tokens, k):
        time.sleep(self.delay)
        prompt = self.prompts[seq_id]
        return self.continuations[prompt][len(tokens) - len(prompt):][:k]

    def finish(self, seq_id, tokens, num_prompt_tokens):
        pass


def test_probes_bring_drafting_back_after_one_slow_verification(tiny_model, monkeypatch):
    """A verification timed on a busy machine turns drafting off; the probe steps time it again and, as
    verifying is really cheap, drafting comes back for the rest of the run."""
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    with LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory=16 << 20,
             speculative_config={"method": "ngram"}) as llm:
        engine = llm.engine
        prompts = mixed_prompts(llm, repeats=(1,))[:1]
        reference = run(llm, None, prompts, params)
        speculator = Speculator(SpeculativeConfig.from_dict({"method": "ngram"}), engine.max_model_len,
                                engine.model_config.vocab_size, SlowProposer(reference, 0.0))
        for _ in range(8):
            speculator.cost.observe(1, 0.01)
        speculator.cost.observe(5, 5.0)  # the busy machine's verification
        # This machine's own timings would be noise: every decode step costs 10 ms and 0.1 ms per token.
        monkeypatch.setattr(speculator, "step_done", lambda prefill, tokens, seconds, verifying=False: prefill or
                            speculator.cost.observe(tokens, 0.01 + 1e-4 * tokens))
        outs = run(llm, speculator, prompts, params)
        figures = llm.metrics()["speculative"]["ngram"]
    assert outs[0].token_ids == reference[0].token_ids
    assert figures["probe_steps"] == 2  # at 8 and 16 undrafted steps: the second outvotes the slow one
    # the probes alone verify at most 2 x 4 drafts: the rest are the drafting that came back
    assert figures["decode_seqs_drafting"] > figures["probe_steps"] and figures["accepted_tokens"] >= 24


def test_drafts_past_a_stop_count_neither_as_accepted_nor_as_generated(tiny_model, always_draft):
    """A row that a stop token ends inside its accepted drafts: the tokens after it are dropped, and the figures
    count only the tokens kept."""
    spec = {"method": "draft_model", "model": str(tiny_model), "num_speculative_tokens": 8, "draft_sampling": "greedy"}
    with LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory=16 << 20, speculative_config=spec) as llm:
        prompt = llm.tokenizer.encode("0: " + TEXT)
        free = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0].token_ids
        stop = free[2]
        llm.engine.reset_metrics()
        out = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                    stop_token_ids=[stop]))[0]
        figures = llm.metrics()
    assert out.token_ids == free[:free.index(stop) + 1]
    assert figures["tokens_generated"] == len(out.token_ids)
    spec = figures["speculative"]["draft_model"]
    assert spec["accepted_tokens"] == spec["steps_saved"] <= len(out.token_ids) - 1


@pytest.mark.parametrize("delay, drafts_later", [(0.0, True), (0.05, False)])
def test_the_speculator_charges_the_proposers_time(tiny_model, monkeypatch, delay, drafts_later):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory=16 << 20,
             speculative_config={"method": "ngram"}) as llm:
        engine = llm.engine
        prompts = mixed_prompts(llm, repeats=(1,))
        reference = run(llm, None, prompts, params)
        speculator = Speculator(SpeculativeConfig.from_dict({"method": "ngram"}), engine.max_model_len,
                                engine.model_config.vocab_size, SlowProposer(reference, delay))
        for _ in range(8):  # flat 10 ms steps (memory-bound), kept: the fit does not learn this machine's
            speculator.cost.observe(1, 0.01)
            speculator.cost.observe(40, 0.0101)
        monkeypatch.setattr(speculator, "step_done", lambda *step: None)
        outs = run(llm, speculator, prompts, params)
        figures = llm.metrics()["speculative"]["ngram"]
    assert outs[0].token_ids == reference[0].token_ids
    # The first proposal is measured: a proposer slower than the step it saves is then left out (12.5 ms per
    # draft step, of one sequence, against 10 ms steps), a free one keeps drafting.
    assert (figures["drafting_share"] > 0.5) == drafts_later


SAMPLES = 200


@pytest.fixture(scope="module")
def wide_draft(tmp_path_factory, tiny_model):
    """Hundreds of requests at once, drafted by a noisy copy of the target (the sampling distributions)."""
    draft = noisy_copy(tiny_model, tmp_path_factory.mktemp("wide") / "noisy")
    llm = draft_llm(tiny_model, draft, draft_sampling="probabilistic", max_num_batched_tokens=2048, max_num_seqs=512,
                    kv_cache_memory=64 << 20)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def spec_off_samples(wide_draft) -> list[tuple]:
    """Spec off's first four tokens under SAMPLES seeds (temperature 1, top-k 2)."""
    prompt, speculator = wide_draft.tokenizer.encode("3: " + TEXT), wide_draft.engine.speculator
    off = sampled_tokens(wide_draft, None, prompt, seeded(SAMPLES))[0]
    wide_draft.engine.speculator = speculator
    return off


def sampled_tokens(llm, speculator, prompt, params) -> tuple[list[tuple], float]:
    outs = run(llm, speculator, [prompt] * len(params), params)
    rate = llm.metrics()["speculative"]["draft_model"]["acceptance_rate"] if speculator is not None else 0.0
    return [tuple(o.token_ids) for o in outs], rate


def test_sampled_drafts_keep_the_targets_distribution_and_accept_more(wide_draft, spec_off_samples, tiny_model,
                                                                       always_draft, monkeypatch):
    """At temperature 1 (top-k 2) the first four tokens under rejection sampling follow spec off's distribution,
    a seed gives the same tokens on a rerun, logprobs are the target's, and more drafts are kept than with argmax
    drafts (accepted with p(argmax) only)."""
    llm, speculator = wide_draft, wide_draft.engine.speculator
    assert speculator.proposer.sampling == "probabilistic"
    prompt = llm.tokenizer.encode("3: " + TEXT)
    on, sampled_rate = sampled_tokens(llm, speculator, prompt, seeded(SAMPLES, first_seed=10_000))
    stat, df = chi_square(spec_off_samples, on)
    assert df >= 3 and stat < chi2_999(df), (stat, df)
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=2, seed=10_000 + i, ignore_eos=True,
                             logprobs=True) for i in range(3)]
    again = run(llm, speculator, [prompt] * 3, params)
    assert [tuple(o.token_ids) for o in again] == on[:3]
    for out in again:
        want = hf_logprobs(str(tiny_model), prompt, out.token_ids)
        assert max(abs(u - v) for u, v in zip(out.logprobs, want, strict=True)) < 1e-4
    monkeypatch.setattr(speculator.proposer, "sampling", "greedy")
    _, greedy_rate = sampled_tokens(llm, speculator, prompt, seeded(SAMPLES, first_seed=10_000))
    assert sampled_rate > greedy_rate + 0.1, (sampled_rate, greedy_rate)


def test_coupled_drafts_give_spec_offs_tokens_whatever_drafts_a_step_makes(wide_draft, spec_off_samples,
                                                                            monkeypatch):
    """``draft_sampling: coupled`` (the default): drafts sampled with the target's own noise at each position, kept
    while they equal the target's token. A seed's tokens are spec off's, whichever windows the cost model picks,
    and the shared noise keeps more drafts than argmax drafts do."""
    from batchgen.engine.speculative.config import DRAFT_SAMPLING

    llm, speculator = wide_draft, wide_draft.engine.speculator
    assert DRAFT_SAMPLING[0] == "coupled"
    monkeypatch.setattr(speculator.proposer, "sampling", "coupled")
    prompt = llm.tokenizer.encode("3: " + TEXT)
    rates = []
    for most in (3, 1):  # every draft a step may make, then one at a time: other windows, the same tokens
        monkeypatch.setattr(speculator_module, "choose_draft_lengths",
                            lambda rates, caps, *costs, most=most: [min(c, most) for c in caps])
        on, rate = sampled_tokens(llm, speculator, prompt, seeded(SAMPLES))
        assert on == spec_off_samples
        rates.append(rate)
    monkeypatch.setattr(speculator.proposer, "sampling", "greedy")
    _, greedy_rate = sampled_tokens(llm, speculator, prompt, seeded(SAMPLES))
    assert rates[0] > greedy_rate + 0.05, (rates, greedy_rate)


def test_a_broken_rejection_rule_fails_end_to_end(wide_draft, spec_off_samples, always_draft, monkeypatch):
    """Keeping every sampled draft makes the tokens the draft's, not the target's: the chi-square sees it."""
    from batchgen.engine.backends.torch import ops

    llm, speculator = wide_draft, wide_draft.engine.speculator
    prompt = llm.tokenizer.encode("3: " + TEXT)
    monkeypatch.setattr(ops, "probabilistic_acceptance", lambda u, p, q: torch.ones_like(p, dtype=torch.bool))
    on, _ = sampled_tokens(llm, speculator, prompt, seeded(SAMPLES, first_seed=10_000))
    stat, df = chi_square(spec_off_samples, on)
    assert stat > chi2_999(df), (stat, df)
