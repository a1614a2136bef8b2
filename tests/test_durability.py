"""Bounded loss and durable commits: parts flushed by age, fsync before the manifest entry, and a warning
when an input file changed under a resumed job."""
from __future__ import annotations

import json
import logging
import os
import signal
import time

import pytest

from batchgen.io import OutputWriter
from batchgen.pipeline.errors import JobInterrupted
from batchgen.pipeline.rows import PartSchema, ResultRow
from batchgen.pipeline.runner import run_job
from batchgen.pipeline.sink import PartSink
from tests.job_helpers import check_output, make_spec, manifest_ids, records, tiny_llm, write_jsonl  # noqa: F401


def result(i: int) -> ResultRow:
    return ResultRow(f"r{i}", {}, f"out {i}", 3, 2, "stop")


def test_finished_rows_are_committed_by_age_without_more_rows(tmp_path):
    out = tmp_path / "out"
    sink = PartSink(OutputWriter(str(out), id_key="id"), PartSchema("id", []), rows_per_part=1000,
                    job_digest="d", max_age_s=0.3)
    try:
        sink.add(result(0))
        sink.add(result(1))
        assert manifest_ids(out) == []
        deadline = time.monotonic() + 10
        while not manifest_ids(out) and time.monotonic() < deadline:  # no further row arrives
            time.sleep(0.05)
        assert manifest_ids(out) == ["r0", "r1"] and sink.buffered == 0
        sink.add(result(2))
        sink.flush()
        assert manifest_ids(out) == ["r0", "r1", "r2"] and sink.run.rows == 3
    finally:
        sink.close()


def test_a_failed_background_flush_surfaces_in_the_job(tmp_path, monkeypatch):
    writer = OutputWriter(str(tmp_path / "out"), id_key="id")
    sink = PartSink(writer, PartSchema("id", []), rows_per_part=1000, job_digest="d", max_age_s=0.1)
    monkeypatch.setattr(writer, "write_part", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    try:
        sink.add(result(0))
        time.sleep(0.5)
        with pytest.raises(OSError, match="disk full"):
            sink.add(result(1))
        assert sink.buffered == 2  # nothing lost: the rows wait for the next flush
    finally:
        sink.close()


def test_local_parts_are_fsynced_before_their_manifest_entry(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def record(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    out = tmp_path / "out"
    writer = OutputWriter(str(out))
    monkeypatch.setattr(os, "fsync", record)
    writer.write_part([{"row_id": "a", "output": "x"}])
    names = [p[len(str(out)):] or "/" for p in synced]
    part = next(i for i, n in enumerate(names) if "part-00000.parquet" in n and "_manifest" not in n)
    entry = next(i for i, n in enumerate(names) if n.startswith("/_manifest/") and "part-00000.json" in n)
    assert part < names.index("/", part) < entry  # the part's bytes, then its rename, then the entry
    assert names.index("/_manifest", entry) > entry  # and the entry's rename


def test_changed_input_is_named_on_resume(tmp_path, tiny_model, tiny_llm, monkeypatch, caplog):
    a = write_jsonl(tmp_path / "in" / "a.jsonl", records(30, "a"))
    b = write_jsonl(tmp_path / "in" / "b.jsonl", records(12, "b"))
    out = tmp_path / "out"
    spec = make_spec(tiny_model, str(tmp_path / "in"), out, output={"rows_per_part": 4},
                     batching={"sort": False}, engine={"max_num_seqs": 2})
    parts: list[str] = []
    original = OutputWriter.write_part

    def stop_after_two(self, *args, **kwargs):
        parts.append(original(self, *args, **kwargs))
        if len(parts) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return parts[-1]

    monkeypatch.setattr(OutputWriter, "write_part", stop_after_two)
    with pytest.raises(JobInterrupted):
        run_job(spec, llm=tiny_llm, quiet=True)
    monkeypatch.undo()
    entries = sorted((out / "_manifest").glob("*.json"))
    recorded = [i["file"] for e in entries for i in json.loads(e.read_text())["stats"].get("inputs", [])]
    assert recorded == [str(a)]  # only b's rows are not committed yet; a is recorded once, by its first part
    assert json.loads(entries[0].read_text())["stats"]["inputs"][0]["size"] == a.stat().st_size

    with open(a, "a") as f:
        f.write(json.dumps({"id": "a-new", "text": "one more row", "title": "t"}) + "\n")
    with caplog.at_level(logging.WARNING):
        stats = run_job(spec, llm=tiny_llm, quiet=True)
    changed = [r.getMessage() for r in caplog.records if "changed since its rows were first committed" in r.getMessage()]
    assert len(changed) == 1 and str(a) in changed[0] and "size" in changed[0]
    check_output(out, stats, [f"a{i}" for i in range(30)] + ["a-new"] + [f"b{i}" for i in range(12)])
