"""Constrained decoding in the engine: JSON schemas, regex and choice through xgrammar, on the tiny model."""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.sampling.sampler import TokenBitmask, apply_token_bitmask
from batchgen.engine.sampling.structured import EXTRA_HINT, GrammarCompiler
from tests.engine_helpers import TEXT, mixed_prompts

pytest.importorskip("xgrammar")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "nickname": {"type": "string", "maxLength": 4},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
SCHEMAS = [
    PERSON,
    {"type": "object",  # nested objects and an array of objects
     "properties": {"owner": PERSON, "pets": {"type": "array", "maxItems": 2, "items": {
         "type": "object", "properties": {"kind": {"enum": ["cat", "dog", "fish"]}, "legs": {
             "type": "integer", "minimum": 0, "maximum": 4}}, "required": ["kind", "legs"],
         "additionalProperties": False}}},
     "required": ["owner", "pets"], "additionalProperties": False},
    {"type": "object",  # enums, booleans, bounded integer arrays
     "properties": {"color": {"enum": ["red", "green", "blue"]}, "done": {"type": "boolean"},
                    "scores": {"type": "array", "minItems": 1, "maxItems": 3,
                               "items": {"type": "integer", "minimum": -5, "maximum": 5}}},
     "required": ["color", "done", "scores"], "additionalProperties": False},
    {"type": "array", "minItems": 2, "maxItems": 3, "items": {"enum": [1, 2, 3, "x"]}},
]


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(str(tiny_model), dtype="float32", device="cpu", max_num_batched_tokens=256, max_num_seqs=16,
               kv_cache_memory=32 << 20)


def _check_json(out, schema) -> None:
    assert out.finish_reason == "stop" and out.grammar_complete is True, (out.text, out.finish_reason)
    jsonschema.validate(json.loads(out.text), schema)


def test_json_constraints_leave_out_tokens_that_would_not_decode_as_one_character():
    """Control bytes (no compact JSON holds one raw) and UTF-8-encoded surrogates (xgrammar counts one character,
    Python decodes three U+FFFD) are masked; a valid code point next to the surrogates is not."""
    from batchgen.engine.sampling.structured import _tokens_without_control_bytes

    vocab = [b"ab", b"\xed\xae\xa1", b"\xed\x9f\xbf", b"x\x01", b"", "\u4e2d".encode()]
    words = _tokens_without_control_bytes(vocab, len(vocab), keep=[4])
    assert [(int(words[0]) >> i) & 1 for i in range(len(vocab))] == [1, 0, 1, 0, 1, 1]


def test_mixed_schemas_parse_and_validate(llm):
    prompts = mixed_prompts(llm, repeats=(1, 3, 2, 1)) * 3
    schemas = [SCHEMAS[i % len(SCHEMAS)] for i in range(len(prompts))]
    params = [SamplingParams(max_tokens=160, temperature=1.0 if i % 2 else 0.0, seed=i, json_schema=s)
              for i, s in enumerate(schemas)]
    outs = llm.generate(prompts, params)
    assert len(outs) == len(schemas)
    for out, schema in zip(outs, schemas):
        _check_json(out, schema)
    assert len({o.text for o in outs}) > len(SCHEMAS)  # sampling explored, not one fixed answer per schema


def test_free_requests_get_the_same_tokens_beside_constrained_ones(llm):
    prompts = mixed_prompts(llm)
    free = [SamplingParams(max_tokens=12, temperature=t, seed=7, ignore_eos=True) for t in (0.0, 1.0)]
    alone = [o.token_ids for o in llm.generate(prompts[:2], free)]
    mixed_params = [free[0], SamplingParams(max_tokens=60, json_schema=SCHEMAS[2], seed=1), free[1],
                    SamplingParams(max_tokens=8, regex=r"[a-z]{3}", seed=2),
                    SamplingParams(max_tokens=8, choice=["a", "b"])]
    mixed = llm.generate([prompts[0], prompts[2], prompts[1], prompts[3], prompts[4]], mixed_params)
    assert [mixed[0].token_ids, mixed[2].token_ids] == alone
    assert mixed[0].grammar_complete is None and mixed[1].grammar_complete is True


def test_preemption_in_the_middle_of_constrained_requests(tiny_model, llm):
    prompts = [llm.tokenizer.encode(f"{i} " + TEXT * 2)[:40] for i in range(6)]
    schema = SCHEMAS[1]
    params = SamplingParams(max_tokens=120, temperature=0, json_schema=schema)
    expected = llm.generate(prompts, params)
    per_block = llm.engine.executor.kv_layout.bytes_per_block(16, llm.config.torch_dtype)
    small = LLM(str(tiny_model), dtype="float32", device="cpu", max_num_batched_tokens=256,
                kv_cache_memory=per_block * 12, enable_prefix_caching=False)
    got = small.generate(prompts, params)
    assert small.engine.metrics.preemptions > 0
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        _check_json(a, schema)
        assert a.token_ids == b.token_ids  # a matcher advanced twice would have changed the masks
    assert any(len(o.token_ids) > 16 for o in got)  # long enough to be preempted after generating


