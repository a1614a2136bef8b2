"""OutputWriter: parts, manifest, atomicity, resume, overwrite and redaction on local disk and memory://."""

from __future__ import annotations

import json
import os
import uuid

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchgen.io.atomic as atomic_mod
from batchgen.io import OutputError, OutputWriter, read_output
from batchgen.io.committer import PartCommitter
from batchgen.io.lease import LeaseSettings
from batchgen.io.manifest import PartId


def rows(ids, output="out"):
    return [{"row_id": i, "output": None if output is None else f"{output}-{i}", "prompt_tokens": len(i),
             "finish_reason": None if output is None else "stop"} for i in ids]


def listing(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_write_parts_and_read_back(tmp_path, fmt):
    out = str(tmp_path / "out")
    w = OutputWriter(out, fmt=fmt)
    assert not w.is_complete() and w.committed_row_ids() == set()
    url0 = w.write_part(rows(["a", "b"], output=None), stats={"rows": 2})  # all-null columns first
    url1 = w.write_part(rows(["c"]), stats={"rows": 1})
    assert (url0, url1) == (f"{out}/part-00000.{fmt}", f"{out}/part-00001.{fmt}")
    w.write_stats({"rows": 3})
    w.commit({"rows": 3})
    assert w.is_complete()
    assert listing(out) == ["_SUCCESS", "_manifest/part-00000.json", "_manifest/part-00001.json",
                            f"part-00000.{fmt}", f"part-00001.{fmt}", "stats.json"]
    assert read_output(out) == rows(["a", "b"], output=None) + rows(["c"])
    assert json.load(open(f"{out}/_SUCCESS")) == {"rows": 3} == json.load(open(f"{out}/stats.json"))
    entry = json.load(open(f"{out}/_manifest/part-00001.json"))
    assert entry == {"part": f"part-00001.{fmt}", "files": [f"part-00001.{fmt}"], "format": fmt, "rows": 1,
                     "row_ids": ["c"], "stats": {"rows": 1}}
    if fmt == "parquet":
        schema = pq.read_schema(f"{out}/part-00000.parquet")
        assert schema.field("output").type == pa.string() == schema.field("finish_reason").type
        assert pq.read_schema(f"{out}/part-00001.parquet").equals(schema)


def test_explicit_schema_and_row_ids(tmp_path):
    schema = pa.schema([("id", pa.string()), ("score", pa.float32())])
    w = OutputWriter(str(tmp_path), schema=schema, id_key="id")
    w.write_part([{"id": "x", "score": None}])
    w.write_part([{"id": "y", "score": 1.5}], row_ids=["custom"])
    assert pq.read_schema(f"{tmp_path}/part-00000.parquet").field("score").type == pa.float32()
    assert w.committed_row_ids() == {"x", "custom"}
    with pytest.raises(OutputError, match="id key"):
        OutputWriter(str(tmp_path / "o2")).write_part([{"output": "no id"}])


class Boom:
    def __str__(self):
        raise RuntimeError("boom while serializing")


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_failed_part_leaves_nothing_visible(tmp_path, fmt, monkeypatch):
    out = str(tmp_path / "out")
    w = OutputWriter(out, fmt=fmt)
    w.write_part(rows(["a"]))
    bad = rows(["b", "c"])
    bad[1]["output"] = Boom() if fmt == "jsonl" else object()
    with pytest.raises(OutputError, match="part-00001"):
        w.write_part(bad)
    # the bytes are complete but storing them dies half way: no part, no temp file, no entry
    real_write = open

    def failing_open(path, mode="r", *a, **k):
        f = real_write(path, mode, *a, **k)
        if "w" in mode and "part-0000" in str(path):
            f.write(b"PAR1 truncated")
            f.close()
            raise OSError(28, "No space left on device")
        return f

    monkeypatch.setattr(atomic_mod, "open", failing_open, raising=False)
    with pytest.raises(OutputError, match="part-00001"):
        w.write_part(rows(["d"]))
    monkeypatch.undo()
    assert listing(out) == ["_manifest/part-00000.json", f"part-00000.{fmt}"]
    assert w.committed_row_ids() == {"a"}
    assert w.write_part(rows(["e"])).endswith(f"part-00001.{fmt}")
    assert [r["row_id"] for r in read_output(out)] == ["a", "e"]


def test_resume_after_crash(tmp_path, monkeypatch):
    out = str(tmp_path / "out")
    w = OutputWriter(out)
    w.write_part(rows(["a", "b"]), stats={"prompt_tokens": 2})
    w.write_part(rows(["c"]), stats={"prompt_tokens": 1})
    # crash between the part and its manifest entry: the part is an orphan
    real_put = PartCommitter._put

    def put_without_manifest(self, name, data):
        if name.startswith("_manifest/"):
            raise KeyboardInterrupt  # the process dies here
        real_put(self, name, data)

    monkeypatch.setattr(PartCommitter, "_put", put_without_manifest)
    with pytest.raises(KeyboardInterrupt):
        w.write_part(rows(["d"]))
    monkeypatch.undo()
    (tmp_path / "out" / ".part-00009.parquet.tmp-dead").write_bytes(b"half")
    assert "part-00002.parquet" in listing(out)

    w2 = OutputWriter(out)
    assert w2.committed_row_ids() == {"a", "b", "c"}
    assert w2.committed_stats() == [{"prompt_tokens": 2}, {"prompt_tokens": 1}]
    assert listing(out) == ["_manifest/part-00000.json", "_manifest/part-00001.json",
                            "part-00000.parquet", "part-00001.parquet"]
    assert w2.write_part(rows(["d"])).endswith("part-00002.parquet")
    assert [r["row_id"] for r in read_output(out)] == ["a", "b", "c", "d"]

    # a manifest entry whose part vanished no longer counts
    os.remove(f"{out}/part-00001.parquet")
    w3 = OutputWriter(out)
    assert w3.committed_row_ids() == {"a", "b", "d"}
    assert not os.path.exists(f"{out}/_manifest/part-00001.json")
    with pytest.raises(OutputError, match="parquet parts"):
        OutputWriter(out, fmt="jsonl")


def test_overwrite(tmp_path):
    out = str(tmp_path / "out")
    w = OutputWriter(out, fmt="jsonl")
    for i in range(3):
        w.write_part(rows([f"r{i}"]))
    w.write_stats({"n": 3})
    w.commit({"n": 3})
    (tmp_path / "out" / "README.txt").write_text("keep me")
    w2 = OutputWriter(out, overwrite=True)
    assert not w2.is_complete() and w2.committed_row_ids() == set()
    assert listing(out) == ["README.txt"]
    assert w2.write_part(rows(["z"])).endswith("part-00000.parquet")
    assert read_output(out) == rows(["z"])


def test_unwritable_output(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OutputError, match=f"{blocker}/out.*not writable"):
        OutputWriter(f"{blocker}/out")
    with pytest.raises(OutputError, match="unknown output format"):
        OutputWriter(str(tmp_path), fmt="csv")


def test_memory_fs_round_trip():
    out = f"memory://out-{uuid.uuid4().hex}/job"
    w = OutputWriter(out, fmt="jsonl")
    w.write_part(rows(["a", "b"]), stats={"n": 2})
    w.commit({"n": 2})
    fs = fsspec.filesystem("memory")
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.find(out.split("://")[1])) == [
        "_SUCCESS", "part-00000.json", "part-00000.jsonl"]
    w2 = OutputWriter(out, fmt="jsonl")
    assert w2.is_complete() and w2.committed_row_ids() == {"a", "b"}
    assert read_output(out) == rows(["a", "b"])


