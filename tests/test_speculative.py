"""Speculative decoding on the tiny model: lossless against spec off (greedy token for token, logprobs, seeded
sampling, its distribution), through chunked prefill, preemption, stops and max_tokens, grammar rows."""
from __future__ import annotations

import json
from collections import Counter

import jsonschema
import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.speculative import speculator as speculator_module
from batchgen.engine.backends.torch import ops as torch_ops
from batchgen.engine.speculative.config import SpeculativeConfig
from batchgen.engine.speculative.speculator import Speculator
from tests.engine_helpers import TEXT, mixed_prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=True)


def chi2_999(df: int) -> float:
    """The chi-square distribution's 0.999 quantile (Wilson-Hilferty; within 1 % of scipy's from df 3)."""
    h = 2 / (9 * df)
    return df * (1 - h + 3.0902 * h ** 0.5) ** 3


def make_llm(path, spec: dict | None = None, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 16 << 20)
    kw.setdefault("max_num_batched_tokens", 48)  # chunked prefill: steps mix prompt chunks and decodes
    return LLM(str(path), dtype="float32", device="cpu", speculative_config=spec or {}, **kw)


class Toggle:
    """One engine run with speculation off or on (its own ngram speculator, or a given proposer's)."""

    def __init__(self, llm: LLM):
        self.llm, self.ngram = llm, llm.engine.speculator

    def off(self, prompts, params):
        return self.run(None, prompts, params)

    def on(self, prompts, params, proposer=None, config: dict | None = None):
        engine = self.llm.engine
        spec = SpeculativeConfig.from_dict(config) if config else self.ngram.config
        speculator = self.ngram if proposer is None and config is None else \
            Speculator(spec, engine.max_model_len, self.vocab, proposer)
        return self.run(speculator, prompts, params)

    def run(self, speculator, prompts, params):
        engine = self.llm.engine
        engine.speculator = speculator
        engine.reset_metrics()
        outs = self.llm.generate(prompts, params)
        no_leak(self.llm)
        return outs

    def figures(self) -> dict:
        (figures,) = self.llm.metrics()["speculative"].values()
        return figures

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def vocab(self) -> int:
        return self.llm.engine.model_config.vocab_size


@pytest.fixture(scope="module")
def narrow(tiny_model):
    """A small token budget: chunked prefill, steps that mix prompt chunks, decodes and verifications."""
    llm = make_llm(tiny_model, NGRAM)
    yield Toggle(llm)
    llm.close()


@pytest.fixture(scope="module")
def wide(tiny_model):
    """Hundreds of requests at once (the sampling distributions)."""
    llm = make_llm(tiny_model, NGRAM, max_num_batched_tokens=2048, max_num_seqs=512, kv_cache_memory=64 << 20)
    yield Toggle(llm)
    llm.close()


@pytest.fixture
def always_draft(monkeypatch):
    """The cost model out of the way: every decoding sequence drafts as many tokens as it may."""
    monkeypatch.setattr(speculator_module, "choose_draft_lengths", lambda rates, caps, *costs: list(caps))


class ReferenceProposer:
    """Proposes a known continuation of each prompt (``shift`` 0: the target's own; else always wrong)."""

    def __init__(self, continuations: dict[tuple, list[int]], vocab: int, shift: int = 0):
        self.continuations, self.vocab, self.shift = continuations, vocab, shift
        self.prompts: dict[int, tuple] = {}

    def add_request(self, seq_id, prompt):
        self.prompts[seq_id] = tuple(prompt)

    def propose(self, seq_id, tokens, k):
        prompt = self.prompts[seq_id]
        done, ref = list(tokens[len(prompt):]), self.continuations[prompt]
        if ref[:len(done)] != done:
            return []
        return [(t + self.shift) % self.vocab for t in ref[len(done):len(done) + k]]

    def finish(self, seq_id, tokens, num_prompt_tokens):
        del self.prompts[seq_id]


