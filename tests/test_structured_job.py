"""Constrained decoding in jobs: spec validation of json_schema/regex/choice, schema-valid rows, incomplete_json."""
from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from batchgen.engine import SamplingParams
from batchgen.pipeline.sampling import SamplingSpec
from batchgen.pipeline.runner import run_job
from batchgen.pipeline.spec import SpecError, load_spec, spec_from_dict
from tests.job_helpers import (  # noqa: F401
    check_output, make_spec, records, spec_dict, tiny_llm, write_jsonl,
)
from tests.test_cli import ROOT, invoke

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {"topic": {"type": "string", "minLength": 1, "maxLength": 12},
                   "words": {"type": "integer", "minimum": 1, "maximum": 500},
                   "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["fox", "dog", "batch"]}}},
    "required": ["topic", "words", "tags"],
    "additionalProperties": False,
}


def errors(data: dict) -> list[str]:
    with pytest.raises(SpecError) as info:
        spec_from_dict(data, env={})
    return info.value.errors


def test_spec_sampling_is_the_engine_sampling_with_job_defaults(tmp_path):
    assert set(SamplingSpec.model_fields) == {f.name for f in dataclasses.fields(SamplingParams)} - {"logprobs"}
    spec = make_spec("m", tmp_path / "in.jsonl", tmp_path / "out",
                     sampling={"top_k": 5, "stop": "END", "ignore_eos": True, "choice": ["a", "b"]})
    assert spec.sampling.params() == SamplingParams(max_tokens=6, temperature=0.0, top_k=5, seed=0, stop=["END"],
                                                    ignore_eos=True, choice=["a", "b"])
    assert spec.sampling.params(max_tokens=3, choice=None).max_tokens == 3
    base = spec_dict("m", tmp_path / "in.jsonl", tmp_path / "out")
    for key, bad in (("max_tokens", 0), ("top_p", 0), ("top_p", 1.5), ("temperature", -1), ("top_k", -2)):
        assert errors({**base, "sampling": {key: bad}})[0].startswith(f"sampling.{key}: ")
        with pytest.raises(ValueError, match=key):
            SamplingParams(**{key: bad})


def test_spec_takes_an_inline_schema_or_a_file(tmp_path):
    inline = make_spec("m", tmp_path / "in.jsonl", tmp_path / "out", sampling={"json_schema": SCHEMA})
    assert inline.sampling.json_schema == SCHEMA and inline.sampling.params().json_schema == SCHEMA
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    from_file = make_spec("m", tmp_path / "in.jsonl", tmp_path / "out", sampling={"json_schema": str(path)})
    assert from_file.sampling.json_schema == SCHEMA
    assert from_file.resolved()["sampling"]["json_schema"] == SCHEMA
    assert from_file.digest() == inline.digest()  # the digest covers the schema, not where it came from
    import fsspec

    with fsspec.open("memory://schemas/extract.json", "w") as f:
        f.write(json.dumps(SCHEMA))
    from_url = make_spec("m", tmp_path / "in.jsonl", tmp_path / "out",
                         sampling={"json_schema": "memory://schemas/extract.json"})
    assert from_url.sampling.json_schema == SCHEMA
    regex = make_spec("m", tmp_path / "in.jsonl", tmp_path / "out", sampling={"regex": "[a-z]+"})
    assert regex.sampling.params().regex == "[a-z]+" and regex.sampling.params().json_schema is None