def test_credentials_redacted_in_metadata(tmp_path):
    secret = "Sup3rS3cret-" + uuid.uuid4().hex
    spec = {"storage_options": {"key": "AKIAIOSFODNN7EXAMPLE", "secret": secret}, "model": "m",
            "prompt_tokens": 5, "url": f"s3://user:{secret}@bucket/x"}
    out = str(tmp_path / "out")
    w = OutputWriter(out)
    w.write_part(rows(["a"]), stats=spec)
    w.write_stats(spec)
    w.commit(spec)
    for name in ("_SUCCESS", "stats.json", "_manifest/part-00000.json"):
        text = open(f"{out}/{name}").read()
        assert secret not in text and "AKIAIOSFODNN7EXAMPLE" not in text, name
        assert '"prompt_tokens": 5' in text
    assert OutputWriter(out).committed_stats()[0]["storage_options"] == {"key": "***", "secret": "***"}


def test_resumed_parts_keep_column_types(tmp_path):
    out = str(tmp_path / "out")
    OutputWriter(out).write_part([{"row_id": "a", "score": 3, "output": "x"}])
    w = OutputWriter(out)
    w.write_part([{"row_id": "b", "score": None, "output": None}])
    first, second = (pq.read_schema(f"{out}/part-0000{i}.parquet") for i in (0, 1))
    assert second.field("score").type == pa.int64() and first.equals(second)


