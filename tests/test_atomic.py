"""io's local file helpers: whole-or-nothing writes (io/atomic.py) and the cross-process file lock (io/lease.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchgen.io.atomic import TEMP_MARK, atomic_open, atomic_path, remove_leftovers, write_atomic
from batchgen.io.lease import file_lock


def test_write_replaces_whole_and_a_failure_leaves_the_old_file(tmp_path):
    target = tmp_path / "deep" / "er" / "cache.json"
    write_atomic(target, b"first", durable=True)
    write_atomic(target, b"second")
    assert target.read_bytes() == b"second"
    with pytest.raises(RuntimeError), atomic_open(target, "w", encoding="utf-8") as f:
        f.write("half of a third")
        raise RuntimeError("the writer died")
    assert target.read_bytes() == b"second"
    assert sorted(p.name for p in target.parent.iterdir()) == ["cache.json"]  # no temp file left


def test_a_new_file_has_the_ordinary_mode(tmp_path):
    umask = os.umask(0o022)
    try:
        write_atomic(tmp_path / "report.html", b"<html>")
    finally:
        os.umask(umask)
    assert (tmp_path / "report.html").stat().st_mode & 0o777 == 0o644


def test_exclusive_never_replaces(tmp_path):
    target = tmp_path / "lease-1.json"
    write_atomic(target, b"mine", exclusive=True)
    with pytest.raises(FileExistsError):
        write_atomic(target, b"theirs", exclusive=True)
    assert target.read_bytes() == b"mine" and [p.name for p in tmp_path.iterdir()] == ["lease-1.json"]


def test_a_folder_appears_whole(tmp_path):
    dest = tmp_path / "model"
    with pytest.raises(OSError), atomic_path(dest) as staging:
        os.makedirs(Path(staging) / "sub")
        (Path(staging) / "sub" / "a.bin").write_bytes(b"a")
        raise OSError("the download broke off")
    assert list(tmp_path.iterdir()) == []
    with atomic_path(dest) as staging:
        os.makedirs(staging)
        (Path(staging) / "a.bin").write_bytes(b"a")
        assert not dest.exists()
    assert [p.name for p in dest.iterdir()] == ["a.bin"]


def test_remove_leftovers_takes_only_temp_names(tmp_path):
    target = tmp_path / "model"
    keep = [tmp_path / "model", tmp_path / "other.tmp-1", tmp_path / ".modelx.tmp-1"]
    gone = [tmp_path / f".model{TEMP_MARK}abc", tmp_path / f"..model{TEMP_MARK}abc{TEMP_MARK}def"]
    for p in keep + gone:
        p.write_bytes(b"x")
    (tmp_path / f".model{TEMP_MARK}dir").mkdir()
    (tmp_path / f".model{TEMP_MARK}dir" / "f").write_bytes(b"x")
    remove_leftovers(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in keep)


_HOLDER = """
import sys, time
from pathlib import Path
from batchgen.io.lease import file_lock
with file_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _hold(lock: Path, seconds: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(lock), str(seconds)], stdout=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


@pytest.mark.timeout(60)
def test_file_lock_serializes_processes_and_dies_with_its_holder(tmp_path):
    lock = tmp_path / "cache" / ".lock"
    holder = _hold(lock, 1.0)
    start = time.monotonic()
    with file_lock(lock):
        waited = time.monotonic() - start
    holder.wait(timeout=30)
    assert waited > 0.5  # it waited for the holder to let go
    killed = _hold(lock, 60.0)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait(timeout=30)
    start = time.monotonic()
    with file_lock(lock):  # a SIGKILLed holder never blocks the next one
        assert time.monotonic() - start < 5