def test_spec_errors_name_their_key_path(tmp_path, monkeypatch):
    base = spec_dict("m", tmp_path / "in.jsonl", tmp_path / "out")
    bad = {**SCHEMA, "properties": {**SCHEMA["properties"], "words": {"type": "integr"}}}
    err = errors({**base, "sampling": {"json_schema": bad}})
    assert len(err) == 1 and err[0].startswith("sampling.json_schema.properties.words.type: not a valid JSON Schema")
    assert errors({**base, "sampling": {"json_schema": str(tmp_path / "none.json")}})[0].startswith(
        "sampling.json_schema: file not found")
    (tmp_path / "broken.json").write_text("{not json")
    assert "is not valid JSON" in errors({**base, "sampling": {"json_schema": str(tmp_path / "broken.json")}})[0]
    assert errors({**base, "sampling": {"regex": "a", "choice": ["a"]}}) == [
        "sampling: at most one of json_schema, regex, choice may be set, got regex, choice"]
    assert errors({**base, "sampling": {"choice": []}})[0].startswith("sampling.choice:")
    assert errors({**base, "sampling": {"regex": "("}}) == [
        "sampling.regex: Regex parsing error at position 2: The parenthesis is not closed."]
    # valid JSON Schemas that no output could be decoded or checked against: spec errors, not a job of error rows
    assert errors({**base, "sampling": {"json_schema": {"type": "integer", "minimum": 10, "maximum": 1}}}) == [
        "sampling.json_schema: a JSON Schema that constrained decoding cannot compile: Invalid range: minimum "
        "greater than maximum"]
    remote = {"type": "object", "properties": {"b": {"$ref": "http://example.com/x.json"}}}
    assert errors({**base, "sampling": {"json_schema": remote}}) == [
        "sampling.json_schema.properties.b.$ref: only references inside the schema (\"#/...\") are followed, got "
        "'http://example.com/x.json'"]
    deep: dict = {"type": "integer"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"x": deep}}
    assert errors({**base, "sampling": {"json_schema": deep}}) == ["sampling.json_schema: nested too deeply to check"]
    monkeypatch.setattr("batchgen.pipeline.sampling.structured_available", lambda: False)
    assert "pip install 'batchgen[structured]'" in errors({**base, "sampling": {"json_schema": SCHEMA}})[0]


def test_every_row_is_schema_valid_json(tmp_path, tiny_model, tiny_llm):
    recs = records(12)
    inp = write_jsonl(tmp_path / "in.jsonl", recs)
    out = tmp_path / "out"
    spec = make_spec(tiny_model, inp, out, output={"format": "jsonl"},
                     sampling={"json_schema": SCHEMA, "max_tokens": 80, "temperature": 1.0})
    stats = run_job(spec, llm=tiny_llm, quiet=True)
    rows = check_output(out, stats, [r["id"] for r in recs])
    assert stats["error_rows"] == 0
    for row in rows:
        jsonschema.validate(json.loads(row["output"]), SCHEMA)
        assert row["finish_reason"] == "stop"


def test_json_cut_short_by_max_tokens_is_a_length_result_and_a_stop_string_an_error(tmp_path, tiny_model, tiny_llm):
    inp = write_jsonl(tmp_path / "in.jsonl", records(3))
    spec = make_spec(tiny_model, inp, tmp_path / "out", sampling={"json_schema": SCHEMA, "max_tokens": 4})
    rows = check_output(tmp_path / "out", run_job(spec, llm=tiny_llm, quiet=True), ["r0", "r1", "r2"])
    # as in the OpenAI API: the partial output, with finish_reason "length"
    assert all(r["error"] is None and r["finish_reason"] == "length" and r["completion_tokens"] == 4 for r in rows)
    assert all(r["output"].startswith("{") for r in rows)

    spec = make_spec(tiny_model, inp, tmp_path / "stopped", sampling={"json_schema": SCHEMA, "stop": ["{"]})
    stats = run_job(spec, llm=tiny_llm, quiet=True)
    rows = check_output(tmp_path / "stopped", stats, ["r0", "r1", "r2"])
    assert [r["error"]["code"] for r in rows] == ["incomplete_json"] * 3
    # an error row counts the tokens it spent, and stats.json counts them
    assert all(r["prompt_tokens"] > 0 and r["completion_tokens"] >= 1 for r in rows) and stats["prompt_tokens"] > 0


