"""The prefix cache's key for a full KV block: a chained hash of its tokens, one definition for the engine's pool and
offload tiers, its KV events, and the coordinator's prefix index (which must stay free of numerical libraries: this
module uses the standard library only)."""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

SALT_LABEL = b"pdserve cache salt\0"  # a salt's root hashes this label first: no block's hash can equal it


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int], root: bytes | None = None) -> bytes:
    """Chained hash of one full block: BLAKE2b-128 of (parent hash || token ids as int64), 16 bytes.

    Chaining makes a block's hash identify the whole prefix up to and including it, as in vLLM's prefix cache. A
    prompt's first block (parent_hash None) chains from `root`: a cache salt's (`chain_root`), or nothing.
    """
    h = hashlib.blake2b(digest_size=16)
    start = parent_hash if parent_hash is not None else root
    if start is not None:
        h.update(start)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def chain_root(cache_salt: str) -> bytes | None:
    """Where a request's chain of block hashes starts: None without a salt; with one, BLAKE2b-128 of `SALT_LABEL`
    and the salt, so salted chains never meet unsalted or other salts' chains (vLLM's `cache_salt`)."""
    if not cache_salt:
        return None
    return hashlib.blake2b(SALT_LABEL + cache_salt.encode(), digest_size=16).digest()


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str = "") -> list[bytes]:
    """The chained hashes of a prompt's full blocks (a partial last block has none), from the salt's root."""
    out: list[bytes] = []
    parent = chain_root(cache_salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size])
        out.append(parent)
    return out