def test_part_ids_name_and_order_parts():
    assert PartId.parse("00012") == PartId("", 12) and PartId("", 12).key == "00012"
    key = "r1a2b-s00003-w00001-00007"
    assert PartId.parse(key) == PartId("r1a2b-s00003-w00001", 7) and PartId.parse(key).key == key
    assert sorted([PartId("b", 0), PartId("", 3), PartId("a", 10), PartId("a", 2)]) == [
        PartId("", 3), PartId("a", 2), PartId("a", 10), PartId("b", 0)]
    for bad in ("A", "a_b", "a--b", "-a"):
        with pytest.raises(ValueError):
            PartId(bad)


def test_scoped_committers_share_the_folder_of_one_writer(tmp_path):
    """A Ray run: the driver's writer holds the lease, replicas commit the parts of their own scopes beside it."""
    out = str(tmp_path / "out")
    w = OutputWriter(out, lease=LeaseSettings())
    w.write_part(rows(["a"]), stats={"rows": 1})
    first = PartCommitter.open(out, "parquet", None, "r1-s00000-w00000", fence=w.ensure_held)
    second = PartCommitter.open(out, "parquet", None, "r1-s00001-w00000", fence=w.ensure_held)
    assert first.committed == [] and first.next == 0
    first.write_part(rows(["b", "c"]), stats={"rows": 2})
    assert second.write_part(rows(["d"]), stats={"rows": 1}).endswith("/part-r1-s00001-w00000-00000.parquet")
    first.write_part(rows(["e"]), stats={"rows": 1})
    # the second window's attempt is cut short with a part stored and not committed; its retry reads what
    # the attempt committed and numbers on after it
    second.store.put("part-r1-s00001-w00000-00001.parquet", b"orphan")
    retry = PartCommitter.open(out, "parquet", None, "r1-s00001-w00000")
    assert retry.next == 1 and [e.row_ids for e in retry.committed] == [["d"]]

    assert w.committed_row_ids() == {"a"}  # until it reads the manifest again
    w.refresh()
    assert w.committed_row_ids() == set("abcde") and w.committed_scopes() == {"", "r1-s00000-w00000",
                                                                               "r1-s00001-w00000"}
    assert w.committed_stats("r1-") == [{"rows": 2}, {"rows": 1}, {"rows": 1}]
    assert "part-r1-s00001-w00000-00001.parquet" in listing(out)
    w.refresh(cleanup=True)  # once no replica writes: the orphan goes
    assert "part-r1-s00001-w00000-00001.parquet" not in listing(out)
    assert [r["row_id"] for r in read_output(out)] == ["a", "b", "c", "e", "d"]  # the writer's parts, then by scope
    w.close()

    rerun = OutputWriter(out)  # a later local run numbers its own parts after its own
    assert rerun.write_part(rows(["f"])).endswith("/part-00001.parquet")
    assert rerun.committed_row_ids() == set("abcdef")


def test_cleanup_spares_the_probe_of_a_racing_run_and_tolerates_files_already_gone(tmp_path, monkeypatch):
    out = tmp_path / "out"
    w = OutputWriter(str(out))
    # another run checking that the folder is writable, before it asks for the lease
    racing_probe = out / f".probe{atomic_mod.TEMP_MARK}{uuid.uuid4().hex}"
    racing_probe.write_bytes(b"")
    left_by_crash = out / f".part-00003.parquet{atomic_mod.TEMP_MARK}dead"
    left_by_crash.write_bytes(b"half")
    # the racing run's own cleanup removes the crash leftover between our listing and our delete
    real_rm = w.fs.rm

    def rm_after_a_racing_cleanup(paths, *args, **kwargs):
        if os.path.exists(left_by_crash):
            os.remove(left_by_crash)
        return real_rm(paths, *args, **kwargs)

    monkeypatch.setattr(w.fs, "rm", rm_after_a_racing_cleanup)
    w.cleanup_uncommitted()
    assert racing_probe.exists() and not left_by_crash.exists()
    monkeypatch.undo()
    w.write_part(rows(["a"]))
    assert [r["row_id"] for r in read_output(str(out))] == ["a"]


def test_part_files_no_run_recorded_are_refused_and_kept(tmp_path):
    """A folder whose part-named files no batchgen run wrote: resuming into it would replace them."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "part-00000.parquet").write_bytes(b"someone else's data")
    with pytest.raises(OutputError, match=r"part-00000.parquet\) that no batchgen run recorded"):
        OutputWriter(str(out))
    assert (out / "part-00000.parquet").read_bytes() == b"someone else's data"
    OutputWriter(str(out), overwrite=True).write_part(rows(["a"]))  # asked for: they go
    assert read_output(str(out)) == rows(["a"])
