"""KV transfer connectors: move a request's KV blocks from a prefill worker's cache straight into the blocks a
decode worker reserved. The workers use it; the engine does not (it exposes its KV cache's blocks, and its error
and layer-progress types, `engine.errors` and `engine.kv_stream`, which this package takes). Adding a
connector touches this package only: a module with its `Backend`, its name in `backends.py`.

Layers, bottom up:

- `channel.py`: the one abstraction a backend implements, a framed channel; `backends.py` names the backends
  (`tcp.py`, `ucx.py`, and `nccl.py`: torch.distributed point-to-point, NCCL between GPUs, gloo for CPU caches);
  `choice.py` resolves `--connector auto` on the decode worker.
- `wire.py`: the protocol every backend shares: its message sequence, messages and handshake authentication.
- `sender.py` (`KvSender`, prefill worker) and `receiver.py` (`KvReceiver`, decode worker): its two ends.
  `layer_gather.py` shapes layer-wise streaming's messages for both.
"""
from pdserve_server.kv_transfer.backends import (BACKEND_NAMES, available_backends, get_backend, parse_address,
                                                 release_transports)

__all__ = ["BACKEND_NAMES", "available_backends", "get_backend", "parse_address", "release_transports"]
