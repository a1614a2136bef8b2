"""The batchgen CLI: exit codes, one-line errors, validate output, and runs of the example jobs."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.io import read_output
from batchgen.pipeline import preflight
from tests.job_helpers import check_output, records, spec_dict, tiny_llm, write_jsonl  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
SECRET = "hunter2-very-secret-value"


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def job_file(tmp_path: Path, model, out=None, **sections) -> Path:
    inp = tmp_path / "in.jsonl"
    if not inp.exists():
        write_jsonl(inp, records(5))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec_dict(model, inp, out or tmp_path / "out", **sections)))
    return path


@pytest.fixture
def shared_engine(monkeypatch, tiny_llm):
    """CLI runs reuse the module's engine instead of loading the model again."""
    monkeypatch.setattr(preflight, "load_model", lambda spec: tiny_llm)


def test_validate_prints_the_resolved_spec(monkeypatch):
    monkeypatch.setenv("BATCHGEN_OUT", "/data/out")
    res = invoke("validate", str(ROOT / "jobs/summarize.yaml"), "--set", "sampling.max_tokens=8",
                 "--set", f"storage_options.secret={SECRET}")
    assert res.exit_code == 0, res.output
    data = yaml.safe_load(res.stdout)
    assert data["sampling"]["max_tokens"] == 8 and data["output"]["path"] == "/data/out/summarize/"
    assert data["storage_options"]["secret"] == "***" and SECRET not in res.output


def test_validate_resolves_the_model_and_finds_the_input(tmp_path, tiny_model, monkeypatch):
    monkeypatch.chdir(ROOT)
    job = job_file(tmp_path, tiny_model)
    res = invoke("validate", str(job))
    assert res.exit_code == 0, res.output
    assert f"ok: model: model folder {tiny_model}" in res.stderr.splitlines()
    assert f"ok: input: 1 file(s): {tmp_path / 'in.jsonl'}" in res.stderr.splitlines()
    gguf = next(tiny_model.parent.rglob("*.gguf"), None)
    for model, found in [("smollm2-135m-instruct", "built-in model smollm2-135m-instruct"),
                         *([(str(gguf), f"GGUF file {gguf}")] if gguf else [])]:
        res = invoke("validate", str(job), "--set", f"model.path={model}")
        assert res.exit_code == 0 and f"ok: model: {found}" in res.stderr, res.output
    empty = tmp_path / "no-config"
    empty.mkdir()
    res = invoke("validate", str(job), "--set", f"model.path={empty}", "--set",
                 f"input.path={tmp_path / 'missing.jsonl'}")
    assert res.exit_code == 1
    assert f"error: model {empty}: model folder '{empty}' has no config.json" in res.stderr
    assert f"error: input path matches no files: {tmp_path / 'missing.jsonl'}" in res.stderr
    res = invoke("validate", str(job), "--set", f"model.path={tmp_path / 'nope'}")
    assert res.exit_code == 1 and "does not exist" in res.stderr
    res = invoke("validate", str(job), "--set", "engine.max_model_len=100000")
    assert res.exit_code == 1 and "max_model_len 100000 exceeds the model's limit" in res.stderr  # its config read
    if gguf:
        folder = tmp_path / "one-gguf"
        folder.mkdir()
        (folder / gguf.name).write_bytes(gguf.read_bytes())
        res = invoke("validate", str(job), "--set", f"model.path={folder}")
        assert res.exit_code == 0 and f"ok: model: GGUF file {folder / gguf.name}" in res.stderr, res.output
    draft = f"engine.speculative_config={{method: draft_model, model: {tmp_path / 'no-draft'}}}"
    res = invoke("validate", str(job), "--set", draft)
    assert res.exit_code == 1 and f"error: engine.speculative_config.model {tmp_path / 'no-draft'}: " in res.stderr
    res = invoke("validate", str(job), "--set", draft.replace(str(tmp_path / "no-draft"), str(tiny_model)))
    assert res.exit_code == 0 and f"ok: draft model: model folder {tiny_model}" in res.stderr.splitlines()
    (tmp_path / "in.jsonl").write_bytes(bytes(range(256)))
    res = invoke("validate", str(job))
    assert res.exit_code == 1 and "error: not JSON Lines: " in res.stderr


def test_version():
    from importlib.metadata import version

    res = invoke("--version")
    assert res.exit_code == 0 and res.stdout == f"batchgen {version('batchgen')}\n"


def test_spec_errors_exit_2_with_key_paths(tmp_path):
    res = invoke("validate", str(ROOT / "jobs/summarize.yaml"), "--set", "batching.sort_window=0",
                 "--set", "sampling.temperature=hot", "--set", "nope.x=1")
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert "error: --set nope.x: unknown key" in lines
    assert any(line.startswith("error: batching.sort_window: ") for line in lines)
    assert any(line.startswith("error: sampling.temperature: ") for line in lines)
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: {path: m}\ninput: {path: a.jsonl}\nprompt: {template: '{{ x'}\n")
    res = invoke("run", str(bad))
    assert res.exit_code == 2
    assert "error: prompt.template: template syntax error at line 1" in res.stderr
    assert "error: output: required key is missing" in res.stderr
    assert invoke("run", str(tmp_path / "missing.yaml")).exit_code == 2
    assert invoke("run").exit_code == 2  # usage
    assert invoke("run", str(bad), "--limit", "0").exit_code == 2


