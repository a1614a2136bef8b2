"""Bad rows become error rows and the job goes on; bad files, columns, models and outputs fail the job."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from batchgen.pipeline.errors import JobError
from batchgen.pipeline.runner import run_job
from batchgen.pipeline.spec import SpecError
from tests.job_helpers import (  # noqa: F401
    by_id, check_output, make_spec, manifest_ids, records, tiny_llm, write_jsonl,
)


def run(tmp_path: Path, model: Path, llm, inp: Path | list, **sections) -> tuple[dict, list[dict]]:
    out = tmp_path / "out"
    stats = run_job(make_spec(model, inp, out, **sections), llm=llm, quiet=True)
    return stats, [r for r in check_output(out, stats, stats_ids(out))]


def stats_ids(out: Path) -> list[str]:
    """Every id the manifest lists (check_output compares them with the rows)."""
    return manifest_ids(out)


def test_template_null_and_empty_values_are_error_rows(tmp_path, tiny_model, tiny_llm):
    recs = [{"id": "ok", "text": "the quick fox"}, {"id": "null", "text": None},
            {"id": "empty", "text": "  "}, {"id": "missing"}, {"id": "bad-filter", "text": "abc"}]
    inp = write_jsonl(tmp_path / "in.jsonl", recs)
    stats, rows = run(tmp_path, tiny_model, tiny_llm, inp,
                      prompt={"template": "{{ text }}{% if text == 'abc' %}{{ text.nope() }}{% endif %}"})
    got = {k: (v["error"] or {}).get("code") for k, v in by_id(rows).items()}
    assert got == {"ok": None, "null": "null_value", "empty": "empty_prompt", "missing": "missing_column",
                   "bad-filter": "template_error"}
    assert stats["rows"] == 5 and stats["error_rows"] == 4


def test_malformed_jsonl_and_invalid_utf8(tmp_path, tiny_model, tiny_llm):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b'{"id": "a", "text": "fox"}\n{"id": "b", "text": \n[1, 2]\n'
                    b'{"id": "c", "text": "caf\xe9"}\n{"id": "d", "text": "dog"}\n')
    stats, rows = run(tmp_path, tiny_model, tiny_llm, inp)
    got = by_id(rows)
    assert set(got) == {"a", "d", "in.jsonl:1", "in.jsonl:2", "in.jsonl:3"}
    assert got["a"]["error"] is None and got["d"]["error"] is None
    errors = {k: v["error"] for k, v in got.items() if v["error"]}
    assert all(e["code"] == "invalid_input" for e in errors.values())
    assert f"{inp} line 2: malformed JSON" in errors["in.jsonl:1"]["message"]
    assert "line 3: expected a JSON object" in errors["in.jsonl:2"]["message"]
    assert f"{inp} line 4: invalid UTF-8" in errors["in.jsonl:3"]["message"]


def test_duplicate_ids(tmp_path, tiny_model, tiny_llm):
    recs = records(3) + [{"id": "r1", "text": "again"}, {"id": "r1#dup1", "text": "sneaky"},
                         {"id": "r1", "text": "third"}, {"text": "no id"}]
    inp = write_jsonl(tmp_path / "in.jsonl", recs)
    stats, rows = run(tmp_path, tiny_model, tiny_llm, inp)
    got = by_id(rows)
    assert sorted(got) == ["in.jsonl:6", "r0", "r1", "r1#dup1", "r1#dup1#dup1", "r1#dup2", "r2"]
    assert got["r1"]["error"] is None and got["r1"]["title"] == "title 1"
    assert got["r1#dup1"]["error"]["code"] == "duplicate_id"
    assert "id 'r1' appeared earlier" in got["r1#dup1"]["error"]["message"]
    assert got["r1#dup1#dup1"]["error"]["code"] == "duplicate_id"  # the literal "r1#dup1" came later
    assert got["r1#dup2"]["error"]["code"] == "duplicate_id"
    assert got["in.jsonl:6"]["error"]["code"] == "invalid_input"  # no id column
    assert stats["rows"] == len(recs)


def test_corrupt_parquet_fails_the_job(tmp_path, tiny_model, tiny_llm):
    bad = tmp_path / "in" / "bad.parquet"
    bad.parent.mkdir()
    bad.write_bytes(b"PAR1 this is not parquet" * 10)
    with pytest.raises(JobError, match=r"corrupt or unreadable Parquet file .*bad\.parquet"):
        run_job(make_spec(tiny_model, bad, tmp_path / "out"), llm=tiny_llm, quiet=True)
    assert not (tmp_path / "out" / "_manifest").exists()


def test_missing_input_file(tmp_path, tiny_model, tiny_llm):
    good = write_jsonl(tmp_path / "a.jsonl", records(2))
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(JobError, match=f"input path matches no files: {missing}"):
        run_job(make_spec(tiny_model, [str(good), str(missing)], tmp_path / "out"), llm=tiny_llm, quiet=True)


@pytest.mark.parametrize("content", [bytes(range(256)) * 8, b"hello world\nsecond line\n", b"[1, 2]\n"])
def test_a_file_that_is_not_json_lines_says_so(tmp_path, content):
    inp = tmp_path / "random.jsonl"
    inp.write_bytes(content)
    with pytest.raises(JobError) as e:
        run_job(make_spec(tmp_path / "no-model", inp, tmp_path / "out"), quiet=True)
    assert str(e.value).startswith(f"not JSON Lines: {inp} line 1: "), e.value
    assert "needs column" not in str(e.value)


def test_missing_template_column_fails_before_compute(tmp_path):
    inp = write_jsonl(tmp_path / "a.jsonl", records(2))
    write_jsonl(tmp_path / "b.jsonl", [{"id": "x", "body": "no text column"}])
    # the model path does not exist: the column check must come first
    spec = make_spec(tmp_path / "no-model", [str(inp), str(tmp_path / "b.jsonl")], tmp_path / "out",
                     prompt={"template": "{{ text }} {{ extra }} {{ opt | default('') }}"
                                         "{% if more is defined %}{{ more }}{% endif %}"})
    with pytest.raises(JobError) as e:
        run_job(spec, quiet=True)
    msg = str(e.value)
    assert "'extra', 'text'" in msg and "a.jsonl" in msg and "b.jsonl" in msg
    assert "opt" not in msg and "more" not in msg
    with pytest.raises(JobError, match=r"needs column\(s\) 'key', missing from input file\(s\) .*a\.jsonl"):
        run_job(make_spec(tmp_path / "no-model", inp, tmp_path / "out", input={"id_column": "key"}),
                quiet=True)


def test_bad_models_fail_the_job(tmp_path, tiny_model):
    inp = write_jsonl(tmp_path / "a.jsonl", records(2))
    with pytest.raises(JobError, match=r"cannot load model .*no-model.* does not exist"):
        run_job(make_spec(tmp_path / "no-model", inp, tmp_path / "out"), quiet=True)
    gpt2 = shutil.copytree(tiny_model, tmp_path / "gpt2")
    config = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"],
                                                  "model_type": "gpt2"}))
    with pytest.raises(JobError, match=r"cannot load model .*GPT2LMHeadModel"):
        run_job(make_spec(gpt2, inp, tmp_path / "out"), quiet=True)


def test_unwritable_output(tmp_path, tiny_model):
    inp = write_jsonl(tmp_path / "a.jsonl", records(2))
    (tmp_path / "file").write_text("a file, not a folder")
    with pytest.raises(JobError, match="is not writable"):
        run_job(make_spec(tiny_model, inp, tmp_path / "file" / "out"), quiet=True)


def test_carry_column_clash_is_a_spec_error(tmp_path, tiny_model):
    inp = write_jsonl(tmp_path / "a.jsonl", records(2))
    with pytest.raises(SpecError, match=r"output.carry_columns: 'output' clashes"):
        run_job(make_spec(tiny_model, inp, tmp_path / "out", output={"carry_columns": ["output"]}),
                quiet=True)
    # without an id column the output's ids are "<file>:<row>": the input's own id values would be dropped
    with pytest.raises(SpecError, match=r"'id' is the output's column of row ids"):
        run_job(make_spec(tiny_model, inp, tmp_path / "out", input={"path": str(inp), "id_column": None},
                          output={"carry_columns": ["id"]}), quiet=True)


def test_an_input_in_the_output_folder_is_refused_and_kept(tmp_path, tiny_model, tiny_llm):
    folder = tmp_path / "shards"
    inp = write_jsonl(folder / "part-00000.jsonl", records(2))
    with pytest.raises(JobError, match="lies in the output folder"):
        run_job(make_spec(tiny_model, folder, folder), llm=tiny_llm, quiet=True, overwrite=True)
    assert inp.read_text() == "".join(json.dumps(r) + "\n" for r in records(2))


def test_an_output_folder_inside_an_input_folder_or_glob_is_refused_before_any_run(tmp_path, tiny_model, tiny_llm):
    """Its parts would be the next run's input rows: refused on the first run, not only on the rerun."""
    cases = [("{d}", "out", "jsonl", True), ("{d}/**/*.jsonl", "deep/out", "jsonl", True),
             # where the input would not take the parts: a glob of another name or format, a hidden folder
             ("{d}/in*.jsonl", "out", "jsonl", False), ("{d}/*.jsonl", "out", "jsonl", False),
             ("{d}/**/*.jsonl", "out", "parquet", False), ("{d}", "_out", "jsonl", False)]
    for i, (inp, out, fmt, refused) in enumerate(cases):
        data = tmp_path / str(i)
        write_jsonl(data / "in.jsonl", records(2))
        spec = make_spec(tiny_model, inp.format(d=data), data / out, output={"format": fmt})
        if refused:
            with pytest.raises(JobError, match="lies inside the input"):
                run_job(spec, llm=tiny_llm, quiet=True)
            assert not (data / out).exists()
        else:
            assert run_job(spec, llm=tiny_llm, quiet=True)["rows"] == 2
            assert run_job(spec, llm=tiny_llm, quiet=True)["rows"] == 2, (inp, out)


