"""End-to-end job runs through run_job on the tiny model: formats, sorting, truncation, stats, S3."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from batchgen.io import InputError, read_output
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.prefetch import Prefetcher
from batchgen.pipeline.preflight import optional_columns
from batchgen.pipeline.runner import run_job
from tests.job_helpers import (
    by_id, check_output, make_spec, records, spec_dict, tiny_llm, write_jsonl, write_parquet,  # noqa: F401
)
from tests.s3_server import moto_server, s3  # noqa: F401


def test_jsonl_in_parquet_out(tmp_path, tiny_model, tiny_llm):
    recs = records(20)
    del recs[3]["title"]  # a carried column missing from a row comes out null
    inp = write_jsonl(tmp_path / "in.jsonl", recs)
    out = tmp_path / "out"
    stats = run_job(make_spec(tiny_model, inp, out, output={"rows_per_part": 6}), llm=tiny_llm, quiet=True)

    rows = check_output(out, stats, [r["id"] for r in recs])
    assert stats["error_rows"] == 0 and stats["completion_tokens"] > 0
    assert sorted(p.name for p in out.glob("part-*")) == [f"part-0000{i}.parquet" for i in range(4)]
    got = by_id(rows)
    assert got["r3"]["title"] is None and got["r4"]["title"] == "title 4"
    assert list(rows[0]) == ["id", "title", "output", "prompt_tokens", "completion_tokens", "finish_reason",
                             "error"]
    schema = pq.read_schema(out / "part-00000.parquet")
    assert str(schema.field("error").type) == "struct<code: string, message: string>"

    success = json.loads((out / "_SUCCESS").read_text())
    assert success == json.loads((out / "stats.json").read_text()) == json.loads(json.dumps(stats))
    assert stats["job"] == "test-job" and stats["model"] == str(tiny_model) and stats["dtype"] == "float32"
    assert stats["resumed"] is False and stats["complete"] is True
    assert stats["spec"]["output"]["rows_per_part"] == 6 and len(stats["job_digest"]) == 64
    assert stats["started_at"].endswith("Z") and stats["finished_at"] >= stats["started_at"]
    assert stats["wall_s"] > 0 and stats["generated_tokens_per_s"] > 0
    assert 0 <= stats["prefix_cache_hit_rate"] <= 1
    # every prompt shares the chat header and system prompt, so the prefix cache must hit
    assert stats["cached_prompt_tokens"] > 0


def test_sorting_keeps_greedy_outputs(tmp_path, tiny_model, tiny_llm):
    inp = write_jsonl(tmp_path / "in.jsonl", records(24))
    outs = {}
    for sort in (True, False):
        out = tmp_path / f"out-{sort}"
        stats = run_job(make_spec(tiny_model, inp, out, batching={"sort": sort, "sort_window": 10}),
                        llm=tiny_llm, quiet=True)
        outs[sort] = by_id(check_output(out, stats, [f"r{i}" for i in range(24)]))
    assert {k: v["output"] for k, v in outs[True].items()} == {k: v["output"] for k, v in outs[False].items()}
    assert {k: v["prompt_tokens"] for k, v in outs[True].items()} == \
        {k: v["prompt_tokens"] for k, v in outs[False].items()}


def test_parquet_in_jsonl_out_with_default_ids(tmp_path, tiny_model, tiny_llm):
    recs = [{"text": r["text"], "n": i} for i, r in enumerate(records(5))]
    recs[2]["text"] = None  # null template value -> error row
    inp = write_parquet(tmp_path / "data" / "in.parquet", recs)
    out = tmp_path / "out"
    spec = make_spec(tiny_model, inp, out, input={"path": str(inp), "id_column": None},
                     output={"format": "jsonl", "carry_columns": ["n"]})
    stats = run_job(spec, llm=tiny_llm, quiet=True)
    rows = check_output(out, stats, [f"in.parquet:{i}" for i in range(5)])
    assert (out / "part-00000.jsonl").is_file()
    bad = by_id(rows)["in.parquet:2"]
    assert bad["error"] == {"code": "null_value", "message": "column 'text' is null"} and bad["n"] == 2
    line = json.loads((out / "part-00000.jsonl").read_text().splitlines()[0])
    assert set(line) == {"id", "n", "output", "prompt_tokens", "completion_tokens", "finish_reason", "error"}


def test_truncation(tmp_path, tiny_model, tiny_llm):
    inp = write_jsonl(tmp_path / "in.jsonl", records(6))
    spec = make_spec(tiny_model, inp, tmp_path / "left",
                     batching={"max_prompt_tokens": 20, "truncate": "left"})
    left = run_job(spec, llm=tiny_llm, quiet=True)
    rows = check_output(tmp_path / "left", left, [f"r{i}" for i in range(6)])
    assert left["error_rows"] == 0 and max(r["prompt_tokens"] for r in rows) == 20

    err = run_job(make_spec(tiny_model, inp, tmp_path / "err", batching={"max_prompt_tokens": 40}),
                  llm=tiny_llm, quiet=True)
    rows = check_output(tmp_path / "err", err, [f"r{i}" for i in range(6)])
    too_long = [r for r in rows if r["error"]]
    assert too_long and all(r["error"]["code"] == "prompt_too_long" for r in too_long)
    assert all(r["prompt_tokens"] <= 40 for r in rows)


def test_max_error_rate(tmp_path, tiny_model, tiny_llm):
    recs = records(4)
    recs[0]["text"] = recs[1]["text"] = None
    inp = write_jsonl(tmp_path / "in.jsonl", recs)
    out = tmp_path / "out"
    with pytest.raises(JobError, match=r"2 of 4 rows failed, more than max_error_rate 0.25"):
        run_job(make_spec(tiny_model, inp, out, max_error_rate=0.25), llm=tiny_llm, quiet=True)
    stats = json.loads((out / "stats.json").read_text())
    check_output(out, stats, [r["id"] for r in recs])
    assert stats["error_rows"] == 2 and not (out / "_SUCCESS").exists()
    before = {name: (out / name).read_bytes() for name in ("stats.json", "telemetry.json")}
    with pytest.raises(JobError, match="more than max_error_rate"):  # a rerun that does nothing changes nothing
        run_job(make_spec(tiny_model, inp, out, max_error_rate=0.25), llm=tiny_llm, quiet=True)
    assert {name: (out / name).read_bytes() for name in before} == before
    assert run_job(make_spec(tiny_model, inp, tmp_path / "ok", max_error_rate=0.5), llm=tiny_llm,
                   quiet=True)["error_rows"] == 2


def test_s3_in_and_out(s3, tiny_model, tiny_llm, tmp_path):  # noqa: F811
    client = s3.client()
    body = "".join(json.dumps(r) + "\n" for r in records(7)).encode()
    client.put_object(Bucket=s3.bucket, Key="in/a.jsonl", Body=body)
    out = s3.url("jobs/out")
    data = spec_dict(tiny_model, s3.url("in/*.jsonl"), out, storage_options=s3.storage_options,
                     output={"rows_per_part": 3})
    from batchgen.pipeline.spec import spec_from_dict

    spec = spec_from_dict(data)
    stats = run_job(spec, llm=tiny_llm, quiet=True)
    rows = read_output(out, s3.storage_options)
    assert sorted(r["id"] for r in rows) == sorted(f"r{i}" for i in range(7)) and stats["rows"] == 7
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=s3.bucket, Prefix="jobs/out/")["Contents"])
    assert keys[:3] == ["jobs/out/_SUCCESS", "jobs/out/_job.json", "jobs/out/_manifest/part-00000.json"]
    assert "jobs/out/part-00002.parquet" in keys and "jobs/out/stats.json" in keys
    success = json.loads(client.get_object(Bucket=s3.bucket, Key="jobs/out/_SUCCESS")["Body"].read())
    assert success["spec"]["storage_options"]["secret"] == "***" and success["rows"] == 7
    # a finished job on S3 is a no-op the second time
    assert run_job(spec, llm=tiny_llm, quiet=True)["finished_at"] == success["finished_at"]


def test_optional_columns():
    template = ("{% if notes is defined %}{{ notes }}{% endif %}{{ a | default('x') }}{{ b | default('') }}"
                "{{ b }}{{ c }}")
    assert optional_columns(template) == {"notes", "a"}


def test_prefetcher_order_errors_and_close():
    assert list(Prefetcher(iter(range(100)), depth=3)) == list(range(100))

    def failing():
        yield 1
        raise InputError("boom")

    with pytest.raises(InputError, match="boom"):
        list(Prefetcher(failing(), depth=2))

    pulled = []

    def endless():
        i = 0
        while True:
            pulled.append(i)
            yield i
            i += 1

    p = Prefetcher(endless(), depth=4)
    it = iter(p)
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    p.close()
    assert not p._thread.is_alive() and len(pulled) <= 3 + 4 + 2  # bounded read-ahead


def test_sampled_rows_draw_apart_and_a_rerun_draws_the_same(tmp_path, tiny_model, tiny_llm):
    """Rows of one seeded job sample independently (equal prompts differ), and each row samples as before in a
    rerun that reads the rows in another order."""
    rows = [{"id": f"d{i}", "text": "one document" + " more" * (i % 2), "title": "t"} for i in range(6)]
    sampling = {"max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    outputs = []
    for name, order in (("a", rows), ("b", rows[::-1])):
        inp = write_jsonl(tmp_path / f"{name}.jsonl", order)
        run_job(make_spec(tiny_model, inp, tmp_path / name, sampling=sampling), llm=tiny_llm, quiet=True)
        outputs.append({r["id"]: r["output"] for r in read_output(str(tmp_path / name))})
    assert len(outputs[0]) == len(outputs[1]) == len(rows)
    assert outputs[0] == outputs[1]
    assert len({outputs[0][f"d{i}"] for i in (0, 2, 4)}) == 3  # one prompt, three samples
