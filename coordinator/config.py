"""The coordinator process's configuration: the one definition its CLI flags (and `pdserve serve`'s) are built from."""
from __future__ import annotations

from dataclasses import dataclass, field

from server_common.config import ServerArgs


@dataclass(frozen=True)
class CoordinatorConfig:
    """Coordinator process configuration.

    Attributes:
        model_dir: HF-format directory (for the tokenizer and chat template only).
        model_name: the name clients may pass in GenerateRequest.model.
        server: gRPC bind settings of the public API.
        prefill / decode: worker gRPC addresses ("host:port"); colocated mode uses `decode` only.
        colocated: route each request to one worker that runs both phases.
        max_in_flight: requests admitted at once; more get RESOURCE_EXHAUSTED.
        request_timeout_s: deadline of each worker call, seconds.
        connect_timeout_s: how long to wait for every worker to answer GetInfo at start, seconds.
        stats_interval_s: how often each worker's load (KV headroom, queue) is polled for routing, seconds.
        api_keys_file: keys clients must present, one per line (plus $PDSERVE_API_KEYS, comma-separated); none
            configured = the public port is open.
        worker_tls_ca: PEM CA to verify workers that serve TLS; None = dial workers in plaintext.
        rate_limit_requests_per_s / rate_limit_tokens_per_s: per API key (or per peer without keys), requests and
            tokens (prompt + max_tokens, charged at admission) per second; 0 = unlimited. Bursts of
            rate_limit_burst_s seconds' worth are allowed.
    """

    model_dir: str = field(metadata={"cli": False})
    model_name: str = field(metadata={"cli": False})
    server: ServerArgs = ServerArgs()
    prefill: tuple[str, ...] = field(default=(), metadata={"help": "prefill worker address host:port"})
    decode: tuple[str, ...] = field(default=(), metadata={"help": "decode (or colocated) worker address host:port"})
    colocated: bool = field(default=False, metadata={"help": "one worker runs both phases (the baseline)"})
    max_in_flight: int = field(default=256, metadata={"help": "requests admitted at once (more: RESOURCE_EXHAUSTED)"})
    request_timeout_s: float = field(default=600.0, metadata={"help": "deadline of each worker call, seconds"})
    connect_timeout_s: float = field(default=300.0, metadata={"help": "wait for workers at start, seconds"})
    stats_interval_s: float = field(default=1.0, metadata={"help": "worker load polling period for routing, s"})
    api_keys_file: str | None = field(default=None, metadata={
        "help": "file of API keys clients must send as 'authorization: Bearer <key>' (also $PDSERVE_API_KEYS)"})
    worker_tls_ca: str | None = field(default=None, metadata={"help": "PEM CA of workers that serve TLS"})
    rate_limit_requests_per_s: float = field(default=0.0, metadata={"help": "per key; 0 = unlimited"})
    rate_limit_tokens_per_s: float = field(default=0.0, metadata={
        "help": "per key, prompt + max_tokens charged at admission; 0 = unlimited"})
    rate_limit_burst_s: float = field(default=1.0, metadata={"help": "bursts of this many seconds' worth"})
