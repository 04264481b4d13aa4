"""Backend registry: names map to lazily imported backends."""
from __future__ import annotations

import importlib.util

from pdserve_server.kv_transfer.channel import Backend

BACKEND_NAMES = ("tcp", "ucx", "nccl")


def get_backend(name: str) -> Backend:
    """Instantiate a backend by name ("tcp", "ucx" or "nccl": torch.distributed point-to-point, NCCL for CUDA
    caches and gloo for CPU ones).

    Raises:
        ValueError: unknown name, ucx asked for but ucxx is not installed, or nccl without torch.distributed.
    """
    if name == "tcp":
        from pdserve_server.kv_transfer.tcp import TcpBackend

        return TcpBackend()
    if name == "ucx":
        if importlib.util.find_spec("ucxx") is None:
            raise ValueError("connector 'ucx' needs ucxx: pip install ucxx-cu12")
        from pdserve_server.kv_transfer.ucx import UcxBackend

        return UcxBackend()
    if name == "nccl":
        if not _dist_available():
            raise ValueError("connector 'nccl' needs a torch build with torch.distributed")
        from pdserve_server.kv_transfer.nccl import NcclBackend

        return NcclBackend()
    raise ValueError(f"unknown KV connector {name!r}; choose one of {', '.join(BACKEND_NAMES)}")


def _dist_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


def available_backends() -> list[str]:
    """The connectors this process can run (loads torch to check torch.distributed)."""
    names = ["tcp"]
    if importlib.util.find_spec("ucxx") is not None:
        names.insert(0, "ucx")
    if _dist_available():
        names.append("nccl")
    return names


def parse_address(address: str) -> tuple[str, str, int]:
    """'ucx://host:port' -> ('ucx', host, port).

    Raises:
        ValueError: malformed address.
    """
    scheme, sep, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"malformed KV address {address!r}; expected scheme://host:port")
    return scheme, host, int(port)


def release_transports() -> None:
    """End the process-wide transport state a backend started (UCX's context and notifier thread), if any.

    Call it when the event loop that ran KV connectors ends: a worker's shutdown, or each test's loop. ucxx binds
    its notifier thread to the loop it started on, so without this the thread keeps the process from exiting
    and a later loop's UCX transfers never complete.
    """
    from pdserve_server.kv_transfer.ucx import reset

    reset()
