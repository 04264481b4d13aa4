"""The KV transfer protocol's wire format, shared by the sender (`sender.py`) and the receiver (`receiver.py`):
its version, the control messages (JSON objects) and their validation, and the handshake's authentication.

A channel (`channel.py`: each backend frames control messages itself, capped by `check_control_size`) carries a
handshake, then one transfer at a time:

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

    Every raw message holds one tensor-parallel rank's bytes (`engine.execution.kv_cache.KvShards`: a block is one
    region per rank, each on its rank's device): a whole block is num_ranks messages, rank order; a layer of a group of
    blocks (`layer_gather.LayerGather`) is num_ranks messages, rank order, each that rank's slices in block order.
    end{ok, first_token | error}  ───►       the request may decode (ok) or is dropped (the prefill gave up)
                                  ◄───       done{ok, error}

Completion and failure are explicit messages; every wait is bounded; a channel that fails mid-transfer is closed
and the receiver aborts the request it was filling.
"""
from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# 2: the receiver challenges with a nonce; hello carries an HMAC of it under the cluster secret.
# 3: layer-wise offers (num_layers > 0): a header per layer and an end message that carries the first token.
# 4: one raw message per tensor-parallel rank (a rank's region of a block, or its slices of a layer-wise group).
PROTOCOL_VERSION = 4

# block id -> that block's memory, one 1-D uint8 tensor per tensor-parallel rank, rank order (any devices)
BlockView = Callable[[int], "list[torch.Tensor]"]


def encode(msg: dict) -> bytes:
    return json.dumps(msg).encode()


def decode(raw: bytes) -> dict:
    """A control message. Raises ValueError for anything but a JSON object (a peer speaking garbage)."""
    msg = json.loads(raw)
    if not isinstance(msg, dict):
        raise ValueError(f"control message is not an object: {raw[:80]!r}")
    return msg


def handshake_mac(secret: str | None, nonce: str, compat_hash: str) -> str:
    """HMAC-SHA256 (RFC 2104) of the receiver's nonce and the sender's layout hash, keyed by the cluster secret:
    proves the sender knows the secret without sending it, bound to this connection. "" without a secret."""
    if not secret:
        return ""
    return hmac.new(secret.encode(), f"{nonce}:{compat_hash}".encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Offer:
    """One request's KV, announced by the sender (validated: a malformed offer drops the channel).

    num_layers: 0 = whole blocks follow. > 0 = layer-wise: the blocks come layer by layer, each layer after a
    header (each rank's region of a block is num_layers equal slices, `engine.execution.kv_cache`'s layout; a layer is
    one slice per rank, `layer_gather.LayerGather`). Either way an end message follows with the prefill's first
    token (a layer-wise offer goes out before it is sampled).
    block_nbytes: bytes of one block, all ranks' regions together.
    num_ranks: tensor-parallel ranks, so regions, of each block (1 without TP).
    trace_context: the sender's W3C trace headers ({"traceparent": ...}; empty when not tracing), so the receive
    is recorded in the same trace.
    """

    request_id: str
    first_block: int  # index in the request's block table of the first block sent (earlier ones are not sent)
    num_blocks: int
    block_nbytes: int
    num_tokens: int
    num_layers: int = 0
    num_ranks: int = 1
    trace_context: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, msg: dict) -> "Offer":
        """Raises ValueError unless every field is present with its type (ints non-negative)."""
        try:
            offer = cls(**{name: msg[name] for name in cls.__dataclass_fields__ if name != "trace_context"},
                        trace_context=msg.get("trace_context") or {})
        except KeyError as e:
            raise ValueError(f"offer without {e}") from None
        if not isinstance(offer.request_id, str) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for v in (offer.first_block, offer.num_blocks, offer.block_nbytes, offer.num_tokens,
                          offer.num_layers, offer.num_ranks)) or offer.num_ranks < 1:
            raise ValueError(f"malformed offer {msg}")
        if not isinstance(offer.trace_context, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in offer.trace_context.items()):
            raise ValueError(f"malformed trace context in offer {msg}")
        return offer


def parse_end(msg: dict) -> tuple[int, str | None]:
    """(first_token, None) from a successful end message, (0, why) from a sender that gave up.
    Raises ValueError on anything else."""
    if msg.get("type") != "end":
        raise ValueError(f"expected the end message, got {msg}")
    if not msg.get("ok"):
        return 0, f"the prefill worker ended the transfer: {msg.get('error')}"
    token = msg.get("first_token")
    if not isinstance(token, int) or isinstance(token, bool) or token < 0:
        raise ValueError(f"malformed end message {msg}")
    return token, None
