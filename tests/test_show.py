"""``batchgen show``: the rows of an output folder in each format (Parquet, JSONL, OpenAI Batch) as a table."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.io import read_output
from batchgen.pipeline.runner import run_job
from batchgen.report.show import MAX_CELL_CHARS, flat_row
from tests.job_helpers import make_spec, records, tiny_llm, write_jsonl  # noqa: F401


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def job_output(tmp_path: Path, tiny_model, tiny_llm, fmt: str) -> Path:  # noqa: F811
    recs = records(6)
    recs[2]["text"] = None  # an error row
    inp = write_jsonl(tmp_path / "in.jsonl", recs)
    out = tmp_path / fmt
    output = {"format": fmt, "rows_per_part": 4, "carry_columns": [] if fmt == "openai" else ["title"]}
    run_job(make_spec(tiny_model, inp, out, output=output, sampling={"max_tokens": 40, "temperature": 0.0,
                                                                     "ignore_eos": True}),
            llm=tiny_llm, quiet=True)
    return out


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "openai"])
def test_show_prints_every_format_as_a_table(tmp_path, tiny_model, tiny_llm, fmt):  # noqa: F811
    out = job_output(tmp_path, tiny_model, tiny_llm, fmt)
    rows = [flat_row(r) for r in read_output(str(out))]
    id_key = "custom_id" if fmt == "openai" else "id"
    assert len(rows) == 6 and sum(bool(r["error"]) for r in rows) == 1
    assert any(len(" ".join((r["output"] or "").split())) > MAX_CELL_CHARS for r in rows)

    res = invoke("show", str(out))
    assert res.exit_code == 0, res.output
    assert "\x1b" not in res.stdout  # control characters of the output never reach the terminal
    lines = res.stdout.splitlines()
    header = next(line for line in lines if id_key in line)
    for name in (id_key, "output", "finish_reason", "prompt_tokens", "error"):
        assert name in header
    for row in rows:
        assert any(row[id_key] in line for line in lines), row[id_key]
        text = " ".join((row["output"] or "").split())
        if len(text) > MAX_CELL_CHARS:  # long text is cut to the cell width, never printed whole
            assert text not in res.stdout
    failed = next(r for r in rows if r["error"])
    res = invoke("show", str(out), "--errors", "--columns", f"{id_key},error", "--width", "200")
    assert res.exit_code == 0, res.output
    assert failed[id_key] in res.stdout and failed["error"].split(":")[0] in res.stdout
    assert "output" not in res.stdout
    assert all(r[id_key] not in res.stdout for r in rows if not r["error"])
    res = invoke("show", str(out), "--limit", "2", "--columns", id_key)
    assert sum(r[id_key] in res.stdout for r in rows) == 2


def test_show_refuses_unknown_columns_and_empty_folders(tmp_path, tiny_model, tiny_llm):  # noqa: F811
    out = job_output(tmp_path, tiny_model, tiny_llm, "jsonl")
    res = invoke("show", str(out), "--columns", "id,nope")
    assert res.exit_code == 1 and "error: no column(s) nope in" in res.stderr and "its columns: id," in res.stderr
    res = invoke("show", str(tmp_path / "nothing"))
    assert res.exit_code == 1 and "no such output folder" in res.stderr
    (tmp_path / "empty").mkdir()
    res = invoke("show", str(tmp_path / "empty"))
    assert res.exit_code == 1 and "holds no committed rows" in res.stderr
    assert json.loads((out / "stats.json").read_text())["rows"] == 6  # show changed nothing


@pytest.mark.parametrize("fmt", ["jsonl", "openai"])
def test_a_part_changed_after_its_commit_is_named_not_shown(tmp_path, tiny_model, tiny_llm, fmt):  # noqa: F811
    out = job_output(tmp_path, tiny_model, tiny_llm, fmt)
    assert invoke("show", str(out)).exit_code == 0 and invoke("report", str(out)).exit_code == 0
    (out / "part-00000.jsonl").write_text("")
    for command in ("show", "report"):
        res = invoke(command, str(out))
        assert res.exit_code == 1 and "part-00000.jsonl holds" in res.stderr and "changed after" in res.stderr


def test_show_prints_a_finished_job_of_no_rows(tmp_path, tiny_model, tiny_llm):  # noqa: F811
    (tmp_path / "in.jsonl").write_text("")
    run_job(make_spec(tiny_model, tmp_path / "in.jsonl", tmp_path / "out"), llm=tiny_llm, quiet=True)
    res = invoke("show", str(tmp_path / "out"))
    assert res.exit_code == 0 and "no rows" in res.output
