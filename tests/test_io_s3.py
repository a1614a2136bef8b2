"""io against a local moto S3: reads, writes, resume, faults through the proxy, and redaction."""

from __future__ import annotations

import io
import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.io import (
    InputError, OutputError, OutputWriter, expand_inputs, read_columns, read_output, read_rows, redact,
)
from batchgen.io.paths import filesystem
from batchgen.io.retry import POLICY, RetryPolicy, is_transient, retry
from batchgen.io.store import Store
from tests.s3_server import HOST, S3Env, faulty_s3, moto_server, s3, s3_proxy  # noqa: F401


def parquet_bytes(n: int, row_group_size: int = 40) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table({"id": [f"p{i}" for i in range(n)], "text": ["x" * 50] * n}), sink,
                   row_group_size=row_group_size)
    return sink.getvalue()


def jsonl_bytes(n: int) -> bytes:
    return b"".join(json.dumps({"id": f"j{i}", "text": "y" * 80}).encode() + b"\n" for i in range(n))


def put(env: S3Env, key: str, data: bytes) -> None:
    env.client().put_object(Bucket=env.bucket, Key=key, Body=data)


def keys(env: S3Env, prefix: str) -> list[str]:
    found = env.client().list_objects_v2(Bucket=env.bucket, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"][len(prefix):] for o in found)


def rows(ids):
    return [{"row_id": i, "output": f"out-{i}", "finish_reason": "stop"} for i in ids]


def test_read_from_s3(s3):
    put(s3, "in/a.jsonl", jsonl_bytes(5) + b"{broken\n")
    put(s3, "in/b.parquet", parquet_bytes(100))
    put(s3, "in/_SUCCESS", b"{}")
    opts = s3.storage_options
    files = expand_inputs([s3.url("in/*"), s3.url("in/a.jsonl")], opts)
    assert files == [s3.url("in/a.jsonl"), s3.url("in/b.parquet")]
    assert expand_inputs(s3.url("in"), opts) == files
    got = list(read_rows(files, storage_options=opts, batch_rows=16))
    assert [r.row_id for r in got[:6]] == [f"a.jsonl:{i}" for i in range(6)]
    assert got[5].error and f"{s3.url('in/a.jsonl')} line 6" in got[5].error
    assert [r.values["id"] for r in got[6:]] == [f"p{i}" for i in range(100)]
    assert read_columns(files, storage_options=opts) == {"id", "text"}
    with pytest.raises(InputError, match="in/missing.jsonl"):
        expand_inputs(s3.url("in/missing.jsonl"), opts)
    with pytest.raises(InputError, match="in/gone.jsonl"):
        list(read_rows([s3.url("in/gone.jsonl")], storage_options=opts))
    put(s3, "in/bad.parquet", b"garbage" * 20)
    with pytest.raises(InputError, match="in/bad.parquet"):
        list(read_rows([s3.url("in/bad.parquet")], storage_options=opts))


def test_write_resume_overwrite_on_s3(s3, monkeypatch):
    out, opts = s3.url("out"), s3.storage_options
    w = OutputWriter(out, storage_options=opts)
    w.write_part(rows(["a", "b"]), stats={"n": 2})
    # an exception while the part is being built publishes nothing (no truncated object)
    monkeypatch.setattr("batchgen.io.committer.serialize_part", lambda *a, **k: 1 / 0)
    with pytest.raises(OutputError, match="part-00001"):
        w.write_part(rows(["c"]))
    monkeypatch.undo()
    put(s3, "out/part-00001.parquet", b"orphan from a crashed run")
    w2 = OutputWriter(out, storage_options=opts)
    assert w2.committed_row_ids() == {"a", "b"} and w2.committed_stats() == [{"n": 2}]
    assert keys(s3, "out/") == ["_manifest/part-00000.json", "part-00000.parquet"]
    assert w2.write_part(rows(["c"]), stats={"n": 1}) == s3.url("out/part-00001.parquet")
    w2.commit({"n": 3})
    assert OutputWriter(out, storage_options=opts).is_complete()
    assert read_output(out, opts) == rows(["a", "b", "c"])
    w3 = OutputWriter(out, fmt="jsonl", storage_options=opts, overwrite=True)
    assert keys(s3, "out/") == [] and not w3.is_complete()


def test_unwritable_s3_output_hides_credentials(s3, caplog):
    secret = "s3cr3t-never-shown-0123456789"
    opts = dict(s3.storage_options, key="AKIAIOSFODNN7EXAMPLE", secret=secret)
    with caplog.at_level(logging.DEBUG), pytest.raises(OutputError, match="no-such-bucket/out") as err:
        OutputWriter("s3://no-such-bucket/out", storage_options=opts)
    assert secret not in str(err.value) and secret not in caplog.text
    assert "AKIAIOSFODNN7EXAMPLE" not in str(err.value)
    # credentials handed in stats never reach the output folder
    w = OutputWriter(s3.url("job"), storage_options=opts)
    w.write_part(rows(["a"]), stats={"storage_options": opts})
    w.write_stats({"storage_options": opts, "error": f"failed using {secret}"})
    w.commit({"storage_options": opts})
    client = s3.client()
    for key in ("job/_SUCCESS", "job/stats.json", "job/_manifest/part-00000.json"):
        body = client.get_object(Bucket=s3.bucket, Key=key)["Body"].read().decode()
        assert secret not in body and "AKIAIOSFODNN7EXAMPLE" not in body, key
        assert s3.endpoint_url in body or key.endswith("part-00000.json")
    assert redact(opts)["secret"] == "***"


@pytest.mark.parametrize("kind,method", [("reset", "PUT"), ("slowdown", "PUT"), ("error500", "PUT"),
                                         ("reset", "GET"), ("slowdown", "GET")])
def test_writes_survive_faults(faulty_s3, kind, method):
    out, opts = faulty_s3.url("out"), faulty_s3.storage_options
    w = OutputWriter(out, fmt="jsonl", storage_options=opts)
    faulty_s3.proxy.inject(kind, 2, method)
    w.write_part(rows(["a", "b"]), stats={"n": 2})
    w.write_part(rows(["c"]), stats={"n": 1})
    w.commit({"n": 3})
    w2 = OutputWriter(out, fmt="jsonl", storage_options=opts)
    assert faulty_s3.proxy.injected[kind] == 2 and faulty_s3.proxy.pending() == 0
    assert w2.is_complete() and w2.committed_row_ids() == {"a", "b", "c"}
    assert keys(faulty_s3, "out/") == ["_SUCCESS", "_manifest/part-00000.json", "_manifest/part-00001.json",
                                       "part-00000.jsonl", "part-00001.jsonl"]
    assert read_output(out, opts) == rows(["a", "b", "c"])


@pytest.mark.parametrize("kind", ["reset_mid_response", "reset", "slowdown", "drop"])
def test_reads_survive_faults(faulty_s3, kind):
    put(faulty_s3, "in/a.jsonl", jsonl_bytes(300))
    put(faulty_s3, "in/b.parquet", parquet_bytes(300))
    opts = faulty_s3.storage_options
    assert faulty_s3.proxy.endpoint_url.startswith(f"http://{HOST}:")
    faulty_s3.proxy.inject(kind, 2, None if kind == "drop" else "GET")
    files = expand_inputs(faulty_s3.url("in/*"), opts)
    got = list(read_rows(files, storage_options=opts, batch_rows=64))
    assert faulty_s3.proxy.injected[kind] == 2
    assert [r.values["id"] for r in got] == [f"j{i}" for i in range(300)] + [f"p{i}" for i in range(300)]
    assert not any(r.error for r in got)


def test_large_part_through_proxy(faulty_s3):
    out, opts = faulty_s3.url("big"), faulty_s3.storage_options
    big = [{"row_id": f"r{i}", "output": f"{i:08d}" * 200} for i in range(1000)]  # ~1.6 MB
    w = OutputWriter(out, fmt="jsonl", storage_options=opts)
    faulty_s3.proxy.inject("reset", 1, "PUT")
    w.write_part(big)
    assert read_output(out, opts) == big


def test_env_credentials_and_endpoint(s3, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret-value-1234")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    put(s3, "env/a.jsonl", jsonl_bytes(3))
    assert [r.values["id"] for r in read_rows(expand_inputs(s3.url("env/*.jsonl")))] == ["j0", "j1", "j2"]


def test_retry_helper_and_classification():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("connection reset by peer")
        return "ok"

    fast = RetryPolicy(base_delay=0.001)
    assert retry(flaky, policy=fast) == "ok" and len(calls) == 3
    with pytest.raises(FileNotFoundError):
        retry(lambda: (_ for _ in ()).throw(FileNotFoundError("nope")), policy=fast)
    assert is_transient(OSError(16, "SlowDown"))  # s3fs's SlowDown / 503
    assert not is_transient(PermissionError("AccessDenied")) and not is_transient(ValueError("bad"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["slowdown", "error500"])
def test_a_failed_request_is_tried_the_configured_number_of_times_in_all(faulty_s3, kind, monkeypatch):
    """One retry layer: neither botocore nor s3fs retries under io.retry, so the requests that reach the store
    are the policy's attempts, not a product of three loops (up to 5 x 5 x 6 before). (A connection reset is
    resent once by aiohttp itself where the connection was a pooled one, below every retry layer.)"""
    monkeypatch.setattr("batchgen.io.retry._sleep", lambda s: None)
    proxy = faulty_s3.proxy
    store = Store(*filesystem(faulty_s3.url("out"), faulty_s3.storage_options))  # the job's default options
    proxy.inject(kind, 1, "PUT", "once.json")
    before = proxy.requests
    store.put("once.json", b"{}")
    assert proxy.injected[kind] == 1 and proxy.requests - before == 2  # the failed try and the one after it
    assert store.read("once.json") == b"{}"
    proxy.inject(kind, 10**6, "PUT", "never.json")
    before = proxy.requests
    with pytest.raises(Exception) as failure:
        store.put("never.json", b"{}")
    assert is_transient(failure.value)
    assert proxy.requests - before == POLICY.attempts and proxy.injected[kind] == 1 + POLICY.attempts
