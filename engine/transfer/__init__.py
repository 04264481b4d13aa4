"""KV transfer connectors: move a request's KV blocks from a prefill worker's cache straight into the blocks a
decode worker reserved.

Backends (`tcp`, `ucx`, `nccl`) provide only a framed channel; the protocol in `protocol.py` is shared:

    sender                                   receiver
                                  ◄───       challenge{version, nonce}
    hello{version, compat_hash,   ───►       checks layout compatibility and, with a cluster secret,
          mac=HMAC(secret, nonce)}           the mac (constant-time)
                                  ◄───       hello_ack{ok, error}
    offer{request_id, num_blocks, ───►       looks up the reservation (reject if unknown/aborted)
          num_layers, ...}
                                  ◄───       accept{ok, error}
    num_layers == 0:
      block 0 .. block n-1 (raw)  ───►       received in place into reserved blocks
    num_layers == L (layer-wise streaming, sent as the prefill's last chunk writes each layer):
      layer{0}, layer 0 of blocks 0 .. n-1, ..., layer{L-1}, layer L-1 of blocks 0 .. n-1
    end{ok, first_token | error}  ───►       the request may decode (ok) or is dropped (the prefill gave up)
                                  ◄───       done{ok, error}

Completion and failure are explicit messages; every wait is bounded; a channel that fails mid-transfer is closed
and the receiver aborts the request it was filling.
"""
from engine.transfer.backends import (BACKEND_NAMES, available_backends, get_backend, parse_address,
                                      release_transports)

__all__ = ["BACKEND_NAMES", "available_backends", "get_backend", "parse_address", "release_transports"]