def test_run_and_rerun(tmp_path, tiny_model, shared_engine):
    job = job_file(tmp_path, tiny_model)
    res = invoke("run", str(job), "--quiet")
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("test-job: 5 rows (5 ok, 0 errors)") and res.stdout.count("\n") == 1
    stats = json.loads((tmp_path / "out" / "_SUCCESS").read_text())
    check_output(tmp_path / "out", stats, [f"r{i}" for i in range(5)])

    res = invoke("run", str(job), "-v")
    assert res.exit_code == 0 and "already complete" in res.stderr
    assert json.loads((tmp_path / "out" / "_SUCCESS").read_text()) == stats

    res = invoke("run", str(job), "--overwrite", "--limit", "2", "--set", "output.format=jsonl")
    assert res.exit_code == 0, res.output
    assert sorted(r["id"] for r in read_output(str(tmp_path / "out"))) == ["r0", "r1"]
    assert "test-job: 2 rows" in res.stdout and " rows [" in res.stderr  # the progress bar


def test_progress_bar_knows_the_total(tmp_path, tiny_model, shared_engine):
    job = job_file(tmp_path, tiny_model)  # 5 input rows
    res = invoke("run", str(job), "--limit", "3")
    assert res.exit_code == 0, res.output
    assert re.search(r" 3/3 rows \[\d\d:\d\d, .*ETA \d+:\d\d\]", res.stderr), res.stderr  # a total, an ETA
    assert not (tmp_path / "out" / "_SUCCESS").exists()  # a --limit trial: the next run resumes
    res = invoke("run", str(job))
    assert res.exit_code == 0, res.output
    assert re.search(r" 5/5 rows \[", res.stderr) and "test-job: 5 rows" in res.stdout, res.stderr


def test_error_rate_exceeded_exits_1(tmp_path, tiny_model, shared_engine):
    job = job_file(tmp_path, tiny_model, prompt={"template": "{{ missing_sometimes | default('') }}"},
                   max_error_rate=0.5)
    res = invoke("run", str(job), "--quiet")
    assert res.exit_code == 1
    assert res.stderr.strip() == (f"error: test-job: 5 of 5 rows failed, more than max_error_rate 0.5; "
                                  f"see the error column in {tmp_path / 'out'}")
    assert (tmp_path / "out" / "stats.json").exists() and not (tmp_path / "out" / "_SUCCESS").exists()


def one_line_error(res, *needles: str) -> None:
    assert res.exit_code == 1, res.output
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: test-job: ")
    assert "Traceback" not in res.stderr
    for needle in needles:
        assert needle in res.stderr


def test_job_failures_exit_1_with_one_line(tmp_path, tiny_model):
    missing_model = tmp_path / "no-such-model"
    res = invoke("run", str(job_file(tmp_path, missing_model)))
    one_line_error(res, "cannot load model", "does not exist")

    gpt2 = shutil.copytree(tiny_model, tmp_path / "gpt2")
    config = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    one_line_error(invoke("run", str(job_file(tmp_path, gpt2))), "GPT2LMHeadModel")

    (tmp_path / "a-file").write_text("")
    res = invoke("run", str(job_file(tmp_path, tiny_model, tmp_path / "a-file" / "out")))
    one_line_error(res, "not writable")

    res = invoke("run", str(job_file(tmp_path, tiny_model, input={"path": str(tmp_path / "x.jsonl")})))
    one_line_error(res, "input path matches no files")

    job = job_file(tmp_path, tiny_model, prompt={"template": "{{ body }}"})
    one_line_error(invoke("run", str(job)), "needs column(s) 'body'", "in.jsonl")


def test_credentials_never_printed(tmp_path, tiny_model):
    job = job_file(tmp_path, tiny_model, tmp_path / "x" / "out",
                   storage_options={"key": "AKIAIOSFODNN7EXAMPLE", "secret": SECRET},
                   input={"path": f"s3://user:{SECRET}@bucket/in.jsonl"})
    res = invoke("run", str(job), "-v")
    one_line_error(res, "cannot list input s3://***:***@bucket/in.jsonl")
    assert SECRET not in res.output and "AKIAIOSFODNN7EXAMPLE" not in res.output


@pytest.mark.slow
def test_smollm2_summarize(tmp_path, smollm2_gguf, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("BATCHGEN_OUT", str(tmp_path))
    res = invoke("run", "jobs/summarize.yaml", "--limit", "3", "--set", "sampling.max_tokens=8",
                 "--set", "model.device=cpu")
    assert res.exit_code == 0, res.output
    out = tmp_path / "summarize"
    stats = json.loads((out / "stats.json").read_text())  # a --limit trial: no _SUCCESS
    rows = check_output(out, stats, [json.loads(line)["id"] for line in
                                     (ROOT / "jobs/data/articles.jsonl").read_text().splitlines()[:3]])
    assert stats["error_rows"] == 0 and stats["model"] == "smollm2-135m-instruct"
    assert all(r["output"].strip() and r["title"] for r in rows)
    res = invoke("report", str(out))
    assert res.exit_code == 0 and (out / "report.html").is_file(), res.output
    assert f'data-key="prompt_tokens" data-value="{stats["prompt_tokens"]}"' in (out / "report.html").read_text()
