"""Which KV connector a decode worker listens on when asked for "auto"."""
from __future__ import annotations

import asyncio
import logging

from pdserve_server.kv_transfer import available_backends, get_backend
from pdserve_server.kv_transfer.channel import Backend
from pdserve_server.kv_transfer.receiver import KvReceiver
from pdserve_server.kv_transfer.sender import KvSender

log = logging.getLogger(__name__)


async def choose_backend(name: str, compat: str, host: str, device: str) -> Backend:
    """Resolve 'auto': ucx when the KV cache is on a GPU and ucxx completes a loopback handshake, else tcp.

    On CPU-only hosts ucx is not picked: over loopback UCX's TCP transport reached about a tenth of the plain tcp
    connector's MiB/s (bench/transfer_rate.py, docs/history/benchmarks.md), and ucxx aborted the process when many
    in-flight endpoints were cancelled at once. UCX's value is GPU memory (cuda_ipc/cuda_copy) and RDMA. Logs the
    pick and why.

    Raises:
        ValueError: an unknown connector name, or "ucx" asked for without ucxx installed.
    """
    if name != "auto":
        return get_backend(name)
    if not device.startswith("cuda"):
        log.info("KV connector auto -> tcp (CPU KV cache: ucx brings no transport benefit here)")
        return get_backend("tcp")
    if "ucx" not in available_backends():
        log.info("KV connector auto -> tcp (ucxx not installed)")
        return get_backend("tcp")
    try:
        backend = get_backend("ucx")
        probe = KvReceiver(backend, compat, lambda b: None, sink=None)  # type: ignore[arg-type]
        address = await probe.start(host)
        sender = KvSender(compat, lambda b: None, timeout_s=10)
        try:
            ch = await asyncio.wait_for(sender.connect(address), 10)
            ch.close()
        finally:
            sender.close()
            probe.close()
        log.info("KV connector auto -> ucx (handshake ok)")
        return backend
    except Exception as e:  # noqa: BLE001 - any failure means "not usable here"
        log.warning("KV connector auto: ucx unusable (%s); using tcp", e)
        return get_backend("tcp")
