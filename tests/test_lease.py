"""One writer per output folder: the lease is exclusive, goes stale, can be forced, and fences its holder."""
from __future__ import annotations

import json
import shutil
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from batchgen.io import OutputError, OutputWriter
from batchgen.io.lease import LEASE_DIR, Holder, Lease, LeaseHeld, LeaseLost, LeaseSettings, lease_name
from batchgen.io.paths import filesystem
from batchgen.io.store import Store
from tests.s3_server import faulty_s3, moto_server, s3, s3_proxy  # noqa: F401  (fixtures)

ROWS = [{"row_id": "a", "output": "x"}]

ROOT = str(Path(__file__).resolve().parents[1])


def lease_for(url: str, opts=None, **settings) -> Lease:
    fs, root = filesystem(url, opts)
    return Lease(Store(fs, root), url, LeaseSettings(**settings))


def lease_files(url: str, opts=None) -> list[str]:
    fs, root = filesystem(url, opts)
    return Store(fs, root).list(LEASE_DIR)


def foreign_holder(age_s: float, timeout_s: float = 60) -> bytes:
    h = Holder.me(timeout_s)
    h.host, h.pid, h.machine, h.heartbeat = "other-host", 4242, "elsewhere", time.time() - age_s
    return h.to_bytes()


@pytest.fixture(params=["local", "s3"])
def out_url(request, tmp_path):
    """(output URL, storage_options) on local disk and on moto S3."""
    if request.param == "local":
        return str(tmp_path / "out"), None
    env = request.getfixturevalue("s3")
    return env.url("out"), env.storage_options


def test_second_writer_is_refused_until_the_first_closes(out_url):
    url, opts = out_url
    first = OutputWriter(url, storage_options=opts, lease=LeaseSettings())
    with pytest.raises(LeaseHeld) as err:
        OutputWriter(url, storage_options=opts, lease=LeaseSettings(), overwrite=True)
    message = str(err.value)
    assert f"host {socket.gethostname()} pid {os.getpid()} since " in message and "--force-unlock" in message
    first.write_part(ROWS)  # the refused overwrite deleted nothing
    first.close()
    assert lease_files(url, opts) == []
    with OutputWriter(url, storage_options=opts, lease=LeaseSettings()) as second:
        assert second.committed_row_ids() == {"a"}
        assert lease_files(url, opts) == ["lease-00000001.json"]


