"""The prefix tiers below the device cache: host memory (LRU) and a persistent store, for one engine.

Full blocks go down as they are computed (the step that computes them copies them out, see
``StepInput.save_blocks``): into the host tier, and through a background writer into the store, so a
block later evicted from the device is still found, and later jobs find it too. For a waiting sequence
a background thread reads the blocks of its prompt that the device lacks from the store (``prefetch``);
when it is admitted the blocks found in a lower tier are copied into its fresh device blocks by the
step that first computes it (``restore``), and only the rest is computed. A load still running when the
sequence's turn comes waits while other sequences compute; with nothing else to run the scheduler waits
for it, at most as long as computing those tokens would take, then computes what did not arrive.
Under tensor parallelism a block's bytes are every rank's shard in rank order (the executor gathers and
splits them); data-parallel replicas share one ``PrefixTiers``.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING

import torch

from batchgen.engine.kv_store.format import BlockMiss
from batchgen.engine.kv_store.host import HostCache
from batchgen.engine.kv_store.store import RankStores

if TYPE_CHECKING:
    from batchgen.engine.core.block_manager import BlockManager
    from batchgen.engine.core.sequence import Sequence

log = logging.getLogger(__name__)

PREFETCH_AHEAD = 16  # waiting sequences whose blocks are read ahead of their turn
LOAD_THREADS = 4
WRITE_THREADS = 2
MAX_PENDING_WRITES = 256  # blocks queued for the store before the engine waits for the writer
DEFAULT_WAIT_S = 30.0  # longest wait for a load before any prefill was timed
MIN_WAIT_S = 0.05
MISS_CAUSES = ("absent", "corrupt", "foreign", "error")


@dataclass
class Prefetch:
    """Blocks ``start``, ``start + 1``, ... of one sequence's prompt as they arrive (row, tier)."""

    start: int
    loaded: list[tuple[torch.Tensor, str]] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False


@dataclass
class Restore:
    """What admitting a sequence took from the lower tiers: byte rows for its fresh blocks, by tier."""

    block_ids: list[int] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)
    host_tokens: int = 0
    store_tokens: int = 0