def test_regex_and_choice(llm):
    prompts = mixed_prompts(llm, repeats=(1, 2, 3))
    pattern = r"[A-Z][a-z]{2,5}-\d{2}"
    outs = llm.generate(prompts * 2, [SamplingParams(max_tokens=20, temperature=1.0, seed=s, regex=pattern)
                                      for s in range(6)])
    for out in outs:
        assert re.fullmatch(pattern, out.text) and out.finish_reason == "stop", out.text
    choices = ["red", "green", "dark blue"]
    outs = llm.generate(prompts * 3, [SamplingParams(max_tokens=10, temperature=1.5, seed=s, choice=choices)
                                      for s in range(9)])
    assert all(o.text in choices and o.grammar_complete for o in outs)
    assert len({o.text for o in outs}) > 1


def test_max_tokens_cuts_a_constrained_request_short(llm):
    out = llm.generate([TEXT], SamplingParams(max_tokens=3, temperature=0, json_schema=SCHEMAS[1]))[0]
    assert out.finish_reason == "length" and out.grammar_complete is False
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_a_slow_grammar_does_not_stall_the_batch(llm, monkeypatch):
    release = threading.Event()
    compile_ = GrammarCompiler._compile

    def slow_compile(self, key):
        assert release.wait(60)
        return compile_(self, key)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow_compile)
    free = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    slow = SamplingParams(max_tokens=10, regex=r"slow[0-9]")  # a key no earlier test compiled
    requests = [("slow", TEXT, slow)] + [(i, TEXT[: 30 + i], free) for i in range(4)]
    order = []
    for key, out in llm.generate_stream(iter(requests)):
        order.append(key)
        if len(order) == 4:
            release.set()  # every free request finished while the grammar was still compiling
    release.set()
    assert order[:4] == [0, 1, 2, 3] and order[4] == "slow"


def test_bad_constraints_fail_alone(llm, monkeypatch):
    outs = llm.generate([TEXT, TEXT], [SamplingParams(max_tokens=4, regex="(unclosed"),
                                       SamplingParams(max_tokens=4, temperature=0)])
    assert outs[0].finish_reason == "error" and "regex" in outs[0].error
    assert outs[1].finish_reason in ("stop", "length")
    monkeypatch.setattr("batchgen.engine.core.llm_engine.structured_available", lambda: False)
    out = llm.generate([TEXT], SamplingParams(max_tokens=4, choice=["a"]))[0]
    assert out.finish_reason == "error" and out.error == EXTRA_HINT


def test_bitmask_masks_exactly_the_disallowed_tokens_of_its_rows():
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 70, [0, 2]
    logits = torch.randn(3, vocab, generator=gen)
    bits = torch.randint(-2**31, 2**31 - 1, (2, 3), generator=gen, dtype=torch.int64).to(torch.int32)
    masked = logits.clone()
    apply_token_bitmask(masked, TokenBitmask(bits, rows))
    for i, row in enumerate(rows):
        for token in range(vocab):
            allowed = (int(bits[i, token // 32]) >> (token % 32)) & 1
            assert masked[row, token] == (logits[row, token] if allowed else float("-inf"))
    assert torch.equal(masked[1], logits[1])


def test_at_most_one_constraint():
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams(regex="a", choice=["a"])
    with pytest.raises(ValueError):
        SamplingParams(choice=[])


def test_bench_compares_a_json_schema_run_with_a_free_one(tiny_model, tmp_path):
    from click.testing import CliRunner

    from batchgen.cli import main

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMAS[2]))
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(main, ["bench", "--model", str(tiny_model), "--num-prompts", "4", "--input-len", "20",
                                    "--output-len", "60", "--dtype", "float32", "--json-schema", str(schema),
                                    "--output-json", str(out)])
    assert res.exit_code == 0, res.output
    result = json.loads(out.read_text())
    free, constrained = result["unconstrained"], result["json_schema"]
    assert free["output_tokens"] == 4 * 60 and not free.get("grammar_steps")  # ignore_eos: every token is made
    assert 4 * 6 <= constrained["output_tokens"] < 4 * 60  # each schema completes, then the request stops
    assert constrained["grammar_steps"] > 0 and constrained["mask_ms_per_step"] > 0
    assert "mask_ms_per_step" in res.output and "json_schema" in res.output