def test_racing_writers_exactly_one_wins(out_url):
    url, opts = out_url
    n = 8
    barrier, won, refused = threading.Barrier(n), [], []

    def contend() -> None:
        lease = lease_for(url, opts)
        barrier.wait()
        try:
            lease.acquire()
            won.append(lease)
        except LeaseHeld:
            refused.append(lease)

    threads = [threading.Thread(target=contend) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(won) == 1 and len(refused) == n - 1
    won[0].release()


def test_stale_and_forced_leases(tmp_path, caplog):
    url = str(tmp_path / "out")
    store = Store(*filesystem(url))
    store.put(lease_name(7), foreign_holder(age_s=5))
    with pytest.raises(LeaseHeld, match=r"host other-host pid 4242 since \S+ \(last heartbeat 5 s ago\)"):
        lease_for(url).acquire()
    store.put(lease_name(7), foreign_holder(age_s=61))  # silent for longer than its timeout
    lease = lease_for(url)
    lease.acquire()
    assert "from a run that is gone: host other-host pid 4242" in caplog.text
    assert lease_files(url) == ["lease-00000008.json"]

    # --force-unlock takes a live lease; the old holder notices at its next write (no renewal needed) and stops
    thief = lease_for(url, force=True)
    thief.acquire()
    with pytest.raises(LeaseLost, match=f"taken by host {socket.gethostname()} pid {os.getpid()}"):
        lease.ensure_held()
    lease.release()
    assert lease_files(url) == ["lease-00000009.json"]  # the loser does not delete the new holder's file
    thief.release()


def test_lease_of_a_killed_process_on_this_machine_is_free_at_once(tmp_path):
    url = str(tmp_path / "out")
    code = ("import os, signal; from batchgen.io import OutputWriter; from batchgen.io.lease import LeaseSettings; "
            f"OutputWriter({url!r}, lease=LeaseSettings(timeout_s=3600)); os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ROOT},
                          capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    held = json.loads((tmp_path / "out" / LEASE_DIR / "lease-00000001.json").read_text())
    assert held["pid"] != os.getpid() and held["timeout_s"] == 3600
    with OutputWriter(url, lease=LeaseSettings()) as w:  # no waiting for the hour-long timeout
        w.write_part(ROWS)


def test_heartbeat_renews_and_a_silent_holder_fences_itself(tmp_path, monkeypatch):
    url = str(tmp_path / "out")
    w = OutputWriter(url, lease=LeaseSettings(timeout_s=1.2))  # renews every 0.2 s
    path = tmp_path / "out" / LEASE_DIR / "lease-00000001.json"
    first = json.loads(path.read_text())["heartbeat"]
    time.sleep(0.7)
    assert json.loads(path.read_text())["heartbeat"] > first
    w.write_part(ROWS)

    def unreachable(*args, **kwargs):
        raise ConnectionError("store unreachable")

    monkeypatch.setattr(w.lease.store, "put", unreachable)
    time.sleep(1.2)  # more than 0.75 x the timeout without a renewal
    monkeypatch.undo()
    with pytest.raises(OutputError, match="lost the lease .*could not renew it for"):
        w.write_part([{"row_id": "b", "output": "y"}])
    assert w.committed_row_ids() == {"a"} and not (tmp_path / "out" / "part-00001.parquet").exists()
    w.close()


def test_a_writer_whose_folder_was_deleted_stops_at_its_next_write(tmp_path):
    """The folder deleted mid-run (its lease file with it): no part, manifest entry or _SUCCESS is written after."""
    url = str(tmp_path / "out")
    w = OutputWriter(url, lease=LeaseSettings(timeout_s=3600))  # no heartbeat would notice for 10 minutes
    w.write_part(ROWS)
    shutil.rmtree(tmp_path / "out")
    with pytest.raises(OutputError, match="lost the lease .*its lease file was deleted"):
        w.write_part([{"row_id": "b", "output": "y"}])
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("part-*"))
    w.close()


def test_lost_create_response_still_takes_the_lease(faulty_s3):  # noqa: F811
    """The PUT lands but its answer is cut off: the retried create finds the lease and reads it as ours."""
    url, opts = faulty_s3.url("out"), faulty_s3.storage_options
    lease = lease_for(url, opts)
    faulty_s3.proxy.inject("reset_mid_response", 1, "PUT")
    lease.acquire()
    assert faulty_s3.proxy.injected["reset_mid_response"] == 1
    with pytest.raises(LeaseHeld):
        lease_for(url, opts).acquire()
    lease.release()


def test_lease_left_by_an_earlier_run_of_this_process_is_free_at_once(tmp_path):
    """A run interrupted before it released its lease (or a restarted container that got the same pid) does not
    block the next run of the same host and pid; a lease this process still holds does."""
    url = str(tmp_path / "out")
    left = Holder.me(3600)  # this host and pid, but no live lease of this process
    (tmp_path / "out" / LEASE_DIR).mkdir(parents=True)
    (tmp_path / "out" / LEASE_DIR / "lease-00000001.json").write_bytes(left.to_bytes())
    with OutputWriter(url, lease=LeaseSettings(timeout_s=3600)) as w:
        w.write_part(ROWS)
        with pytest.raises(LeaseHeld, match=f"pid {os.getpid()}"):
            OutputWriter(url, lease=LeaseSettings(timeout_s=3600))


def test_an_interrupt_right_after_the_lease_file_is_created_leaves_no_lease(tmp_path, monkeypatch):
    url = str(tmp_path / "out")
    create = Store.create

    def create_then_interrupt(self, name, data):
        create(self, name, data)
        raise KeyboardInterrupt  # a signal before create returns

    monkeypatch.setattr(Store, "create", create_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        lease_for(url).acquire()
    monkeypatch.undo()
    assert lease_files(url) == []
    lease = lease_for(url)
    lease.acquire()  # free for the next run at once
    lease.release()
