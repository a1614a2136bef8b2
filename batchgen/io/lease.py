"""One writer at a time: per output folder on any store, a lease file with a heartbeat taken with a
create-if-absent write; per local path (a cache entry), ``file_lock``, a lock the kernel holds.

The lease lives in ``<output>/_lease/lease-<generation>.json``; the highest generation is the current
one. A run takes a free or stale lease by creating the next generation, which only one racing run can
do where the store has a conditional create (local disks: a hard link; S3: ``If-None-Match: *``). The
holder rewrites its file every ``timeout_s / 6`` seconds. A lease is stale when its heartbeat is older
than ``timeout_s``, or at once when its holder was a process on this machine that no longer exists.
A holder that finds another run's lease file newest, or could not renew for ``0.75 * timeout_s`` (a
paused process, an unreachable store), has lost the lease: it stops writing and never renews again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from batchgen.io.errors import OutputError
from batchgen.io.redaction import redact
from batchgen.io.store import Store

log = logging.getLogger(__name__)

LEASE_DIR = "_lease"
_NAME_RE = re.compile(r"^lease-(\d{8,})\.json$")
_CREATE_ATTEMPTS = 5
_SELF_FENCE = 0.75  # fraction of the timeout after which a holder that could not renew stops writing
_HELD_HERE: set[str] = set()  # owners of the leases this process holds or is taking now


class LeaseHeld(OutputError):
    """Another live run owns the output folder."""


class LeaseLost(OutputError):
    """This run no longer owns the output folder it is writing."""


@dataclass(frozen=True)
class LeaseSettings:
    """How a writer takes its output folder: ``timeout_s`` until a silent holder is stale; ``force``
    takes the lease even from a live holder (``--force-unlock``)."""

    timeout_s: float = 120.0
    force: bool = False


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> str:
    """The start time of pid in clock ticks since boot (Linux), which tells a reused pid apart."""
    stat = _read_text(f"/proc/{pid}/stat")
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else ""


def _machine() -> str:
    """Boot id and pid namespace: two processes see each other's pids iff these match."""
    try:
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        namespace = ""
    return f"{_read_text('/proc/sys/kernel/random/boot_id')}/{namespace}"