def same_outputs(a, b, logprobs: bool = True) -> None:
    for x, y in zip(a, b, strict=True):
        assert (x.token_ids, x.finish_reason, x.text) == (y.token_ids, y.finish_reason, y.text)
        if logprobs:
            assert len(x.logprobs) == len(y.logprobs) == len(x.token_ids)
            assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-5


def no_leak(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished() and bm.num_free_blocks == len(bm.blocks)


def references(outs) -> dict[tuple, list[int]]:
    return {tuple(o.prompt_token_ids): o.token_ids for o in outs}


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_equals_spec_off_in_mixed_steps(narrow, always_draft, method):
    prompts = mixed_prompts(narrow.llm, repeats=(1, 3, 2))
    off = narrow.off(prompts, GREEDY)
    on = narrow.on(prompts, GREEDY, config={**NGRAM, "method": method} if method == "ngram" else
                   {"method": method, "num_speculative_tokens": 4})
    same_outputs(off, on)
    figures = narrow.figures()
    assert figures["proposed_tokens"] > 0 and figures["draft_rows"] > 0


@pytest.mark.parametrize("shift", [0, pytest.param(1, marks=pytest.mark.slow)],
                         ids=["target-continuation", "always-wrong"])
def test_known_drafts_are_kept_or_rejected_and_outputs_stay(narrow, always_draft, shift):
    prompts = mixed_prompts(narrow.llm, repeats=(1, 2))
    params = SamplingParams(max_tokens=23, temperature=0, ignore_eos=True, logprobs=True)  # not a multiple of 5
    off = narrow.off(prompts, params)
    on = narrow.on(prompts, params, ReferenceProposer(references(off), narrow.vocab, shift))
    same_outputs(off, on)
    assert all(len(o.token_ids) == 23 for o in on)
    figures = narrow.figures()
    if shift == 0:  # long accepted runs: most of the output came from drafts
        assert figures["acceptance_rate"] == 1.0 and figures["mean_accepted_length"] > 4
        assert figures["steps_saved"] > len(prompts) * 23 * 0.6
    else:
        assert figures["accepted_tokens"] == 0 and figures["proposed_tokens"] > 0


@pytest.mark.slow
def test_preemption_under_a_small_kv_budget(tiny_model, narrow, always_draft):
    prompts = [narrow.tokenizer.encode(f"{i} " + TEXT * 3)[:60] for i in range(5)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=True)
    off = narrow.off(prompts, params)
    per_block = narrow.llm.engine.executor.kv_layout.bytes_per_block(16, torch.float32)
    small = Toggle(make_llm(tiny_model, NGRAM, max_num_batched_tokens=256, kv_cache_memory=per_block * 16))
    on = small.on(prompts, params, ReferenceProposer(references(off), small.vocab))
    same_outputs(off, on)
    assert small.llm.metrics()["preemptions"] > 0 and small.figures()["accepted_tokens"] > 0
    small.llm.close()


def test_stop_string_inside_an_accepted_run(narrow, always_draft):
    prompt = narrow.tokenizer.encode("7: " + TEXT)
    ref = narrow.off([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    stop = narrow.tokenizer.decode(ref.token_ids[12:14])  # two tokens deep inside a run of 5
    assert stop.strip() and stop not in narrow.tokenizer.decode(ref.token_ids[:12])
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop], logprobs=True)
    off = narrow.off([prompt], params)
    on = narrow.on([prompt], params, ReferenceProposer({tuple(prompt): ref.token_ids}, narrow.vocab))
    same_outputs(off, on)
    assert on[0].finish_reason == "stop" and len(on[0].token_ids) < 30


SAMPLES = 400


def seeded(n: int, first_seed: int = 0) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=4, temperature=1.0, top_k=2, seed=first_seed + i, ignore_eos=True)
            for i in range(n)]


