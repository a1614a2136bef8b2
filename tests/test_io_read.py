"""Input expansion and streaming reads of Parquet/JSONL on local disk and memory://."""

from __future__ import annotations

import gzip
import json
import os
import uuid

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.io import InputError, expand_inputs, read_columns, read_rows, redact, storage_options_for
from batchgen.io.fingerprint import tree_digest
from batchgen.io.retry import BOTO_SINGLE_ATTEMPT


def write_jsonl(path, lines: list[bytes]) -> str:
    with open(path, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    return str(path)


def write_parquet(path, n: int, row_group_size: int = 50) -> str:
    table = pa.table({"id": [f"r{i}" for i in range(n)], "text": [f"text {i}" for i in range(n)],
                      "n": list(range(n))})
    pq.write_table(table, str(path), row_group_size=row_group_size)
    return str(path)


def test_expand_inputs_globs_lists_folders(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    a = write_jsonl(tmp_path / "a.jsonl", [b'{"x": 1}'])
    b = write_parquet(tmp_path / "b.parquet", 3)
    c = write_jsonl(tmp_path / "sub" / "c.jsonl", [b'{"x": 2}'])
    (tmp_path / "_SUCCESS").write_text("{}")
    (tmp_path / "_manifest").mkdir()
    write_jsonl(tmp_path / "_manifest" / "m.jsonl", [b"{}"])
    (tmp_path / "notes.txt").write_text("not data")

    assert expand_inputs([f"{tmp_path}/*.jsonl", a, str(tmp_path / "*" / "*.jsonl")]) == sorted([a, c])
    assert expand_inputs(str(tmp_path)) == sorted([a, b, c])  # folders: data files, no markers
    monkeypatch.chdir(tmp_path)
    assert expand_inputs("a.jsonl") == [a]  # relative in, absolute out
    assert expand_inputs(f"file://{b}") == [f"file://{b}"]


def test_expand_inputs_memory_keeps_protocol():
    root = f"memory://in-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    for name in ("b.jsonl", "a.jsonl", "c.parquet"):
        fs.pipe_file(f"{root}/{name}", b"{}\n")
    got = expand_inputs([f"{root}/*.jsonl", f"{root}/a.jsonl", f"{root}/c.parquet"])
    assert [u.split("/")[-1] for u in got] == ["a.jsonl", "b.jsonl", "c.parquet"]
    assert all(u.startswith("memory://") for u in got)


@pytest.mark.parametrize("pattern", ["missing.jsonl", "nothing-*.parquet", "nodir/"])
def test_expand_inputs_no_match_names_path(tmp_path, pattern):
    write_jsonl(tmp_path / "a.jsonl", [b"{}"])
    target = f"{tmp_path}/{pattern}"
    with pytest.raises(InputError, match="nothing-|missing|nodir") as err:
        expand_inputs([str(tmp_path / "a.jsonl"), target])
    assert target.rstrip("/") in str(err.value)


def test_parquet_streams_record_batches(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "x.parquet", 230, row_group_size=50)
    batches = []
    original = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        for batch in original(self, *args, **kwargs):
            batches.append(batch.num_rows)
            yield batch

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    rows = read_rows([path], batch_rows=16)
    first = next(rows)
    assert batches == [16]  # lazy: one record batch read for the first row
    assert (first.row_id, first.index) == ("x.parquet:0", 0)
    assert first.values == {"id": "r0", "text": "text 0", "n": 0}
    rest = list(rows)
    assert len(rest) == 229 and max(batches) <= 16 and sum(batches) == 230
    assert [r.values["n"] for r in rest] == list(range(1, 230))
    assert [r.row_id for r in rest[:2]] == ["x.parquet:1", "x.parquet:2"]
    assert all(r.error is None and r.source == path for r in rest)


def test_jsonl_bad_lines_become_error_rows(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [
        b'{"id": "a", "text": "one"}',
        b"",
        b'{"id": "b", "text": ',          # malformed
        b'{"id": "c", "text": "\xff\xfe"}',  # invalid UTF-8
        b"[1, 2]",                         # not an object
        b"   ",
        b'{"id": "d", "text": "caf\xc3\xa9"}',
    ])
    rows = list(read_rows([path]))
    assert [r.index for r in rows] == [0, 2, 3, 4, 6]  # blank lines skipped but counted
    assert [r.row_id for r in rows] == ["in.jsonl:0", "in.jsonl:2", "in.jsonl:3", "in.jsonl:4", "in.jsonl:6"]
    good = [r for r in rows if r.error is None]
    assert [r.values["text"] for r in good] == ["one", "café"]
    bad = {r.index: r.error for r in rows if r.error}
    assert f"{path} line 3" in bad[2] and "malformed JSON" in bad[2]
    assert f"{path} line 4" in bad[3] and "UTF-8" in bad[3]
    assert f"{path} line 5" in bad[4] and "object" in bad[4]
    assert all(r.values == {} for r in rows if r.error)


def test_jsonl_compressed_and_bom(tmp_path):
    path = tmp_path / "in.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(b"\xef\xbb\xbf" + b"\n".join(json.dumps({"i": i}).encode() for i in range(500)) + b"\n")
    rows = list(read_rows([str(path)]))
    assert [r.values["i"] for r in rows] == list(range(500)) and not any(r.error for r in rows)
    assert read_columns([str(path)]) == {"i"}


def test_id_column(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl",
                       [b'{"id": 7, "t": "a"}', b'{"t": "b"}', b'{"id": null, "t": "c"}'])
    rows = list(read_rows([path], id_column="id"))
    assert rows[0].row_id == "7" and rows[0].error is None
    for r, line in zip(rows[1:], (2, 3)):
        assert r.row_id == f"in.jsonl:{line - 1}" and r.values["t"]
        assert f"{path} line {line}" in r.error and "'id'" in r.error
    prows = list(read_rows([write_parquet(tmp_path / "p.parquet", 3)], id_column="id"))
    assert [r.row_id for r in prows] == ["r0", "r1", "r2"]


def test_default_ids_are_stable_and_unique_across_folders(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    files = expand_inputs([write_jsonl(tmp_path / d / "part.jsonl", [b'{"x": 1}']) for d in "ab"])
    ids = [r.row_id for r in read_rows(files)]
    assert ids == ["a/part.jsonl:0", "b/part.jsonl:0"]
    assert ids == [r.row_id for r in read_rows(files)]


def test_corrupt_parquet_raises_naming_file(tmp_path):
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not a parquet file at all" * 10)
    good = write_parquet(tmp_path / "good.parquet", 200, row_group_size=20)
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(open(good, "rb").read()[:-300])
    for bad in (garbage, truncated):
        with pytest.raises(InputError, match=str(bad)):
            list(read_rows([good, str(bad)]))
        with pytest.raises(InputError, match=str(bad)):
            read_columns([str(bad)])


def test_missing_file_at_read_time(tmp_path):
    gone = str(tmp_path / "gone.jsonl")
    with pytest.raises(InputError, match=gone):
        list(read_rows([gone]))
    with pytest.raises(InputError, match="cannot tell the format"):
        list(read_rows([str(tmp_path / "x.csv")]))


def test_read_columns_union(tmp_path):
    p = write_parquet(tmp_path / "p.parquet", 2)
    j = write_jsonl(tmp_path / "j.jsonl", [b"not json", b'{"title": 1}', b'{"body": 2, "title": 3}'])
    assert read_columns([p, j]) == {"id", "text", "n", "title", "body"}


def test_memory_fs_parquet_and_jsonl(tmp_path):
    root = f"memory://read-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    fs.pipe_file(f"{root}/a.jsonl", b'{"q": "x"}\n{"q": "y"}\n')
    fs.pipe_file(f"{root}/b.parquet", open(write_parquet(tmp_path / "b.parquet", 70, 32), "rb").read())
    rows = list(read_rows(expand_inputs(f"{root}/*"), batch_rows=10))
    assert [r.row_id for r in rows[:3]] == ["a.jsonl:0", "a.jsonl:1", "b.parquet:0"]
    assert len(rows) == 72 and rows[-1].values["n"] == 69


def test_redact():
    opts = {"key": "AKIAIOSFODNN7EXAMPLE", "secret": "wJalrXUtnFEMI", "token": "tok123",
            "client_kwargs": {"region_name": "us-east-1", "aws_session_token": "t"},
            "password": None, "prompt_tokens": 12, "eos_token": "</s>", "items": [{"api_key": "k"}]}
    out = redact(opts)
    assert out["key"] == out["secret"] == out["token"] == "***"
    assert out["client_kwargs"] == {"region_name": "us-east-1", "aws_session_token": "***"}
    assert out["prompt_tokens"] == 12 and out["eos_token"] == "</s>" and out["password"] is None
    assert out["items"] == [{"api_key": "***"}]
    assert opts["key"] == "AKIAIOSFODNN7EXAMPLE"  # a copy
    text = redact("s3://me:pw@bucket/k?X-Amz-Signature=abc&x=1 {'secret': 'zz'} "
                  "AWS_SECRET_ACCESS_KEY=q AKIAIOSFODNN7EXAMPLE")
    assert text == ("s3://***:***@bucket/k?X-Amz-Signature=***&x=1 {'secret': '***'} "
                    "AWS_SECRET_ACCESS_KEY=*** ***")


def test_storage_options_for_merges_aws_env(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "envkey")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "envsecret-value")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "envtoken-value")
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    opts = storage_options_for("s3://b/k", None)
    assert opts == {"endpoint_url": "http://127.0.0.1:1", "key": "envkey", "secret": "envsecret-value",
                    "token": "envtoken-value", "client_kwargs": {"region_name": "eu-west-1"},
                    "config_kwargs": {"retries": BOTO_SINGLE_ATTEMPT}}
    explicit = storage_options_for("s3://b/k", {"key": "k2", "secret": "s2",
                                                "endpoint_url": "http://127.0.0.1:2",
                                                "config_kwargs": {"retries": {"max_attempts": 2}}})
    assert explicit["endpoint_url"] == "http://127.0.0.1:2" and explicit["key"] == "k2"
    assert "token" not in explicit and explicit["config_kwargs"]["retries"] == {"max_attempts": 2}
    assert storage_options_for("memory://x", {"a": 1}) == {"a": 1}
    assert storage_options_for("/tmp/x", None) == {}
    # values seen as credentials are masked wherever they show up later
    assert redact("failed with envsecret-value inside") == "failed with *** inside"


class FlakyFile:
    """A file that dies with a connection reset after budget bytes, like a dropped S3 stream."""

    def __init__(self, f, budget: int):
        self._f, self._budget = f, budget

    def _spend(self, data: bytes) -> bytes:
        self._budget -= len(data)
        if self._budget < 0:
            raise ConnectionResetError("connection reset by peer")
        return data

    def read(self, n: int = -1) -> bytes:
        return self._spend(self._f.read(n))

    def readline(self) -> bytes:
        return self._spend(self._f.readline())

    def __iter__(self):
        return iter(self.readline, b"")

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def test_stream_resumes_after_transient_error(tmp_path, monkeypatch):
    import batchgen.io.readers as readers

    jsonl = write_jsonl(tmp_path / "a.jsonl", [json.dumps({"i": i}).encode() for i in range(400)])
    parquet = write_parquet(tmp_path / "b.parquet", 400, row_group_size=64)
    real_open = readers._open
    opened: list[str] = []

    def flaky_open(url, storage_options, compression=None, **kwargs):
        opened.append(url)
        f = real_open(url, storage_options, compression, **kwargs)
        return FlakyFile(f, budget=2000) if opened.count(url) == 1 else f

    monkeypatch.setattr(readers, "_open", flaky_open)
    monkeypatch.setattr("batchgen.io.retry._sleep", lambda s: None)
    got = list(read_rows([jsonl], batch_rows=32))
    assert [r.values["i"] for r in got] == list(range(400)) and opened.count(jsonl) == 2
    got = list(read_rows([parquet], batch_rows=32))
    assert [r.values["n"] for r in got] == list(range(400)) and opened.count(parquet) >= 2


def test_file_digests_cover_every_byte_and_are_read_once_per_version(tmp_path, monkeypatch):
    """A model file's digest counts every byte, is remembered while the file keeps its path, size, mtime and
    inode, and is taken again once any of them changes."""
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model.bin"
    data = bytearray(os.urandom(3 << 20))
    model.write_bytes(data)
    first = tree_digest(str(model))
    stat = model.stat()
    data[len(data) // 2] ^= 1
    with open(model, "r+b") as f:  # the same inode and size, the old mtime put back: the remembered digest
        f.write(data)
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert tree_digest(str(model)) == first
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # a write moves the mtime: read again
    assert tree_digest(str(model)) != first
    data[len(data) // 2] ^= 1
    model.write_bytes(data)
    assert tree_digest(str(model)) == first  # the first content again, whatever the file's times


def test_a_line_nested_past_the_parser_is_an_error_row(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"text": "a"}\n' + '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n" + '{"text": "b"}\n')
    got = list(read_rows([str(path)]))
    assert len(got) == 3 and [r.values.get("text") for r in (got[0], got[2])] == ["a", "b"]
    assert "nested too deeply" in got[1].error


def test_a_finished_output_folder_reads_as_its_parts(tmp_path):
    """stats.json and telemetry.json beside the parts are not input rows."""
    out = tmp_path / "out"
    out.mkdir()
    pq.write_table(pa.table({"id": ["a"], "output": ["x"]}), out / "part-00000.parquet")
    for name in ("stats.json", "telemetry.json"):
        (out / name).write_text("{}")
    assert expand_inputs(str(out)) == [str(out / "part-00000.parquet")]


def test_a_lone_surrogate_is_that_lines_error(tmp_path):
    """JSON may escape half a UTF-16 pair, which no UTF-8 writer can store: that line's error, not the job's."""
    path = write_jsonl(tmp_path / "s.jsonl", [b'{"id": "a", "text": "ok \\ud83d\\ude00"}',
                                              b'{"id": "b\\ud800", "text": "x"}', b'{"id": "c", "note": ["\\uDC00"]}',
                                              b'{"id": "d", "text": "\\\\ud800 is text"}'])
    rows = list(read_rows([path], id_column="id"))
    assert [r.error is None for r in rows] == [True, False, False, True]
    assert rows[0].values["text"] == "ok \U0001F600" and rows[3].values["text"] == "\\ud800 is text"
    assert "lone UTF-16 surrogate" in rows[1].error and "line 3" in rows[2].error


def test_a_value_python_cannot_hold_is_that_rows_error(tmp_path):
    """A timestamp past year 9999 fails its row (named by its id and column), not the file."""
    far = pa.array([0, 253402300800 * 1000, 5], type=pa.timestamp("ms"))
    path = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"id": ["a", "far", "c"], "text": ["x", "y", "z"], "ts": far}), path)
    rows = list(read_rows([path], id_column="id"))
    assert [r.row_id for r in rows] == ["a", "far", "c"] and [r.error is None for r in rows] == [True, False, True]
    assert "row 1: column 'ts' cannot be read" in rows[1].error and rows[1].values == {"id": "far", "text": "y"}


def test_columns_of_jsonl_read_on_for_a_wanted_key_the_first_objects_lack(tmp_path):
    lines = [json.dumps({"id": i}).encode() for i in range(150)] + [json.dumps({"id": 150, "text": "x"}).encode()]
    path = write_jsonl(tmp_path / "late.jsonl", lines)
    assert read_columns([path]) == {"id"}  # the first objects only
    assert read_columns([path], wanted=frozenset({"text", "nowhere"})) == {"id", "text"}
    assert read_columns([write_jsonl(tmp_path / "empty.jsonl", [])], wanted=frozenset({"text"})) == set()
    lines[-1] = json.dumps({"id": 150, "titel_ü": "x"}, ensure_ascii=False).encode()  # written unescaped
    assert read_columns([write_jsonl(tmp_path / "u.jsonl", lines)], wanted=frozenset({"titel_ü"})) == {"id", "titel_ü"}
