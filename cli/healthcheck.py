"""Container health check over the gRPC health protocol: exit 0 when the server reports SERVING, 1 otherwise.

    python -m cli.healthcheck --ready-file /tmp/pdserve.ready [--service NAME]
    python -m cli.healthcheck --address 127.0.0.1:7002 [--service pdserve.liveness]

Loads grpc only (no torch), so a probe every few seconds costs little.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout_s: float = 4.0) -> bool:
    """Whether `address` reports SERVING for `service` ("" = the whole server)."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cli.healthcheck", description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--ready-file", help="the ready file the process wrote (its address)")
    where.add_argument("--address", help="host:port")
    parser.add_argument("--service", default="", help='health service name ("" = readiness of the whole server)')
    args = parser.parse_args(argv)
    if args.ready_file:
        path = Path(args.ready_file)
        if not path.is_file():
            return 1  # not serving yet
        address = json.loads(path.read_text())["address"]
    else:
        address = args.address
    return 0 if check(address, args.service) else 1


if __name__ == "__main__":
    sys.exit(main())