def chi_square(a: list[tuple], b: list[tuple]) -> tuple[float, int]:
    """Two-sample chi-square over the outcomes seen, rare ones pooled; (statistic, degrees of freedom)."""
    ca, cb = Counter(a), Counter(b)
    keys = sorted(set(ca) | set(cb), key=lambda k: -(ca[k] + cb[k]))
    common = [k for k in keys if ca[k] + cb[k] >= 10]
    table = [(ca[k], cb[k]) for k in common] + [(sum(ca[k] for k in keys if k not in common),
                                                 sum(cb[k] for k in keys if k not in common))]
    table = [row for row in table if sum(row) > 0]
    na, nb = len(a), len(b)
    stat = 0.0
    for x, y in table:
        ea, eb = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return stat, len(table) - 1


@pytest.fixture(scope="module")
def sampling_runs(wide):
    """The prompt, its greedy continuation (the drafts), and spec off's first tokens under SAMPLES seeds
    (top-k 2 at temperature 1: each draft is kept about half the time)."""
    prompt = wide.tokenizer.encode("3: " + TEXT)
    greedy = wide.off([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].token_ids
    off = wide.off([prompt] * SAMPLES, seeded(SAMPLES))
    return prompt, greedy, [tuple(o.token_ids) for o in off]


def sampled_with_greedy_drafts(wide, prompt, greedy, params) -> list[tuple]:
    outs = wide.on([prompt] * len(params), params, ReferenceProposer({tuple(prompt): greedy}, wide.vocab))
    assert wide.figures()["proposed_tokens"] > len(params) // 2
    return [tuple(o.token_ids) for o in outs]


def test_seeded_sampling_is_the_same_tokens_and_distribution(wide, always_draft, sampling_runs):
    prompt, greedy, off = sampling_runs
    same_seeds = sampled_with_greedy_drafts(wide, prompt, greedy, seeded(100))
    assert same_seeds == off[:100]  # the plain sampler's own noise: a seed gives the same tokens either way
    on = sampled_with_greedy_drafts(wide, prompt, greedy, seeded(SAMPLES, first_seed=10_000))
    stat, df = chi_square(off, on)  # other seeds: the same distribution
    assert df >= 3 and stat < chi2_999(df), (stat, df)


def test_a_broken_acceptance_rule_fails_the_chi_square(wide, always_draft, sampling_runs, monkeypatch):
    """Keeping half the rejected drafts anyway (accepting with more than p(draft)) skews the distribution."""
    prompt, greedy, off = sampling_runs
    generator = torch.Generator().manual_seed(0)
    monkeypatch.setattr(torch_ops, "acceptance_rule", lambda drafts, targets: (drafts == targets) | (
        torch.rand(drafts.shape, generator=generator) < 0.5))
    on = sampled_with_greedy_drafts(wide, prompt, greedy, seeded(SAMPLES, first_seed=10_000))
    stat, df = chi_square(off, on)
    assert stat > chi2_999(df), (stat, df)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


def test_grammar_rows_stay_schema_valid_beside_free_rows(narrow, always_draft):
    pytest.importorskip("xgrammar")
    prompts = mixed_prompts(narrow.llm, repeats=(1, 3, 2, 1))
    params = [SamplingParams(max_tokens=40, temperature=0, json_schema=SCHEMA) if i % 2 == 0 else GREEDY
              for i in range(len(prompts))]
    off = narrow.off(prompts, params)
    on = narrow.on(prompts, params)
    same_outputs(off, on, logprobs=False)
    for out in on[::2]:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert narrow.figures()["proposed_tokens"] > 0


@pytest.mark.parametrize("shift", [0, pytest.param(1, marks=pytest.mark.slow)],
                         ids=["target-continuation", "always-wrong"])
def test_grammar_rows_verify_drafts_under_each_positions_mask(narrow, always_draft, shift):
    """Drafts walk the grammar's matcher: each position is sampled under the mask after the drafts before it,
    and drafts the grammar disallows are cut before they are verified."""
    pytest.importorskip("xgrammar")
    prompts = mixed_prompts(narrow.llm, repeats=(1, 2, 3))
    params = SamplingParams(max_tokens=40, temperature=0, json_schema=SCHEMA)
    off = narrow.off(prompts, params)
    on = narrow.on(prompts, params, ReferenceProposer(references(off), narrow.vocab, shift))
    same_outputs(off, on, logprobs=False)
    for out in on:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    figures = narrow.figures()
    if shift == 0:
        assert figures["acceptance_rate"] == 1.0 and figures["mean_accepted_length"] > 3
    else:
        assert figures["accepted_tokens"] == 0


def test_verification_reuses_the_proposers_grammar_masks(narrow, always_draft, monkeypatch):
    """The proposer's grammar check computed each drafted position's mask: the verifying step takes those
    instead of walking the grammar again, and keeps spec off's tokens."""
    pytest.importorskip("xgrammar")
    from batchgen.engine.sampling import structured

    prompts = mixed_prompts(narrow.llm, repeats=(1, 2))
    params = SamplingParams(max_tokens=30, temperature=0, json_schema=SCHEMA)
    off = narrow.off(prompts, params)
    walks, walk = [], structured.draft_bitmask_rows
    monkeypatch.setattr(structured, "draft_bitmask_rows", lambda *a: (walks.append(len(a[1])), walk(*a))[1])
    on = narrow.on(prompts, params, ReferenceProposer(references(off), narrow.vocab, 0))
    same_outputs(off, on, logprobs=False)
    assert narrow.figures()["proposed_tokens"] > 0 and walks == []


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle"}, "not supported yet"),
    ({"method": "lookahead"}, "unknown speculative_config method"),
    ({"num_speculative_tokens": 3}, "needs a 'method'"),
    ({"method": "ngram", "prompt_lookup_maxx": 3}, "unknown speculative_config key"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "must be an integer"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_max"),
    ({"method": "suffix", "prompt_lookup_min": 2}, "keys of method 'ngram'"),
    ({"method": "suffix", "max_tree_deep": 8}, "unknown suffix option"),
])
def test_bad_speculative_config_is_refused_clearly(tiny_model, config, message):
    with pytest.raises(ValueError, match=message):
        make_llm(tiny_model, config)


