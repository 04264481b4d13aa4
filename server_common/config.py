"""The server settings every process shares (one definition; the CLI builds its flags from it)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServerArgs:
    """Where and how a process serves gRPC.

    Attributes:
        host: bind address. 127.0.0.1 by default; binding beyond loopback without TLS or authentication is logged
            as a warning.
        port: gRPC port; 0 picks a free one (read it back from the ready file).
        ready_file: where to write {"address": ...} once serving (for launchers and tests); None = don't.
        tls_cert, tls_key: PEM certificate chain and private key: serve TLS instead of plaintext.
        tls_client_ca: PEM CA bundle: require client certificates it signed (mTLS).
        cluster_secret_file: file with the cluster's shared secret. Workers require it on their gRPC API and on
            the KV channel (an HMAC over a nonce); the coordinator and prefill workers present it. None: the
            PDSERVE_CLUSTER_SECRET environment variable, else no internal authentication.
        advertise_host: the host peers dial to reach this process (its ready file and a decode worker's KV
            address); None = the bind host, or for a wildcard bind this host's address
            (`server_common.addresses.advertise_host`).
        drain_timeout_s: on SIGTERM, how long in-flight requests may finish after health turns NOT_SERVING.
        metrics_port: serve Prometheus metrics at http://host:metrics_port/metrics; None = off, 0 = any free port
            (the ready file says which).
    """

    host: str = field(default="127.0.0.1", metadata={"help": "bind address"})
    port: int = field(default=0, metadata={
        "min": 0, "max": 65535, "help": "gRPC port (0 = any free port; see --ready-file)"})
    ready_file: str | None = field(default=None, metadata={"help": 'write {"address": ...} here once serving'})
    tls_cert: str | None = field(default=None, metadata={"help": "PEM certificate chain: serve TLS"})
    tls_key: str | None = field(default=None, metadata={"help": "PEM private key of --tls-cert"})
    tls_client_ca: str | None = field(default=None, metadata={"help": "PEM CA: require client certificates (mTLS)"})
    cluster_secret_file: str | None = field(default=None, metadata={
        "help": "shared secret for worker APIs and KV channels (else $PDSERVE_CLUSTER_SECRET, else none)"})
    advertise_host: str | None = field(default=None, metadata={
        "help": "host peers dial to reach this process (default: the bind host, or this host's IP for 0.0.0.0)"})
    drain_timeout_s: float = field(default=30.0, metadata={"min": 0,
        "help": "on SIGTERM: NOT_SERVING, then in-flight requests get this long to finish, seconds"})
    metrics_port: int | None = field(default=None, metadata={"min": 0, "max": 65535,
        "help": "Prometheus /metrics HTTP port (0 = any free port; unset = no metrics endpoint)"})

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None
