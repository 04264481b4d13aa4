"""Start a grpc.aio server with standard health checking and reflection, and announce it in a ready file."""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

MAX_MESSAGE_BYTES = 64 << 20


@dataclass
class RunningServer:
    """A started server: the grpc.aio server, the port it bound, and its health servicer (to change status)."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer


async def start_grpc_server(host: str, port: int, add_servicers: Callable[[grpc.aio.Server], None],
                            service_names: list[str]) -> RunningServer:
    """Start a grpc.aio server with `grpc.health.v1.Health` and reflection.

    Args:
        host, port: bind address; port 0 picks a free port.
        add_servicers: registers the role's services on the server.
        service_names: full names of those services (e.g. "pdserve.v1.Generation"), for health and reflection.

    Health reports SERVING for "" and each service name once the server has started.

    Raises:
        RuntimeError: the address could not be bound (grpc raises it from add_insecure_port).
    """
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    for name in ["", *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, bound, health_servicer)


def write_ready_file(path: str | None, address: str, **extra) -> None:
    """Atomically write {"address": address, "pid": ..., **extra} so a launcher polling the file never reads half
    of it. Does nothing when path is None."""
    if not path:
        return
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps({"address": address, "pid": os.getpid(), **extra}))
    tmp.rename(path)
