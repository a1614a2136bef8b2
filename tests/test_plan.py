"""``batchgen plan``: the counts it predicts are the ones the real run records, with the tokenizer alone."""
from __future__ import annotations

import json
import shutil

import fsspec
import pytest
import yaml
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.engine import LLM
from batchgen.engine.loading.loader import load_model_source
from batchgen.io import read_output
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.plan import Rates, format_plan, plan_job, rates_from
from batchgen.pipeline.runner import run_job
from tests.job_helpers import make_spec, records, spec_dict, tiny_llm, write_jsonl  # noqa: F401
from tests.test_gguf import write_gguf


def messy_input(tmp_path, n: int = 30):
    """Rows of every kind: ok, null values, a duplicate id, a malformed line, and long prompts."""
    recs = records(n)
    recs[3]["text"] = None
    recs[7]["id"] = recs[6]["id"]
    for i in (10, 11):  # 23 and 36 words, 8 times over: well past 150 tokens
        recs[i]["text"] = " ".join([recs[i]["text"]] * 8)
    path = write_jsonl(tmp_path / "in.jsonl", recs)
    with open(path, "a", encoding="utf-8") as f:
        f.write("{not json\n\n")
    return path


def error_codes(rows) -> dict[str, int]:
    codes: dict[str, int] = {}
    for r in rows:
        if r["error"]:
            codes[r["error"]["code"]] = codes.get(r["error"]["code"], 0) + 1
    return dict(sorted(codes.items()))