def test_a_kv_cache_too_small_for_the_rows_the_job_allows_is_refused(tmp_path, tiny_model):
    """Every row would be an error row that a rerun with a larger cache keeps: refused before any row runs."""
    inp = write_jsonl(tmp_path / "in.jsonl", records(2))
    engine = {"device": "cpu", "dtype": "float32", "kv_cache_memory": 1}
    with pytest.raises(JobError, match=r"KV cache holds 16 tokens, fewer than the 2048 a row may take .* raise "
                                       r"engine.kv_cache_memory"):
        run_job(make_spec(tiny_model, inp, tmp_path / "out", engine=engine), quiet=True)
    assert not list((tmp_path / "out").glob("part-*"))


def test_an_empty_jsonl_file_among_the_inputs_adds_no_rows(tmp_path, tiny_model, tiny_llm):
    write_jsonl(tmp_path / "in" / "a.jsonl", records(3))
    (tmp_path / "in" / "b.jsonl").write_text("")
    stats, rows = run(tmp_path, tiny_model, tiny_llm, tmp_path / "in")
    assert stats["rows"] == 3 and sorted(by_id(rows)) == ["r0", "r1", "r2"]


def test_carried_values_of_mixed_types_are_kept_as_json_text(tmp_path, tiny_model, tiny_llm):
    """One part mixing types, and a later part that the first part's types would change: every carried value
    comes back as it was (as JSON text where no one type holds it)."""
    recs = [{"id": "a", "text": "fox", "score": 1, "tags": ["x"]}, {"id": "b", "text": "dog", "score": 2.7,
                                                                     "tags": "abc"},
            {"id": "c", "text": "cat", "score": "high", "tags": {"k": 1}}]
    inp = write_jsonl(tmp_path / "in.jsonl", recs)
    stats, rows = run(tmp_path, tiny_model, tiny_llm, inp, batching={"sort": False},
                      output={"carry_columns": ["score", "tags"], "rows_per_part": 1})
    got = by_id(rows)
    assert len(got) == len(recs) and stats["ok_rows"] == 3
    for r in recs:
        for key in ("score", "tags"):
            value = got[r["id"]][key]
            assert (json.loads(value) if isinstance(value, str) and not isinstance(r[key], str) else value) == r[key]


