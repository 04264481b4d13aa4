"""KV transfer connectors: move a request's KV blocks from a prefill worker's cache straight into the blocks a
decode worker reserved.

Layers, bottom up:

- `channel.py`: the one abstraction a backend implements, a framed channel; `backends.py` names the backends
  (`tcp.py`, `ucx.py`, and `torchdist.py` for `nccl`).
- `wire.py`: the protocol every backend shares: its message sequence, messages and handshake authentication.
- `sender.py` (`KvSender`, prefill worker) and `receiver.py` (`KvReceiver`, decode worker): its two ends.
  `layer_gather.py` shapes layer-wise streaming's messages for both.
"""
from engine.transfer.backends import (BACKEND_NAMES, available_backends, get_backend, parse_address,
                                      release_transports)

__all__ = ["BACKEND_NAMES", "available_backends", "get_backend", "parse_address", "release_transports"]