@pytest.mark.parametrize("truncate", ["error", "left"])
def test_plan_counts_equal_the_run(tmp_path, tiny_model, tiny_llm, truncate):
    inp, out = messy_input(tmp_path), tmp_path / "out"
    spec = make_spec(tiny_model, inp, out, batching={"max_prompt_tokens": 150, "truncate": truncate,
                                                     "sort_window": 7})
    plan = plan_job(spec)
    stats = run_job(spec, llm=tiny_llm, quiet=True)
    rows = read_output(str(out))
    assert plan["rows"] == stats["rows"] == len(rows) == 31
    assert plan["requests"] == stats["ok_rows"] and plan["committed_rows"] == 0 and not plan["complete"]
    assert plan["token_budget"] == stats["engine"]["token_budget"] == tiny_llm.engine.token_budget
    assert plan["prompt_tokens"] == stats["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)
    assert plan["error_rows"] == error_codes(rows)
    assert set(plan["error_rows"]) >= {"null_value", "duplicate_id", "invalid_input"}
    assert plan["over_max_prompt_tokens"] == 2
    if truncate == "error":
        assert plan["error_rows"]["prompt_too_long"] == 2
    else:
        assert "prompt_too_long" not in plan["error_rows"]
        assert sum(r["prompt_tokens"] == 150 for r in rows) == 2
    lengths = sorted(r["prompt_tokens"] for r in rows if r["error"] is None)
    assert plan["prompt_length"]["max"] == lengths[-1] and plan["prompt_length"]["min"] == lengths[0]
    assert sum(h["rows"] for h in plan["prompt_length"]["histogram"]) == len(lengths)
    steps = plan["expected_steps"]
    assert steps["steps"] == steps["prefill_steps"] + steps["decode_steps"] and steps["prompt_tokens"] == \
        plan["prompt_tokens"]


def test_plan_after_a_partial_run_counts_what_is_left(tmp_path, tiny_model, tiny_llm):
    inp, out = write_jsonl(tmp_path / "in.jsonl", records(20)), tmp_path / "out"
    spec = make_spec(tiny_model, inp, out, output={"rows_per_part": 4})
    first = run_job(spec, llm=tiny_llm, quiet=True, limit=8)  # a trial: the job is not complete
    plan = plan_job(spec, completion_tokens=3)
    second = run_job(spec, llm=tiny_llm, quiet=True)
    assert plan["committed_rows"] == first["rows"] == 8 and not plan["complete"]
    assert plan["rows"] == second["this_run"]["rows"] == 12
    assert plan_job(spec)["complete"]  # a finished job: running it again does nothing
    assert plan["prompt_tokens"] == second["this_run"]["prompt_tokens"]
    assert plan["completion_tokens_per_row"] == 3
    assert plan_job(spec, limit=10)["rows"] == 0  # the first 10 rows are all committed now


def test_plan_needs_no_weights(tmp_path, tiny_model, tiny_llm):
    bare = shutil.copytree(tiny_model, tmp_path / "bare")
    (bare / "model.safetensors").unlink()
    source = load_model_source(str(bare), weights=False)
    with pytest.raises(RuntimeError, match="without its weights"):
        next(iter(source.weights()))
    inp = write_jsonl(tmp_path / "in.jsonl", records(9))
    plan = plan_job(make_spec(bare, inp, tmp_path / "plan-out"))
    stats = run_job(make_spec(tiny_model, inp, tmp_path / "out"), llm=tiny_llm, quiet=True)
    assert plan["prompt_tokens"] == stats["prompt_tokens"] and plan["rows"] == stats["rows"] == 9
    assert not (tmp_path / "plan-out").exists()  # a plan writes nothing


def test_plan_budget_is_per_engine_step_over_the_data_parallel_replicas(tmp_path, tiny_model):
    """As the job's stats count it (LLMEngine.token_budget): one engine step runs a step of every replica."""
    inp = write_jsonl(tmp_path / "in.jsonl", records(8))
    spec = make_spec(tiny_model, inp, tmp_path / "out", engine={"data_parallel_size": 2})
    plan = plan_job(spec)
    assert plan["token_budget"] == 2 * plan["max_num_batched_tokens"] == 2 * 512 == spec.engine_config().token_budget
    assert plan["data_parallel_size"] == 2 and plan["max_num_seqs"] == 8
    text = format_plan(plan)
    assert "token budget of 1,024 tokens and 16 sequences per step (2 data-parallel replicas of 512 tokens" in text


def test_plan_with_a_gguf_model_equals_its_run(tmp_path, tiny_model):
    gguf_file = write_gguf(tiny_model, tmp_path / "tiny.gguf", "llama")
    inp = write_jsonl(tmp_path / "in.jsonl", records(8))
    spec = make_spec(gguf_file, inp, tmp_path / "out")
    plan = plan_job(spec)
    llm = LLM(str(gguf_file), dtype="float32", device="cpu", max_num_batched_tokens=512, max_num_seqs=8,
              kv_cache_memory=64 << 20)
    stats = run_job(spec, llm=llm, quiet=True)
    assert plan["prompt_tokens"] == stats["prompt_tokens"] > 0 and plan["requests"] == stats["ok_rows"] == 8


def test_remote_model_folder_is_fetched_without_weights(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    fs = fsspec.filesystem("memory")
    for f in tiny_model.iterdir():
        fs.pipe_file(f"/models/tiny/{f.name}", f.read_bytes())
    source = load_model_source("memory://models/tiny", weights=False)
    fetched = [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert "config.json" in fetched and "tokenizer.json" in fetched
    assert not [n for n in fetched if n.endswith(".safetensors")]
    assert source.tokenizer.encode("the quick brown fox")
    fs.rm("/models", recursive=True)


def test_estimate_from_an_earlier_job(tmp_path, tiny_model, tiny_llm):
    inp = write_jsonl(tmp_path / "in.jsonl", records(10))
    earlier = tmp_path / "earlier"
    stats = run_job(make_spec(tiny_model, inp, earlier), llm=tiny_llm, quiet=True)
    rates = rates_from(str(earlier))
    engine = stats["engine"]
    assert rates.prefill_tokens_per_s == engine["prefill_tokens_per_s"] > 0
    assert rates.decode_tokens_per_s == engine["decode_tokens_per_s"]
    assert rates.completion_tokens_per_row == stats["completion_tokens"] / stats["ok_rows"]
    from_file = str(earlier / "stats.json")
    assert rates_from(from_file) == Rates(**{**rates.__dict__, "source": from_file})
    plan = plan_job(make_spec(tiny_model, inp, tmp_path / "next"), rates=rates)
    steps = plan["expected_steps"]
    expected = (plan["prompt_tokens"] * (1 - rates.prefix_cache_hit_rate) / rates.prefill_tokens_per_s
                + steps["decode_step_tokens"] / rates.decode_tokens_per_s)
    assert plan["estimated_s"] == round(expected, 1)
    assert plan["completion_tokens_per_row"] == round(rates.completion_tokens_per_row)

    (earlier / "stats.json").write_text(json.dumps({k: v for k, v in stats.items() if k != "engine"}))
    with pytest.raises(JobError, match="no engine rates"):
        rates_from(str(earlier))


def test_plan_command(tmp_path, tiny_model, tiny_llm):
    inp = messy_input(tmp_path)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec_dict(tiny_model, inp, tmp_path / "out")))
    res = CliRunner().invoke(main, ["plan", str(job), "--json", "--limit", "12", "--prefill-tok-s", "1000",
                                    "--decode-tok-s", "100"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)
    assert plan["rows"] == 12 and plan["estimated_s"] > 0 and plan["rates"]["source"] == "options"
    res = CliRunner().invoke(main, ["plan", str(job), "--prefill-tok-s", "1000", "--decode-tok-s", "100",
                                    "--cost-per-hour", "2.5"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    for needle in ("31 rows to run", "prompt tokens: ", "prompt length: min", "expected engine steps",
                   "estimated time: ", "cost "):
        assert needle in res.stdout, needle
    res = CliRunner().invoke(main, ["plan", str(job), "--rates-from", str(tmp_path / "nowhere")])
    assert res.exit_code == 1 and "holds no engine rates" in res.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(spec_dict(tmp_path / "no-model", inp, tmp_path / "out")))
    res = CliRunner().invoke(main, ["plan", str(bad)])
    assert res.exit_code == 1 and "cannot load the tokenizer" in res.stderr


def test_plan_counts_character_cuts_apart_and_steps_with_each_rows_own_token_cap(tmp_path, tiny_model):
    """Rows refused by max_prompt_chars are not 'over max_prompt_tokens'; a row generates at most what its own
    max_tokens (an OpenAI Batch line's) or the context leaves it."""
    from batchgen.pipeline.steps import estimate_steps

    chars = plan_job(make_spec(tiny_model, messy_input(tmp_path), tmp_path / "out",
                               batching={"max_prompt_chars": 200}))
    assert chars["error_rows"]["prompt_too_long"] > 0 and chars["over_max_prompt_tokens"] == 0
    est = estimate_steps([(10, 3), (10, 5)], 128, 1000, 8)  # both prefill in one step, then 4 decode steps
    assert (est.steps, est.decode_steps, est.decode_step_tokens) == (5, 4, (3 - 1) + (5 - 1))
    assert estimate_steps([(10, 7), (12, 7)], 128, 16, 8).to_dict() == estimate_steps([10, 12], 7, 16, 8).to_dict()
