"""The stored form of one KV block: a small JSON header and the raw bytes, sealed by a checksum; no pickle.

Layout: ``MAGIC`` (8 bytes), the header's length (uint32, little endian), the header (UTF-8 JSON), the
block's raw bytes, then a 16-byte BLAKE2b digest of everything before it. The header names the
namespace (everything that makes the bytes, see :func:`kv_namespace`), the block's chain hash and its
token ids, so an object read under a key is used only if it is that very block.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

import torch

from batchgen.io.fingerprint import tree_digest

MAGIC = b"BGKVBLK\x01"
KV_FORMAT_VERSION = 1
DIGEST_SIZE = 16
_LENGTH = struct.Struct("<I")


class BlockMiss(Exception):
    """An object that cannot be used: ``cause`` is "absent", "corrupt", "foreign" or "error"."""

    def __init__(self, cause: str, detail: str = ""):
        super().__init__(f"{cause}: {detail}" if detail else cause)
        self.cause = cause


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()


def weights_digest(path: str, config: dict[str, Any]) -> str:
    """Identifies a model: its config and the content of every file of its local copy (``tree_digest``: each
    file read once, then remembered while it is unchanged), so a checkpoint that differs in one tensor has
    blocks of its own."""
    h = hashlib.blake2b(json.dumps(config, sort_keys=True, default=str).encode(), digest_size=DIGEST_SIZE)
    h.update(tree_digest(path).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class KVIdentity:
    """Everything that makes a block's bytes; two engines share stored blocks only when all of it is equal."""

    weights: str  # weights_digest
    dtype: str
    layout: tuple  # KVLayout.layers: per-head K/V shapes, or latent rows
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1
    rope: str = ""  # rope_description
    version: int = KV_FORMAT_VERSION

    def namespace(self) -> str:
        """A hex digest of the whole identity: the store's folder for these blocks."""
        text = json.dumps([self.weights, self.dtype, self.layout, self.block_size, self.tp_rank, self.tp_size,
                           self.rope, self.version], default=list)
        return _digest(text.encode()).hex()


def rope_description(theta: float, scaling: dict | None, context: str | None = None) -> str:
    """The rotary table's inputs: ``context`` is what it takes from the engine's context (``rope_context``)."""
    return json.dumps({"theta": theta, "scaling": scaling, "context": context}, sort_keys=True, default=str)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode_block(namespace: str, block_hash: int, tokens: tuple[int, ...], payload: bytes) -> bytes:
    header = json.dumps({"format": "batchgen-kv", "version": KV_FORMAT_VERSION, "namespace": namespace,
                         "hash": f"{block_hash:016x}", "tokens": list(tokens), "nbytes": len(payload)},
                        separators=(",", ":")).encode()
    body = MAGIC + _LENGTH.pack(len(header)) + header + payload
    return body + _digest(body)


def decode_block(data: bytes, namespace: str, block_hash: int, tokens: tuple[int, ...], nbytes: int) -> bytes:
    """The block's raw bytes; :class:`BlockMiss` when the object is damaged or is not this very block."""
    head = len(MAGIC) + _LENGTH.size
    if len(data) < head + DIGEST_SIZE or not data.startswith(MAGIC):
        raise BlockMiss("corrupt", "not a batchgen KV block (truncated or overwritten)")
    body, digest = data[:-DIGEST_SIZE], data[-DIGEST_SIZE:]
    if _digest(body) != digest:
        raise BlockMiss("corrupt", "checksum mismatch")
    (length,) = _LENGTH.unpack_from(body, len(MAGIC))
    try:
        header = json.loads(body[head:head + length])
    except ValueError:
        raise BlockMiss("corrupt", "unreadable header") from None
    payload = body[head + length:]
    if (header.get("version") != KV_FORMAT_VERSION or header.get("namespace") != namespace
            or header.get("hash") != f"{block_hash:016x}" or tuple(header.get("tokens", ())) != tuple(tokens)):
        raise BlockMiss("foreign", "written for other weights, settings or tokens")
    if header.get("nbytes") != nbytes or len(payload) != nbytes:
        raise BlockMiss("foreign", f"{len(payload)} bytes where the layout holds {nbytes}")
    return payload