@pytest.mark.slow
def test_a_job_with_speculation_reports_it_in_stats_and_the_report(tmp_path, tiny_model, always_draft):
    from batchgen.pipeline.runner import run_job
    from batchgen.report import build_report
    from tests.job_helpers import make_spec, records, write_jsonl

    inp, out = write_jsonl(tmp_path / "in.jsonl", records(6)), tmp_path / "out"
    spec = make_spec(tiny_model, inp, out, engine={"speculative_config": NGRAM, "kv_cache_memory": 16 << 20},
                     sampling={"max_tokens": 12, "ignore_eos": True})
    stats = run_job(spec, quiet=True)
    figures = stats["engine"]["speculative"]["ngram"]
    assert figures["proposed_tokens"] > 0 and figures["draft_rows"] > 0
    assert figures["accepted_tokens"] == figures["steps_saved"] <= figures["proposed_tokens"]
    saved = json.loads((out / "stats.json").read_text())
    assert saved["engine"]["speculative"] == stats["engine"]["speculative"]
    page = build_report(str(out))
    chart = page.split('id="chart-speculation"', 1)[1].split("</figure>", 1)[0]
    rate = figures["acceptance_rate"]
    assert f"{rate:.0%} accepted" in chart and "accepted drafts" in chart


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2}, {"data_parallel_size": 2}], ids=["tp2", "dp2"])
def test_worker_processes_verify_drafts_like_one_device(tiny_model, narrow, always_draft, split):
    prompts = mixed_prompts(narrow.llm, repeats=(1, 3, 2))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=True)
    off = narrow.off(prompts, params)
    llm = make_llm(tiny_model, NGRAM, kv_cache_memory=1 << 22, distributed_timeout_s=60, **split)
    split_run = Toggle(llm)
    on = split_run.on(prompts, params, ReferenceProposer(references(off), split_run.vocab))
    same_outputs(off, on)
    assert split_run.figures()["acceptance_rate"] == 1.0
    llm.close()
