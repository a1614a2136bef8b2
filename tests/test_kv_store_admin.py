"""`batchgen cache ls|du|prune` over a prefix store's objects, on a local folder and on S3."""
from __future__ import annotations

import os
import time

import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.engine.kv_store import KVStore
from batchgen.engine.kv_store.admin import list_objects, parse_duration, prune, usage
from tests.s3_server import moto_server, s3  # noqa: F401

DAY = 86400.0


def fill(url: str, namespace: str, hashes: range, storage_options=None, payload: bytes = b"\0" * 1000) -> None:
    store = KVStore(url, namespace, storage_options)
    for h in hashes:
        assert store.write(h, (h,), payload)


def age(root, days: float) -> None:
    """Backdates every object under root by ``days``."""
    past = time.time() - days * DAY
    for dirpath, _, files in os.walk(root):
        for f in files:
            os.utime(os.path.join(dirpath, f), (past, past))


def test_usage_and_prune_by_age_and_size(tmp_path):
    url = str(tmp_path / "kv")
    fill(url, "old", range(3))
    age(tmp_path / "kv" / "old", 10)
    fill(url, "new", range(10, 15))
    (tmp_path / "kv" / "new" / "ab").mkdir(parents=True)
    (tmp_path / "kv" / "new" / "ab" / "x.json").write_text("{}")  # not a block: never listed or deleted
    per = usage(list_objects(url))
    assert {ns: u.objects for ns, u in per.items()} == {"old": 3, "new": 5}
    size = per["new"].bytes // 5
    assert per["old"].newest < per["new"].oldest
    assert prune(url, older_than_s=7 * DAY, dry_run=True).deleted == 3
    assert len(list_objects(url)) == 8
    r = prune(url, older_than_s=7 * DAY)
    assert (r.deleted, r.kept) == (3, 5) and set(usage(list_objects(url))) == {"new"}
    r = prune(url, max_bytes=2 * size)
    assert (r.deleted, r.kept, r.kept_bytes) == (3, 2, 2 * size)
    assert (tmp_path / "kv" / "new" / "ab" / "x.json").exists()


def test_prune_clears_stale_temp_files(tmp_path):
    url = str(tmp_path / "kv")
    fill(url, "ns", range(2))
    temp = tmp_path / "kv" / "ns" / "00" / ".0000000000000001.kv.tmp-dead"
    temp.parent.mkdir(parents=True, exist_ok=True)
    temp.write_bytes(b"partial")
    age(temp.parent, 1)
    r = prune(url, max_bytes=10**9)
    assert r.deleted == 1 and not temp.exists() and r.kept == 2


def test_parse_duration():
    assert [parse_duration(t) for t in ("90", "45s", "30m", "12h", "7d", "2w")] == \
        [90, 45, 1800, 43200, 7 * DAY, 14 * DAY]
    with pytest.raises(ValueError, match="duration"):
        parse_duration("soon")


def test_cache_commands_on_s3(s3, monkeypatch):  # noqa: F811
    url = s3.url("kv")
    fill(url, "ns1", range(4), s3.storage_options)
    fill(url, "ns2", range(2), s3.storage_options)
    for name, value in (("AWS_ENDPOINT_URL", s3.endpoint_url), ("AWS_ACCESS_KEY_ID", "testing"),
                        ("AWS_SECRET_ACCESS_KEY", "testing")):
        monkeypatch.setenv(name, value)
    cli = CliRunner()
    out = cli.invoke(main, ["cache", "ls", url])
    assert out.exit_code == 0, out.output
    assert "ns1" in out.output and "4 blocks" in out.output and "ns2" in out.output
    out = cli.invoke(main, ["cache", "du", url])
    assert out.exit_code == 0 and "6 blocks in 2 namespaces" in out.output
    out = cli.invoke(main, ["cache", "prune", url])
    assert out.exit_code != 0 and "--max-bytes" in out.output
    out = cli.invoke(main, ["cache", "prune", url, "--older-than", "1d"])
    assert out.exit_code == 0 and "deleted 0 blocks" in out.output
    out = cli.invoke(main, ["cache", "prune", url, "--max-bytes", "0"])
    assert out.exit_code == 0 and "deleted 6 blocks" in out.output
    assert usage(list_objects(url, s3.storage_options)) == {}