class PrefixTiers:
    def __init__(self, block_size: int, block_nbytes: int, host_bytes: int, store: RankStores | None):
        self.block_size, self.block_nbytes = block_size, block_nbytes
        self.host = HostCache(host_bytes)
        self.store = store
        self.seconds_per_token: float | None = None  # the engine's measured prefill cost, to bound waits
        self._prefetches: dict[int, Prefetch] = {}
        self._counters: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stored: set[int] = set()  # hashes known to be in the store
        self._loads = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="kv-load") if store else None
        self._writes = ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="kv-write") if store else None
        self._write_slots = threading.BoundedSemaphore(MAX_PENDING_WRITES)

    # ---- counters (drained into each step's record) ------------------------------------------------
    def _count(self, name: str, value: float) -> None:
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + value

    def take_counters(self) -> dict[str, float]:
        """Store traffic since the last call, under StepRecord's field names."""
        with self._lock:
            counters, self._counters = self._counters, {}
        return counters

    # ---- loading ---------------------------------------------------------------------------------
    def prefetch(self, waiting: deque["Sequence"], block_manager: "BlockManager") -> None:
        """Starts reading the store for the first waiting sequences that have no load yet."""
        if self._loads is None:
            return
        for seq in islice(waiting, PREFETCH_AHEAD):
            if seq.seq_id in self._prefetches:
                continue
            blocks = block_manager.prefix_blocks(seq)
            start = block_manager.num_cached_blocks(seq)
            job = Prefetch(start)
            self._prefetches[seq.seq_id] = job
            self._loads.submit(self._load, job, blocks[start:])

    def _load(self, job: Prefetch, blocks: list[tuple[int, tuple[int, ...]]]) -> None:
        try:
            for block_hash, tokens in blocks:
                if job.cancelled:
                    break
                row = self.host.get(block_hash, tokens)
                if row is not None:
                    job.loaded.append((row, "host"))
                    continue
                row = self._read(block_hash, tokens)
                if row is None:
                    break
                job.loaded.append((row, "store"))
        except Exception:  # noqa: BLE001 - a failed load leaves the blocks to be computed
            log.exception("prefix store: loading blocks failed; computing them")
        finally:
            job.done.set()

    def _read(self, block_hash: int, tokens: tuple[int, ...]) -> torch.Tensor | None:
        try:
            got = self.store.read(block_hash, tokens, self.block_nbytes)
        except BlockMiss as miss:
            self._count(f"prefix_store_misses_{miss.cause}", 1)
            return None
        self._count("prefix_store_bytes_read", got.nbytes)
        self._count("prefix_store_load_time_s", got.seconds)
        self._stored.add(block_hash)
        row = torch.frombuffer(bytearray(got.payload), dtype=torch.uint8)
        self.host.put(block_hash, tokens, row)
        return row

    def ready(self, seq: "Sequence", busy: bool) -> bool:
        """Whether ``seq`` may be admitted now: its load is done, or nothing else runs (then waits for
        the load, at most as long as computing its tokens would take)."""
        job = self._prefetches.get(seq.seq_id)
        if job is None or job.done.is_set():
            return True
        if busy:
            return False
        start = time.perf_counter()
        job.done.wait(self._wait_limit(seq))
        self._count("prefix_store_wait_time_s", time.perf_counter() - start)
        return True

    def _wait_limit(self, seq: "Sequence") -> float:
        if self.seconds_per_token is None:
            return DEFAULT_WAIT_S
        return max(MIN_WAIT_S, self.seconds_per_token * (seq.num_tokens - seq.num_computed_tokens))

    def restore(self, seq: "Sequence", block_manager: "BlockManager") -> Restore:
        """After ``admit``: fills the sequence's next blocks from the lower tiers, as far as they reach."""
        job = self._prefetches.pop(seq.seq_id, None)
        if job is not None:
            job.cancelled = True  # a load still running stops; what arrived is used
        loaded = list(job.loaded) if job is not None else []
        out = Restore()
        blocks = block_manager.prefix_blocks(seq)
        for i in range(seq.num_computed_tokens // self.block_size, len(blocks)):
            j = i - job.start if job is not None else -1
            row, tier = loaded[j] if 0 <= j < len(loaded) else (self.host.get(*blocks[i]), "host")
            if row is None:
                break
            out.block_ids.append(seq.block_table[i])
            out.rows.append(row)
            block_manager.mark_restored(seq, i)
            if tier == "host":
                out.host_tokens += self.block_size
            else:
                out.store_tokens += self.block_size
        return out

    # ---- saving ----------------------------------------------------------------------------------
    def save(self, blocks: list[tuple[int, int, tuple[int, ...]]], rows: torch.Tensor) -> None:
        """Takes the byte rows of blocks just computed: into the host tier, and to the store behind."""
        for (_, block_hash, tokens), row in zip(blocks, rows):
            if self.host.budget:
                self.host.put(block_hash, tokens, row.clone())
            if self._writes is not None and block_hash not in self._stored:
                self._stored.add(block_hash)
                self._write_slots.acquire()
                self._writes.submit(self._write, block_hash, tokens, row.numpy().tobytes())

    def _write(self, block_hash: int, tokens: tuple[int, ...], payload: bytes) -> None:
        try:
            written = self.store.write(block_hash, tokens, payload)
            if written:
                self._count("prefix_store_bytes_written", written)
            else:
                self._stored.discard(block_hash)
        finally:
            self._write_slots.release()

    def close(self) -> None:
        """Waits for queued writes (later jobs find every block) and stops the threads."""
        for job in self._prefetches.values():
            job.cancelled = True
        for pool in (self._loads, self._writes):
            if pool is not None:
                pool.shutdown(wait=True)