def test_positional_ids_refuse_a_changed_input_on_resume(tmp_path, tiny_model, tiny_llm):
    """Without an id column a row is its file and line: rows inserted above committed ones would shift them."""
    recs = [{k: v for k, v in r.items() if k != "id"} for r in records(4)]
    inp = write_jsonl(tmp_path / "in.jsonl", recs)
    spec = make_spec(tiny_model, inp, tmp_path / "out", input={"path": str(inp), "id_column": None})
    run_job(spec, llm=tiny_llm, quiet=True, limit=2)
    write_jsonl(inp, [{"text": "inserted first", "title": "t"}] + recs)
    with pytest.raises(JobError, match="without input.id_column a row is known by its position"):
        run_job(spec, llm=tiny_llm, quiet=True)
    stats = run_job(spec, llm=tiny_llm, quiet=True, overwrite=True)
    assert stats["rows"] == 5


def test_positional_ids_refuse_a_file_whose_label_changed(tmp_path, tiny_model, tiny_llm):
    """A file of the same name joining the inputs turns label x.jsonl into a/x.jsonl: committed rows would run again."""
    recs = [{k: v for k, v in r.items() if k != "id"} for r in records(3)]
    write_jsonl(tmp_path / "a" / "x.jsonl", recs)
    glob = str(tmp_path / "*" / "x.jsonl")
    spec = make_spec(tiny_model, glob, tmp_path / "out", input={"path": glob, "id_column": None})
    run_job(spec, llm=tiny_llm, quiet=True, limit=1)
    write_jsonl(tmp_path / "b" / "x.jsonl", recs[:1])
    with pytest.raises(JobError, match="labelled 'a/x.jsonl' in default row ids now, 'x.jsonl' when"):
        run_job(spec, llm=tiny_llm, quiet=True)
    (tmp_path / "b" / "x.jsonl").unlink()
    assert run_job(spec, llm=tiny_llm, quiet=True)["rows"] == 3


def test_inputs_that_cannot_be_fingerprinted_are_left_out_of_the_checks(tmp_path, monkeypatch):
    from batchgen.io import OutputWriter
    from batchgen.pipeline import preflight

    inp = write_jsonl(tmp_path / "in.jsonl", records(2))
    monkeypatch.setattr(preflight, "fingerprints", lambda files, options: {})  # listing failed: advisory only
    with OutputWriter(str(tmp_path / "out")) as writer:
        assert preflight.check_inputs_unchanged(writer, [str(inp)], {}, positional_ids=True) == ({}, set())


def test_an_empty_folder_as_the_model_is_named_as_such(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", records(2))
    (tmp_path / "model").mkdir()
    with pytest.raises(JobError, match="model folder .* has no config.json"):
        run_job(make_spec(str(tmp_path / "model"), inp, tmp_path / "out"), quiet=True)
