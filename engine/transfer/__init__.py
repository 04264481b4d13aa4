"""KV transfer connectors: move a request's KV blocks from a prefill worker's cache straight into the blocks a
decode worker reserved.

Backends (`tcp`, `ucx`) provide only a framed channel; the protocol in `protocol.py` is shared:

    sender                                   receiver
                                  ◄───       challenge{version, nonce}
    hello{version, compat_hash,   ───►       checks layout compatibility and, with a cluster secret,
          mac=HMAC(secret, nonce)}           the mac (constant-time)
                                  ◄───       hello_ack{ok, error}
    offer{request_id, num_blocks, ...} ───►  looks up the reservation (reject if unknown/aborted)
                                  ◄───       accept{ok, error}
    block 0 .. block n-1 (raw)    ───►       received in place into reserved blocks
                                  ◄───       done{ok, error}

Completion and failure are explicit messages; every wait is bounded; a channel that fails mid-transfer is closed
and the receiver aborts the request it was filling.
"""
from engine.transfer.backends import (BACKEND_NAMES, available_backends, get_backend, parse_address,
                                      release_transports)

__all__ = ["BACKEND_NAMES", "available_backends", "get_backend", "parse_address", "release_transports"]
