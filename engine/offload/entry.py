"""One offloaded KV block as bytes in a store (a disk tier's file, a Redis tier's value): a header (magic, payload
length, BLAKE2b-128 of the payload), then the block's bytes as the KV cache holds them. Reading checks all three, so
a truncated, corrupted or foreign entry is never served."""
from __future__ import annotations

import hashlib
import struct

MAGIC = b"PDKV1\n"
HEADER = struct.Struct("<6sQ16s")  # magic, payload bytes, BLAKE2b-128 of the payload


def checksum(data: memoryview | bytes) -> bytes:
    """BLAKE2b with a 16-byte digest (hashlib)."""
    return hashlib.blake2b(data, digest_size=16).digest()


def header(body: memoryview | bytes) -> bytes:
    """The header to store before `body` (HEADER.size bytes)."""
    return HEADER.pack(MAGIC, len(body), checksum(body))


def payload(data: bytes | bytearray, entry_bytes: int) -> memoryview | None:
    """The payload of a stored entry, or None unless its magic, length (== entry_bytes) and checksum are right."""
    if len(data) < HEADER.size:
        return None
    magic, length, digest = HEADER.unpack_from(data)
    body = memoryview(data)[HEADER.size:]
    if magic != MAGIC or length != entry_bytes or len(body) != entry_bytes or checksum(body) != digest:
        return None
    return body
