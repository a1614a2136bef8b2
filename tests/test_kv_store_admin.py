"""`batchgen cache ls|du|prune` over a prefix store's objects, on a local folder and on S3."""
from __future__ import annotations

import os
import time

import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.engine.kv_store import KVStore
from batchgen.engine.kv_store.admin import NoStore, list_objects, parse_duration, prune, usage
from tests.s3_server import moto_server, s3  # noqa: F401

DAY = 86400.0
# namespaces as the engine names them: 32 hex digits (KVIdentity.namespace)
OLD, NEW, NS, NS1, NS2 = ("%032x" % i for i in range(1, 6))


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
    fill(url, OLD, range(3))
    age(tmp_path / "kv" / OLD, 10)
    fill(url, NEW, range(10, 15))
    (tmp_path / "kv" / NEW / "ab").mkdir(parents=True)
    (tmp_path / "kv" / NEW / "ab" / "x.json").write_text("{}")  # not a block: never listed or deleted
    per = usage(list_objects(url))
    assert {ns: u.objects for ns, u in per.items()} == {OLD: 3, NEW: 5}
    size = per[NEW].bytes // 5
    assert per[OLD].newest < per[NEW].oldest
    assert prune(url, older_than_s=7 * DAY, dry_run=True).deleted == 3
    assert len(list_objects(url)) == 8
    r = prune(url, older_than_s=7 * DAY)
    assert (r.deleted, r.kept) == (3, 5) and set(usage(list_objects(url))) == {NEW}
    r = prune(url, max_bytes=2 * size)
    assert (r.deleted, r.kept, r.kept_bytes) == (3, 2, 2 * size)
    assert (tmp_path / "kv" / NEW / "ab" / "x.json").exists()


def test_prune_clears_stale_temp_files(tmp_path):
    url = str(tmp_path / "kv")
    fill(url, NS, range(2))
    temp = tmp_path / "kv" / NS / "00" / ".0000000000000001.kv.tmp-dead"
    temp.parent.mkdir(parents=True, exist_ok=True)
    temp.write_bytes(b"partial")
    age(temp.parent, 1)
    r = prune(url, max_bytes=10**9)
    assert r.deleted == 1 and not temp.exists() and r.kept == 2


def test_only_the_stores_own_objects_are_listed_counted_or_pruned(tmp_path):
    """Files that are not laid out as blocks (a user's *.kv, another program's temp file) stay, whatever is
    pruned; a namespace's own folder is a store too; a writer's temp file is no block."""
    root = tmp_path / "kv"
    fill(str(root), NS, range(3))
    foreign = [root / "projects" / "settings.kv", root / "downloads" / "model.safetensors.tmp-keep",
               root / NS / "zz" / "0000000000000001.kv", root / NS / "01" / "0000000000000002.kv"]
    for path in foreign:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("not a block")
    writing = root / NS / "00" / ".0000000000000009.kv.tmp-0123abcd"
    writing.write_bytes(b"half")
    age(root, 2)
    assert {ns: u.objects for ns, u in usage(list_objects(str(root))).items()} == {NS: 3}
    assert {ns: u.objects for ns, u in usage(list_objects(str(root / NS))).items()} == {NS: 3}
    r = prune(str(root), max_bytes=0)
    assert (r.deleted, r.kept) == (4, 0) and not writing.exists()
    assert all(path.exists() for path in foreign)


def test_a_missing_store_and_a_concurrent_prune(tmp_path, monkeypatch):
    with pytest.raises(NoStore):
        list_objects(str(tmp_path / "stroe"))
    out = CliRunner().invoke(main, ["cache", "ls", str(tmp_path / "stroe")])
    assert out.exit_code == 1 and out.output.strip() == f"error: no prefix store at {tmp_path / 'stroe'}"
    url = str(tmp_path / "kv")
    fill(url, NS, range(4))
    listed = list_objects(url)
    os.remove(listed[0].path)  # another prune got there first
    monkeypatch.setattr("batchgen.engine.kv_store.admin.list_objects", lambda *a, **k: listed)
    assert prune(url, max_bytes=0).deleted == 4
    assert not any(os.path.exists(o.path) for o in listed)


def test_cache_commands_name_a_bad_url_in_one_line_without_its_credentials():
    cli = CliRunner()
    for url in ("s3://myuser:TopSecretPassw0rd@bucket/kv/", "nosuchproto://x/kv", "s3:/bucket/kv"):
        for args in (["ls", url], ["du", url], ["prune", url, "--max-bytes", "0"]):
            out = cli.invoke(main, ["cache", *args])
            assert out.exit_code == 1 and out.output.startswith("error: "), out.output
            assert "Traceback" not in out.output and "TopSecret" not in out.output and out.output.count("\n") == 1


def test_parse_duration():
    assert [parse_duration(t) for t in ("90", "45s", "30m", "12h", "7d", "2w")] == \
        [90, 45, 1800, 43200, 7 * DAY, 14 * DAY]
    with pytest.raises(ValueError, match="duration"):
        parse_duration("soon")


def test_cache_commands_on_s3(s3, monkeypatch):  # noqa: F811
    url = s3.url("kv")
    fill(url, NS1, range(4), s3.storage_options)
    fill(url, NS2, range(2), s3.storage_options)
    for name, value in (("AWS_ENDPOINT_URL", s3.endpoint_url), ("AWS_ACCESS_KEY_ID", "testing"),
                        ("AWS_SECRET_ACCESS_KEY", "testing")):
        monkeypatch.setenv(name, value)
    cli = CliRunner()
    out = cli.invoke(main, ["cache", "ls", url])
    assert out.exit_code == 0, out.output
    assert NS1 in out.output and "4 blocks" in out.output and NS2 in out.output
    out = cli.invoke(main, ["cache", "du", url])
    assert out.exit_code == 0 and "6 blocks in 2 namespaces" in out.output
    out = cli.invoke(main, ["cache", "prune", url])
    assert out.exit_code != 0 and "--max-bytes" in out.output
    out = cli.invoke(main, ["cache", "prune", url, "--older-than", "1d"])
    assert out.exit_code == 0 and "deleted 0 blocks" in out.output
    out = cli.invoke(main, ["cache", "prune", url, "--max-bytes", "0"])
    assert out.exit_code == 0 and "deleted 6 blocks" in out.output
    with pytest.raises(NoStore):  # an object store keeps no empty folders: nothing is left at the URL
        list_objects(url, s3.storage_options)