def test_a_stop_string_that_cuts_a_choice_or_a_regex_match_is_an_error(tmp_path, tiny_model, tiny_llm):
    """The grammar matched the text before the stop string was cut from it: what is left is no choice, no match."""
    inp = write_jsonl(tmp_path / "in.jsonl", records(3))
    for name, sampling, code in [("choice", {"choice": ["yes", "no"], "stop": ["s", "o"]}, "incomplete_output"),
                                 ("regex", {"regex": "[0-9]{2}x", "stop": ["x"]}, "incomplete_output"),
                                 ("json", {"json_schema": SCHEMA, "stop": ["}"], "max_tokens": 80, "temperature": 1.0},
                                  "incomplete_json")]:
        spec = make_spec(tiny_model, inp, tmp_path / name, sampling=sampling)
        rows = check_output(tmp_path / name, run_job(spec, llm=tiny_llm, quiet=True), ["r0", "r1", "r2"])
        assert [(r["error"] or {}).get("code") for r in rows] == [code] * 3, name
    kept = make_spec(tiny_model, inp, tmp_path / "kept", sampling={"choice": ["yes", "no"], "stop": ["maybe"]})
    rows = check_output(tmp_path / "kept", run_job(kept, llm=tiny_llm, quiet=True), ["r0", "r1", "r2"])
    assert all(r["error"] is None and r["output"] in ("yes", "no") for r in rows)


def test_a_schema_with_its_properties_reordered_is_another_job(tmp_path, tiny_model, tiny_llm):
    """Fields are generated in the schema's order, so the reordered schema's outputs differ: no resume mixes them.
    An output that recorded its schema as a mapping (key order lost) resumes."""
    from batchgen.pipeline.errors import JobError

    inp = write_jsonl(tmp_path / "in.jsonl", records(4))
    ab = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
    ba = {**ab, "properties": dict(reversed(ab["properties"].items()))}
    out = tmp_path / "out"
    run_job(make_spec(tiny_model, inp, out, sampling={"json_schema": ab}), llm=tiny_llm, quiet=True, limit=2)
    with pytest.raises(JobError, match=r'sampling.json_schema: .*"properties":\{"a".* -> .*"properties":\{"b"'):
        run_job(make_spec(tiny_model, inp, out, sampling={"json_schema": ba}), llm=tiny_llm, quiet=True)
    job = json.loads((out / "_job.json").read_text())
    job["values"]["sampling.json_schema"] = ab  # as outputs before this recorded it
    (out / "_job.json").write_text(json.dumps(job))
    assert run_job(make_spec(tiny_model, inp, out, sampling={"json_schema": ab}), llm=tiny_llm, quiet=True,
                   limit=3)["rows"] == 3
    assert isinstance(json.loads((out / "_job.json").read_text())["values"]["sampling.json_schema"], str)
    assert run_job(make_spec(tiny_model, inp, out, sampling={"json_schema": ab}), llm=tiny_llm,
                   quiet=True)["rows"] == 4


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_extract_job_on_smollm2_gives_schema_valid_json(tmp_path, smollm2_gguf, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("BATCHGEN_OUT", str(tmp_path))
    # fp32: whether a document runs past max_tokens must not depend on how this CPU rounds bf16.
    res = invoke("run", "jobs/extract.yaml", "--set", "engine.device=cpu", "--set", "engine.dtype=float32")
    assert res.exit_code == 0, res.output
    out = tmp_path / "extract"
    stats = json.loads((out / "_SUCCESS").read_text())
    inputs = [json.loads(line) for line in (ROOT / "jobs/data/articles.jsonl").read_text().splitlines()]
    rows = check_output(out, stats, [r["id"] for r in inputs])
    schema = load_spec("jobs/extract.yaml", env={}).sampling.json_schema
    ok = [r for r in rows if r["error"] is None]
    assert len(ok) >= len(rows) - 1  # at most one document may run past max_tokens
    assert all(r["error"]["code"] == "incomplete_json" for r in rows if r["error"] is not None)
    for row in ok:
        jsonschema.validate(json.loads(row["output"]), schema)
    assert sum(bool(json.loads(r["output"])["title"].strip()) for r in ok) == len(ok)
