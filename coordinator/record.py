"""What became of one request: the record the metrics, the access log and the trace attributes are made from."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields

log = logging.getLogger("pdserve.access")


@dataclass
class RequestRecord:
    """One finished request, in seconds and tokens (what `CoordinatorMetrics.observe` and the access log use).

    Attributes:
        finish_reason: "stop", "length" or "abort"; error_code: the gRPC status name when the request failed
            ("" when it finished).
        token_gaps: seconds between consecutive output tokens (inter-token latency), one per token after the first.
        relays: seconds from a decode worker's send to the coordinator's hand-off, one per chunk (`stream.Progress`).
    """

    request_id: str
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    token_gaps: tuple[float, ...] = ()
    relays: tuple[float, ...] = ()
    finish_reason: str = ""
    error_code: str = ""
    prefill_worker: str = ""
    decode_worker: str = ""
    migrations: int = 0


def log_access(record: RequestRecord, error: str = "") -> None:
    """One access-log line per request (logger "pdserve.access"): the record's fields as structured `extra`
    attributes (JSON output carries them as keys: --log-format json) and a readable summary as the message."""
    # shallow: every field but the per-token tuples is a scalar (asdict's deep copy was 3% of a request's
    # coordinator CPU)
    fields = {f.name: getattr(record, f.name) for f in dataclass_fields(record)
              if f.name not in ("token_gaps", "relays")}
    fields.update(ttft_ms=round(record.ttft_s * 1e3, 1), e2e_ms=round(record.e2e_s * 1e3, 1), error=error)
    for k in ("ttft_s", "e2e_s", "queue_s", "prefill_s", "transfer_s"):
        fields.pop(k)
    status = record.error_code or "OK"
    # A failure is a warning for whoever watches the log; a client that went away is ordinary traffic.
    level = logging.WARNING if record.error_code not in ("", "CANCELLED") else logging.INFO
    # A refused id may hold control characters (a newline, ANSI escapes): written escaped, it cannot forge a line.
    rid = record.request_id if record.request_id.isprintable() else ascii(record.request_id)
    log.log(level, "request %s %s: %d prompt + %d output tokens, finish %s, TTFT %.0f ms, e2e %.0f ms, P %s D %s%s",
             rid, status, record.prompt_tokens, record.output_tokens, record.finish_reason or "-",
             record.ttft_s * 1e3, record.e2e_s * 1e3, record.prefill_worker or "-", record.decode_worker or "-",
             f": {error}" if error else "", extra={"access": fields})
