"""Container health check over the gRPC health protocol: exit 0 when the server reports SERVING, 1 otherwise.

    python -m pdserve_server.cli.healthcheck --ready-file /tmp/pdserve.ready [--service NAME]
    python -m pdserve_server.cli.healthcheck --address 127.0.0.1:7002 [--service pdserve.liveness]
    python -m pdserve_server.cli.healthcheck --ready-file /tmp/pdserve.ready --tls-ca ca.pem \
        [--tls-cert c.pem --tls-key c.key]

A server started with --tls-cert says so in its ready file, and the check then speaks TLS: it verifies the server
against --tls-ca (default: the system's roots) under --tls-server-name (default: the address's host), and presents
--tls-cert/--tls-key to a server that requires client certificates (mTLS). With --address, any --tls-* flag turns
TLS on. Loads grpc only (no torch), so a probe every few seconds costs little.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout_s: float = 4.0,
          credentials: grpc.ChannelCredentials | None = None, server_name: str | None = None) -> bool:
    """Whether `address` reports SERVING for `service` ("" = the whole server); TLS when `credentials` is given,
    the certificate checked for `server_name` when given."""
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    channel = (grpc.secure_channel(address, credentials, options) if credentials is not None
               else grpc.insecure_channel(address))
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve_server.cli.healthcheck",
                                     description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--ready-file", help="the ready file the process wrote (its address, and whether it is TLS)")
    where.add_argument("--address", help="host:port")
    parser.add_argument("--service", default="", help='health service name ("" = readiness of the whole server)')
    parser.add_argument("--tls-ca", help="PEM CA that signed the server's certificate (default: system roots)")
    parser.add_argument("--tls-cert", help="PEM client certificate, for a server that requires one (mTLS)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-server-name", help="name the server's certificate must carry (default: the host)")
    args = parser.parse_args(argv)
    if args.ready_file:
        path = Path(args.ready_file)
        if not path.is_file():
            return 1  # not serving yet
        ready = json.loads(path.read_text())
        address, tls = ready["address"], bool(ready.get("tls"))
    else:
        address = args.address
        tls = any((args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name))
    try:
        credentials = (grpc.ssl_channel_credentials(_read(args.tls_ca), _read(args.tls_key), _read(args.tls_cert))
                       if tls else None)
    except OSError as e:
        print(f"healthcheck: {e}", file=sys.stderr)
        return 1
    return 0 if check(address, args.service, credentials=credentials, server_name=args.tls_server_name) else 1


if __name__ == "__main__":
    sys.exit(main())