def _pid_alive(pid: int, start: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return True
    if _read_text(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()[:1] == ["Z"]:
        return False  # killed, not yet reaped
    return not start or _process_start(pid) in ("", start)


@dataclass
class Holder:
    """What a lease file says about the run that holds it."""

    owner: str
    host: str
    pid: int
    pid_start: str
    machine: str
    since: str
    heartbeat: float  # seconds since the epoch, by the holder's clock
    timeout_s: float

    @classmethod
    def me(cls, timeout_s: float) -> Holder:
        pid = os.getpid()
        return cls(owner=uuid.uuid4().hex, host=socket.gethostname(), pid=pid, pid_start=_process_start(pid),
                   machine=_machine(), since=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   heartbeat=time.time(), timeout_s=timeout_s)

    @classmethod
    def parse(cls, data: bytes) -> Holder:
        doc = json.loads(data.decode("utf-8"))
        return cls(owner=str(doc["owner"]), host=str(doc["host"]), pid=int(doc["pid"]),
                   pid_start=str(doc.get("pid_start") or ""), machine=str(doc.get("machine") or ""),
                   since=str(doc["since"]), heartbeat=float(doc["heartbeat"]), timeout_s=float(doc["timeout_s"]))

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode("utf-8")

    def describe(self) -> str:
        age = max(0.0, time.time() - self.heartbeat)
        return f"host {self.host} pid {self.pid} since {self.since} (last heartbeat {age:.0f} s ago)"

    def stale(self) -> bool:
        """Whether the holder is gone: silent for its timeout, a dead process on this machine, or this very process
        (host and pid) while none of its live leases is this one: an earlier run of this process that was
        interrupted, or a process that had this pid before (a restarted container; one whose pid namespace is
        another only once it has missed two heartbeats, in case it is a live sibling with our host name)."""
        silent = time.time() - self.heartbeat
        if silent > self.timeout_s:
            return True
        if self.host != socket.gethostname():
            return False
        same_machine = self.machine == _machine()
        if self.pid == os.getpid() and self.owner not in _HELD_HERE:
            return same_machine or silent > self.timeout_s / 3
        return same_machine and not _pid_alive(self.pid, self.pid_start)


def lease_name(generation: int) -> str:
    return f"{LEASE_DIR}/lease-{generation:08d}.json"


class Lease:
    """The lease of one output folder, held by this process between acquire() and release()."""

    def __init__(self, store: Store, display: str, settings: LeaseSettings = LeaseSettings()) -> None:
        self.store = store
        self.display = redact(display)
        self.settings = settings
        self.me = Holder.me(settings.timeout_s)
        self.name: str | None = None
        self._lost: str | None = None
        self._renewed = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- taking it ------------------------------------------------------------------------

    def _generations(self) -> dict[int, str]:
        return {int(m.group(1)): f"{LEASE_DIR}/{n}" for n in self.store.list(LEASE_DIR)
                if (m := _NAME_RE.match(n))}

    def _holder(self, name: str) -> Holder | None:
        """The holder a lease file names; None when it vanished or cannot be read (taken as free)."""
        try:
            return Holder.parse(self.store.read(name))
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            log.warning("ignoring unreadable lease %s: %s", redact(self.store.full(name)), exc)
            return None

    def acquire(self) -> None:
        """Take the lease or raise LeaseHeld naming the live holder."""
        _HELD_HERE.add(self.me.owner)  # from before its file exists: a racing lease of this process sees it live
        try:
            self._acquire()
        except BaseException:
            _HELD_HERE.discard(self.me.owner)
            self._stop.set()
            self._delete_own()  # a signal between creating the file and returning (SIGTERM's Terminated)
            raise

    def _delete_own(self) -> None:
        """Deletes every lease file that names this run."""
        try:
            mine = [n for n in self._generations().values()
                    if (holder := self._holder(n)) is not None and holder.owner == self.me.owner]
            if mine:
                self.store.delete(mine)
        except Exception as exc:  # noqa: BLE001 - a stale lease file only delays the next run's start
            log.warning("could not delete the lease of %s: %s", self.display, redact(str(exc)))

    def _acquire(self) -> None:
        for _ in range(_CREATE_ATTEMPTS):
            generations = self._generations()
            top = max(generations, default=0)
            current = self._holder(generations[top]) if generations else None
            if current is not None and current.owner == self.me.owner:
                return self._start(generations[top], generations)
            if current is not None and not current.stale():
                if not self.settings.force:
                    raise LeaseHeld(redact(
                        f"output {self.display} is being written by another run: {current.describe()}; "
                        f"wait for it to finish, or if that run is gone, rerun with --force-unlock (its "
                        f"lease also expires {current.timeout_s:.0f} s after its last heartbeat)"))
                log.warning("--force-unlock: taking %s from the run on %s", self.display, current.describe())
            elif current is not None:
                log.warning("taking over %s from a run that is gone: %s", self.display, current.describe())
            name = lease_name(top + 1)
            self.me.heartbeat = time.time()
            if self.store.create(name, self.me.to_bytes()):
                return self._start(name, generations)
            # lost a race for this generation, or our own write landed before a retried request failed
        raise LeaseHeld(f"could not take the lease of {self.display}: other runs keep taking it")

    def _start(self, name: str, older: dict[int, str]) -> None:
        self.name = name
        self._renewed = time.monotonic()
        try:
            self.store.delete(sorted(n for n in older.values() if n != name))
        except Exception as exc:  # noqa: BLE001 - old generations are harmless: the newest one counts
            log.debug("could not delete old lease files: %s", redact(str(exc)))
        self._thread = threading.Thread(target=self._beat, name="lease-heartbeat", daemon=True)
        self._thread.start()

    # -- keeping it -----------------------------------------------------------------------

    @property
    def interval_s(self) -> float:
        return self.settings.timeout_s / 6

    def renew(self) -> None:
        """Rewrite the heartbeat if this run still holds the lease; otherwise mark it lost.

        Held means: renewed within the self-fence time, and the newest lease file still names this run
        (generations restart at 1 once a folder is released, so the owner is compared, not the name).
        """
        assert self.name is not None
        silent = time.monotonic() - self._renewed
        if silent > _SELF_FENCE * self.settings.timeout_s:
            self._lost = f"could not renew it for {silent:.0f} s"
            return
        self._lost = self._taken()
        if self._lost is not None:
            return
        self.me.heartbeat = time.time()
        self.store.put(self.name, self.me.to_bytes())
        self._renewed = time.monotonic()

    def _taken(self) -> str | None:
        """Why the newest lease file does not name this run (None while it does)."""
        generations = self._generations()
        top = generations.get(max(generations, default=-1))
        holder = self._holder(top) if top else None
        if top != self.name or holder is None or holder.owner != self.me.owner:
            return f"taken by {holder.describe()}" if holder else "its lease file was deleted"
        return None

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s) and self._lost is None:
            try:
                self.renew()
            except Exception as exc:  # noqa: BLE001 - retried at the next beat; ensure_held() fences
                log.warning("could not renew the lease of %s: %s", self.display, redact(str(exc)))

    def ensure_held(self) -> None:
        """Raise LeaseLost unless this run still owns the folder: checked before every write, by reading the newest
        lease file (a run that --force-unlock took it from, or a deleted folder, stops at its next write)."""
        silent = time.monotonic() - self._renewed
        if self._lost is None and silent > _SELF_FENCE * self.settings.timeout_s:
            self._lost = f"could not renew it for {silent:.0f} s"
        if self._lost is None and self.name is not None:
            self._lost = self._taken()
        if self._lost is not None:
            raise LeaseLost(redact(f"this run lost the lease of {self.display} ({self._lost}); it stopped "
                                   f"writing, and a rerun resumes from what was committed"))

    def release(self) -> None:
        """Stop the heartbeat and delete the lease file (unless someone else took it)."""
        self._stop.set()
        _HELD_HERE.discard(self.me.owner)
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.name is None:
            return
        name, self.name = self.name, None
        holder = self._holder(name)
        if holder is not None and holder.owner == self.me.owner:
            try:
                self.store.delete([name])
            except Exception as exc:  # noqa: BLE001 - a stale lease file only delays the next run's start
                log.warning("could not delete the lease of %s: %s", self.display, redact(str(exc)))


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Serializes the processes of one machine on ``path`` (best effort where fcntl is missing); the kernel
    drops the lock when its holder dies, even by SIGKILL, so a killed process never blocks later ones. Unlike
    a :class:`Lease` it needs no heartbeat, and it works only where every holder shares the local disk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX; callers' final renames are still atomic
        yield
        return
    with open(path, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
