"""The persistent tier: KV block objects under ``URL/<namespace>/<hash[:2]>/<hash>.kv`` on any fsspec store.

Under tensor parallelism each rank's shard of a block is its own object, in that rank's namespace (the
namespace digests the rank): :class:`RankStores` reads and writes a whole block as its shards, rank by rank.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from batchgen.engine.kv_store.format import BlockMiss, decode_block, encode_block
from batchgen.io.paths import filesystem
from batchgen.io.redaction import redact
from batchgen.io.retry import retry
from batchgen.io.store import Store

log = logging.getLogger(__name__)
SUFFIX = ".kv"


def object_name(block_hash: int) -> str:
    key = f"{block_hash:016x}"
    return f"{key[:2]}/{key}{SUFFIX}"


@dataclass
class ReadResult:
    payload: bytes
    nbytes: int  # of the object read
    seconds: float


class KVStore:
    """Reads and writes one namespace's blocks; every read is checked, every write whole or not at all
    (temp file and rename on a local disk, one PUT on object stores), so racing writers are harmless."""

    def __init__(self, url: str, namespace: str, storage_options: dict | None = None):
        fs, root = filesystem(url, storage_options)
        self.url, self.namespace = url, namespace
        self.objects = Store(fs, f"{root.rstrip('/')}/{namespace}")
        self._reported: set[tuple[str, str]] = set()

    def where(self, block_hash: int) -> str:
        """The object's URL with credentials masked, for logs."""
        return redact(f"{self.url.rstrip('/')}/{self.namespace}/{object_name(block_hash)}")

    def read(self, block_hash: int, tokens: tuple[int, ...], nbytes: int) -> ReadResult:
        """The block's bytes; :class:`BlockMiss` when it is absent, damaged, foreign or unreadable."""
        start = time.perf_counter()
        try:
            data = self.objects.read(object_name(block_hash))
        except FileNotFoundError:
            raise BlockMiss("absent") from None
        except Exception as e:  # noqa: BLE001 - a store that fails is a miss, never a failed job
            self._report("error", block_hash, f"{type(e).__name__}: {redact(str(e))}")
            raise BlockMiss("error", type(e).__name__) from None
        try:
            payload = decode_block(data, self.namespace, block_hash, tokens, nbytes)
        except BlockMiss as miss:
            self._report(miss.cause, block_hash, str(miss))
            raise
        return ReadResult(payload, len(data), time.perf_counter() - start)

    def exists(self, block_hash: int) -> bool:
        """Whether an object is stored under the block's key (unchecked: ``read`` checks it)."""
        target = self.objects.full(object_name(block_hash))
        return retry(lambda: self.objects.fs.exists(target), what=f"look up {redact(target)}")

    def write(self, block_hash: int, tokens: tuple[int, ...], payload: bytes) -> int:
        """Stores the block whole; returns the bytes written (0 when the write failed: the block is
        simply not stored)."""
        data = encode_block(self.namespace, block_hash, tokens, payload)
        try:
            self.objects.put(object_name(block_hash), data)
        except Exception as e:  # noqa: BLE001 - a store that fails costs later jobs a recompute, nothing more
            self._report("write error", block_hash, f"{type(e).__name__}: {redact(str(e))}")
            return 0
        return len(data)

    def _report(self, cause: str, block_hash: int, detail: str) -> None:
        """Logs each object's problem once (it is recomputed, and rewritten, wherever it is met)."""
        if (cause, f"{block_hash:x}") in self._reported:
            return
        self._reported.add((cause, f"{block_hash:x}"))
        log.warning("prefix store: %s %s (%s); recomputing it", cause, self.where(block_hash), detail)


class RankStores:
    """A block as the shards of every tensor-parallel rank, one :class:`KVStore` (namespace) per rank: the
    block's bytes are the shards' bytes in rank order, and it is a hit only when every shard is."""

    def __init__(self, ranks: list[KVStore]):
        self.ranks = ranks

    def read(self, block_hash: int, tokens: tuple[int, ...], nbytes: int) -> ReadResult:
        """The whole block; the first shard that misses raises its :class:`BlockMiss`."""
        width = nbytes // len(self.ranks)
        parts = [store.read(block_hash, tokens, width) for store in self.ranks]
        if len(parts) == 1:
            return parts[0]
        return ReadResult(b"".join(p.payload for p in parts), sum(p.nbytes for p in parts),
                          sum(p.seconds for p in parts))

    def write(self, block_hash: int, tokens: tuple[int, ...], payload: bytes) -> int:
        """Writes each rank's shard; the bytes written, or 0 unless every shard was (a later job then
        finds the block incomplete: a miss, recomputed and written again)."""
        width = len(payload) // len(self.ranks)
        written = [store.write(block_hash, tokens, payload[r * width:(r + 1) * width])
                   for r, store in enumerate(self.ranks)]
        return sum(written) if all(written) else 0
