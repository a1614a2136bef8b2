"""OpenAI Batch files in and out: request parsing, result and error lines checked with the openai package's types."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from batchgen.io.openai_batch import BatchRequestError, parse_request, result_line
from batchgen.pipeline.runner import run_job
from batchgen.pipeline.spec import spec_from_dict
from batchgen.report import build_report
from batchgen.report.data import load_report_data
from tests.job_helpers import tiny_llm  # noqa: F401
from tests.test_cli import invoke, shared_engine  # noqa: F401

openai_types = pytest.importorskip("openai.types")
pytest.importorskip("xgrammar")
from openai.types import BatchError, Completion, CompletionUsage  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "confidence": {"type": "integer", "minimum": 0, "maximum": 10}},
          "required": ["answer", "confidence"], "additionalProperties": False}


def line(custom_id, url=CHAT, **body):
    if url == CHAT:
        body.setdefault("messages", [{"role": "user", "content": f"Say something about {custom_id}."}])
    else:
        body.setdefault("prompt", f"The quick brown fox {custom_id}")
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "any", **body}}


GOOD = [
    line("c1", max_tokens=5),
    line("c2", messages=[{"role": "developer", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                      {"type": "text", "text": "there"}]}],
         max_completion_tokens=4, temperature=0.7, top_p=0.9, seed=3, logprobs=True, n=1),
    line("c3", max_tokens=60, response_format={"type": "json_schema",
                                               "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}),
    line("p1", COMPLETIONS, max_tokens=5, stop=["\n"], logprobs=0),
    line("p2", COMPLETIONS, prompt=[5, 6, 7, 8], max_tokens=3),
]
BAD = {  # custom_id the error record carries -> the line
    "requests.jsonl:5": "{this is not json",
    "requests.jsonl:6": {k: v for k, v in line("x").items() if k != "custom_id"},
    "c1#dup1": line("c1", max_tokens=2),
    "u1": line("u1", url="/v1/embeddings"),
    "n2": line("n2", n=2),
    "t1": line("t1", tools=[{"type": "function"}]),
    "s1": line("s1", response_format={"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}),
    "sd": line("sd", seed=2**64),  # past int64: this line's error, not the job's
}


def write_requests(path: Path) -> Path:
    lines = [json.dumps(x) for x in GOOD] + [x if isinstance(x, str) else json.dumps(x) for x in BAD.values()]
    path.write_text("\n".join(lines) + "\n")
    return path


def openai_spec(inp: Path, out: Path, **sampling) -> dict:
    return {"name": "oai", "model": {"path": "tiny"},
            "engine": {"dtype": "float32", "device": "cpu", "max_num_batched_tokens": 512, "max_num_seqs": 8},
            "input": {"path": str(inp), "format": "openai"},
            "sampling": {"max_tokens": 8, **sampling},
            "output": {"path": str(out), "format": "openai", "rows_per_part": 4}}


def read_lines(out: Path, prefix: str) -> list[dict]:
    return [json.loads(x) for p in sorted(out.glob(f"{prefix}-*.jsonl")) for x in p.read_text().splitlines()]


def check_results(out: Path) -> tuple[dict[str, dict], dict[str, dict]]:
    """Every result line parses as the openai types, every error line as its BatchError; by custom_id."""
    results, errors = read_lines(out, "part"), read_lines(out, "errors")
    urls = {x["custom_id"]: x["url"] for x in GOOD}
    for r in results:
        assert r["error"] is None and r["response"]["status_code"] == 200 and r["id"].startswith("batch_req_")
        assert r["response"]["request_id"].startswith("req_")
        chat = urls[r["custom_id"]] == CHAT if r["custom_id"] in urls else r["response"]["body"]["object"] == "chat.completion"
        kind = ChatCompletion if chat else Completion
        body = kind.model_validate(r["response"]["body"])
        usage = body.usage
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens and usage.completion_tokens > 0
    for e in errors:
        assert e["response"] is None
        BatchError.model_validate(e["error"])
        assert e["error"]["code"] and e["error"]["message"]
        usage = CompletionUsage.model_validate(e["usage"])  # the tokens it spent before it failed
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    by_id = {r["custom_id"]: r for r in results}
    errors_by_id = {e["custom_id"]: e for e in errors}
    assert len(by_id) == len(results) and len(errors_by_id) == len(errors)  # each custom_id once
    return by_id, errors_by_id


def test_openai_batch_round_trip(tmp_path, tiny_llm):
    inp, out = write_requests(tmp_path / "requests.jsonl"), tmp_path / "out"
    stats = run_job(spec_from_dict(openai_spec(inp, out)), llm=tiny_llm, quiet=True)
    results, errors = check_results(out)
    assert sorted(results) == sorted(x["custom_id"] for x in GOOD)
    assert sorted(errors) == sorted(BAD)
    assert stats["rows"] == len(GOOD) + len(BAD) and stats["error_rows"] == len(BAD)
    codes = {k: e["error"]["code"] for k, e in errors.items()}
    assert codes["c1#dup1"] == "duplicate_id" and codes["requests.jsonl:5"] == "invalid_input"
    assert {codes[k] for k in ("u1", "n2", "t1", "s1", "sd")} == {"invalid_request"}
    assert "body.seed" in errors["sd"]["error"]["message"]
    assert "tools" in errors["t1"]["error"]["message"] and "/v1/embeddings" in errors["u1"]["error"]["message"]

    body = {k: r["response"]["body"] for k, r in results.items()}
    # each line's own settings override the spec's max_tokens of 8
    assert [body[k]["usage"]["completion_tokens"] <= n for k, n in (("c1", 5), ("c2", 4), ("p2", 3))] == [True] * 3
    jsonschema.validate(json.loads(body["c3"]["choices"][0]["message"]["content"]), SCHEMA)
    assert body["c3"]["choices"][0]["finish_reason"] == "stop"
    content = body["c2"]["choices"][0]["logprobs"]["content"]
    assert len(content) == body["c2"]["usage"]["completion_tokens"] and all(t["logprob"] <= 0 for t in content)
    text_logprobs = body["p1"]["choices"][0]["logprobs"]
    assert len(text_logprobs["tokens"]) == body["p1"]["usage"]["completion_tokens"]
    assert body["p1"]["object"] == "text_completion" and body["c1"]["object"] == "chat.completion"
    assert body["c1"]["choices"][0]["logprobs"] is None


def test_repeated_lines_sample_apart_unless_they_share_a_seed(tmp_path, tiny_llm):
    """Lines without a seed are independent samples, as the API's are; lines with one seed agree; a rerun
    gives every line its tokens again."""
    prompt = [{"role": "user", "content": "Name a colour."}]
    lines = [line(f"r{i}", messages=prompt, max_tokens=8, temperature=1.0) for i in range(3)]
    lines += [line(f"s{i}", messages=prompt, max_tokens=8, temperature=1.0, seed=7) for i in range(2)]
    inp = tmp_path / "requests.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    texts = []
    for name in ("a", "b"):
        run_job(spec_from_dict(openai_spec(inp, tmp_path / name)), llm=tiny_llm, quiet=True)
        results, errors = check_results(tmp_path / name)
        assert not errors and len(results) == len(lines)
        texts.append({k: r["response"]["body"]["choices"][0]["message"]["content"] for k, r in results.items()})
    assert texts[0] == texts[1]
    assert len({texts[0][f"r{i}"] for i in range(3)}) == 3 and texts[0]["s0"] == texts[0]["s1"]


def test_resume_keeps_every_custom_id_exactly_once(tmp_path, tiny_llm):
    inp, out = write_requests(tmp_path / "requests.jsonl"), tmp_path / "out"
    spec = spec_from_dict(openai_spec(inp, out))
    run_job(spec, llm=tiny_llm, quiet=True, limit=6)
    first = read_lines(out, "part") + read_lines(out, "errors")
    assert not (out / "_SUCCESS").exists()  # a --limit trial: the next run adds the rest
    run_job(spec, llm=tiny_llm, quiet=True)
    results, errors = check_results(out)
    assert sorted(results) + sorted(errors) == sorted(x["custom_id"] for x in GOOD) + sorted(BAD)
    again = read_lines(out, "part") + read_lines(out, "errors")
    assert all(x in again for x in first)  # committed lines were kept, not rewritten


def test_openai_batch_command(tmp_path, tiny_model, shared_engine):
    inp = tmp_path / "requests.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in GOOD))
    res = invoke("openai-batch", "-i", str(inp), "-o", str(tmp_path / "out"), "--model", str(tiny_model), "-q")
    assert res.exit_code == 0, res.output
    results, errors = check_results(tmp_path / "out")
    assert sorted(results) == sorted(x["custom_id"] for x in GOOD) and not errors
    assert (tmp_path / "out" / "_SUCCESS").exists()


@pytest.mark.parametrize("request_line, message", [
    ({**line("a"), "extra": 1}, "unsupported field 'extra'"),
    (line("a", url="/v1/embeddings"), "url '/v1/embeddings' is not supported"),
    ({**line("a"), "method": "GET"}, "method must be POST"),
    (line("a", n=3), "body.n=3 is not supported"),
    (line("a", stream=True), "body.stream=True is not supported"),
    (line("a", messages=[{"role": "tool", "content": "x"}]), "role 'tool' is not supported"),
    (line("a", messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "only text parts"),
    (line("a", temperature=3), "body.temperature must be between 0 and 2"),
    (line("a", presence_penalty=2.5), "body.presence_penalty must be between -2 and 2"),
    (line("a", max_tokens=0), "body.max_tokens must be between 1"),
    (line("a", logprobs=1), "body.logprobs must be true or false"),
    (line("a", COMPLETIONS, logprobs=2), "only 0"),
    (line("a", COMPLETIONS, prompt=["a", "b"]), "one prompt per line"),
    (line("a", response_format={"type": "xml"}), "response_format.type"),
    ({**line("a"), "custom_id": 7}, "custom_id must be a non-empty string"),
])
def test_unsupported_requests_are_named(request_line, message):
    with pytest.raises(BatchRequestError, match=None) as info:
        parse_request(request_line)
    assert message in info.value.message


def test_supported_requests_map_to_engine_settings():
    chat = parse_request(line("a", max_tokens=9, max_completion_tokens=7, temperature=0, seed=4, stop="END",
                              response_format={"type": "json_object"}, user="u", top_logprobs=0,
                              frequency_penalty=0.5, presence_penalty=-1))
    assert chat.is_chat and chat.messages == [{"role": "user", "content": "Say something about a."}]
    assert chat.sampling == {"max_tokens": 7, "temperature": 0.0, "seed": 4, "stop": ["END"],
                             "frequency_penalty": 0.5, "presence_penalty": -1.0,
                             "json_schema": {"type": "object"}, "regex": None, "choice": None}
    text = parse_request(line("b", COMPLETIONS, prompt=["one prompt"], logprobs=0,
                              response_format={"type": "text"}))
    assert text.prompt == "one prompt" and text.sampling == {"logprobs": True, "json_schema": None,
                                                            "regex": None, "choice": None}


def test_report_reads_an_openai_output(tmp_path, tiny_llm):
    """batchgen report on an OpenAI-format folder: tokens and finish reasons from the result lines' usage
    and choices, error codes from the errors files (a part of errors only has an empty results file)."""
    inp, out = write_requests(tmp_path / "requests.jsonl"), tmp_path / "out"
    stats = run_job(spec_from_dict(openai_spec(inp, out)), llm=tiny_llm, quiet=True)
    results, errors = check_results(out)
    assert any(p.stat().st_size == 0 for p in out.glob("part-*.jsonl")), "the input should make an all-error part"
    rows = load_report_data(str(out)).rows
    assert sorted(rows["id"].to_list()) == sorted([*results, *errors])
    ok = rows.filter(rows["error_code"].is_null())
    usage = [r["response"]["body"]["usage"] for r in results.values()]
    assert ok["prompt_tokens"].sum() == sum(u["prompt_tokens"] for u in usage) == stats["prompt_tokens"]
    assert ok["completion_tokens"].sum() == sum(u["completion_tokens"] for u in usage) == stats["completion_tokens"]
    reasons = {k: r["response"]["body"]["choices"][0]["finish_reason"] for k, r in results.items()}
    assert dict(zip(ok["id"].to_list(), ok["finish_reason"].to_list(), strict=True)) == reasons
    failed = rows.filter(rows["error_code"].is_not_null())
    assert dict(zip(failed["id"].to_list(), failed["error_code"].to_list(), strict=True)) == \
        {k: e["error"]["code"] for k, e in errors.items()}
    assert f'data-key="error_rows" data-value="{len(errors)}"' in build_report(str(out))


def test_cut_requests_are_length_results_and_errors_count_their_tokens(tmp_path, tiny_llm):
    """As the Batch API does: a request cut by max_tokens (under a json_schema too) or by the context is a 200
    result with finish_reason "length" and its partial content; an error line carries the tokens it spent, and
    stats.json counts them."""
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    lines = [line("cut", max_tokens=3, response_format=schema),
             line("ctx", COMPLETIONS, prompt=[5 + i % 50 for i in range(tiny_llm.max_model_len - 4)], max_tokens=100),
             line("stopped", max_tokens=20, response_format=schema, stop=["{"])]
    inp, out = tmp_path / "requests.jsonl", tmp_path / "out"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    stats = run_job(spec_from_dict(openai_spec(inp, out)), llm=tiny_llm, quiet=True)
    results, errors = check_results(out)
    assert sorted(results) == ["ctx", "cut"] and sorted(errors) == ["stopped"]
    cut = ChatCompletion.model_validate(results["cut"]["response"]["body"])
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3
    assert cut.choices[0].message.content.startswith("{")
    ctx = Completion.model_validate(results["ctx"]["response"]["body"])
    assert ctx.choices[0].finish_reason == "length" and ctx.usage.completion_tokens < 100
    spent = errors["stopped"]["usage"]
    assert errors["stopped"]["error"]["code"] == "incomplete_json" and spent["prompt_tokens"] > 0
    bodies = [r["response"]["body"]["usage"] for r in results.values()] + [spent]
    assert stats["prompt_tokens"] == sum(u["prompt_tokens"] for u in bodies)
    assert stats["completion_tokens"] == sum(u["completion_tokens"] for u in bodies)


def test_a_schema_no_output_could_follow_is_that_lines_error(tmp_path, tiny_llm):
    """Schemas nested past the checker, referring outside themselves or that constrained decoding cannot compile
    are invalid_request lines; the other lines run."""
    deep: dict = {"type": "integer"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"x": deep}, "required": ["x"]}
    bad = {"deep": deep, "remote": {"type": "object", "properties": {"b": {"$ref": "http://example.com/x.json"}}},
           "empty_range": {"type": "integer", "minimum": 10, "maximum": 1}}
    lines = [line(name, max_tokens=5, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": s}})
             for name, s in bad.items()] + [line("plain", max_tokens=5)]
    inp, out = tmp_path / "requests.jsonl", tmp_path / "out"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run_job(spec_from_dict(openai_spec(inp, out)), llm=tiny_llm, quiet=True)
    results, errors = check_results(out)
    assert sorted(results) == ["plain"] and sorted(errors) == sorted(bad)
    messages = {k: e["error"]["message"] for k, e in errors.items()}
    assert all(e["error"]["code"] == "invalid_request" for e in errors.values())
    assert messages["deep"].endswith("schema: nested too deeply to check")
    assert "only references inside the schema" in messages["remote"]
    assert messages["empty_range"].endswith("cannot compile: Invalid range: minimum greater than maximum")


def test_logprobs_carry_each_tokens_own_bytes_and_offsets_count_characters():
    """A character split across tokens: chat logprobs give each token's own bytes; completion offsets count the
    characters before each token, the split one where it ends."""
    pieces = [b"Hi", b" \xf0\x9f", b"\x98\x80", b"!"]  # "Hi 😀!": the emoji's 4 bytes over two tokens
    tokens = [{"token": b.decode("utf-8", "replace"), "bytes": list(b), "logprob": -0.5} for b in pieces]
    row = {"custom_id": "a", "model": "m", "output": "Hi 😀!", "finish_reason": "stop", "prompt_tokens": 3,
           "completion_tokens": 4, "logprobs": tokens}
    chat = result_line({**row, "url": CHAT}, 0)["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert [bytes(t["bytes"]) for t in chat] == pieces and b"".join(pieces).decode() == row["output"]
    text = result_line({**row, "url": COMPLETIONS}, 0)["response"]["body"]["choices"][0]["logprobs"]
    assert text["text_offset"] == [0, 2, 3, 4] and row["output"][text["text_offset"][-1]:] == "!"
