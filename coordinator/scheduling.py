"""A request's scheduling at the coordinator: who it is for (its tenant and that tenant's weight), its priority, and
its deadlines, turned into the `worker_pb2.SchedulingHints` the workers' engines order their queues by
(`engine.request.SchedulingParams`, applied by `engine.scheduling.policy`).

- Tenant: the caller's API key id ("key:<id>") when the port requires keys (a request's `tenant` field cannot pick
  another's share), else the request's `tenant` field when set, else the peer ("peer:ipv4:<ip>", gRPC's peer
  without the port). Per-caller limits and request-id scoping use `doors.grpc_call.caller`, which is the key or
  the peer: a keyless client cannot escape its limits by naming tenants.
- Weight: the --tenant-weights file's (`read_tenants`); tenants it does not name weigh 1.
- Priority: granted, not self-asserted (`grant_priority`): a nonzero priority is refused under the default
  `--scheduling-policy fcfs`; under `priority`, bounded below by the tenant's floor (--tenant-weights' third column,
  0 for an API key without one), so a key cannot overtake other keys' requests unless the operator says so.
- Deadlines: the call's gRPC deadline (and our own request timeout) bounds the whole request; ttft_slo_ms bounds its
  first token. Before a request is routed, the predicted wait of the worker it would go to is compared with the
  time left before the first token is due (`check_first_token_deadline`): a request that cannot make it is refused
  with DEADLINE_EXCEEDED before any worker is called. The TTFT objective also travels to the worker
  (`hints`), whose engine refuses the request if it is still queued when that time passes.
"""
from __future__ import annotations

import dataclasses
import math
import time
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve_server.coordinator.errors import RequestError, invalid
from pdserve_server.coordinator.validation import shorten
from pdserve.v1 import generate_pb2, worker_pb2
from pdserve_server.server_common.errors import CommandError

MAX_TENANT_CHARS = 128  # a tenant is a key in the engines' fairness counters and appears in logs
# Weights travel as float32 (SchedulingHints.weight): a tiny one would round to 0, which the workers refuse.
MIN_WEIGHT, MAX_WEIGHT = 1e-6, 1e6
MIN_PRIORITY, MAX_PRIORITY = -2**31, 2**31 - 1  # GenerateRequest.priority is an int32
SCHEDULING_POLICIES = ("fcfs", "priority")  # `grant_priority`


@dataclass(frozen=True)
class SchedulingAsk:
    """What a request's door asked for (before the tenant is resolved).

    Attributes:
        priority: lower runs sooner; 0 = default.
        tenant: the request's own tenant field ("" = none).
        ttft_slo_ms: the first token is wanted within this many ms of arrival; 0 = no objective.
    """

    priority: int = 0
    tenant: str = ""
    ttft_slo_ms: int = 0

    @classmethod
    def from_request(cls, request: generate_pb2.GenerateRequest) -> "SchedulingAsk":
        """The public GenerateRequest's priority, tenant and ttft_slo_ms.

        Raises:
            RequestError: INVALID_ARGUMENT for a tenant that is too long or holds control characters.
        """
        check_tenant(request.tenant)
        return cls(request.priority, request.tenant, request.ttft_slo_ms)


@dataclass(frozen=True)
class RequestScheduling:
    """A request's scheduling once admitted: what it asked for, whose share it is, and when it arrived.

    Attributes:
        ask: the door's priority, tenant field and TTFT objective.
        tenant: the resolved tenant (`resolve_tenant`); weight: its weight (> 0).
        arrival: time.monotonic() at the coordinator, seconds.
        deadline_why: what sets the request's own deadline (`Flow.deadline`), for messages: "the call's deadline"
            (the client's gRPC deadline) or "the request timeout".
        cache_salt: the workers' prefix-cache salt (`SchedulingHints.cache_salt`): the tenant under
            --isolate-prefix-cache-by-tenant, else "" (one cache for everyone).
    """

    ask: SchedulingAsk
    tenant: str
    weight: float
    arrival: float
    deadline_why: str = "the call's deadline"
    cache_salt: str = ""

    def hints(self, first_token_sent: bool, now: float | None = None) -> worker_pb2.SchedulingHints:
        """The workers' hints for one attempt (`hints`), with the cache salt."""
        msg = hints(self.ask, self.tenant, self.weight, self.arrival, first_token_sent, now)
        msg.cache_salt = self.cache_salt
        return msg

    def first_token_due(self, request_deadline: float, first_token_sent: bool) -> tuple[float, str]:
        """When the next token must come, and why (`first_token_due`)."""
        due, why = first_token_due(self.ask, self.arrival, request_deadline, first_token_sent)
        return due, (self.deadline_why if why == "the call's deadline" else why)


def check_tenant(tenant: str) -> None:
    """Raises RequestError INVALID_ARGUMENT unless `tenant` has at most MAX_TENANT_CHARS characters, none of them a
    control character (it is echoed in logs)."""
    if len(tenant) > MAX_TENANT_CHARS:
        raise invalid(f"tenant has {len(tenant)} characters; at most {MAX_TENANT_CHARS} are allowed")
    if any(unicodedata.category(c).startswith("C") for c in tenant):
        raise invalid(f"tenant {shorten(tenant)} contains control or unassigned characters; use printable text")


def resolve_tenant(caller: str, tenant_field: str, keys_required: bool) -> str:
    """Whose fair share a request counts against (see the module docstring).

    Args:
        caller: `doors.grpc_call.caller`: "key:<id>" or "peer:<addr>".
        tenant_field: the request's tenant field ("" = none).
        keys_required: the port authenticates API keys (then the key decides, whatever the field says).
    """
    if keys_required or not tenant_field:
        return caller
    return tenant_field


@dataclass(frozen=True)
class Tenant:
    """One tenant's line in the --tenant-weights file (`read_tenants`).

    Attributes:
        weight: its share of the workers' token budget while tenants compete, in [MIN_WEIGHT, MAX_WEIGHT].
        priority_floor: the most urgent (lowest) priority its requests run at under `--scheduling-policy priority`;
            a request asking for a lower one runs at the floor (`grant_priority`). None = the default floor.
    """

    weight: float = 1.0
    priority_floor: int | None = None


def read_tenants(path: str | None) -> dict[str, Tenant]:
    """Tenants from a file of "NAME WEIGHT [PRIORITY_FLOOR]" lines (blank lines and '#' comments skipped). NAME is a
    request's tenant field value, "key:<id>" for an API key (`pdserve key-id` prints a key's id: the first 8 hex
    digits of its SHA-256), or "peer:ipv4:<ip>" ("peer:ipv6:[<ip>]") for a keyless client that sends no tenant.
    WEIGHT is a number in [MIN_WEIGHT, MAX_WEIGHT]: a tenant of weight 2 gets twice the tokens of one of weight 1
    while both have work queued. PRIORITY_FLOOR, an integer, is the most urgent priority the tenant is granted
    (`grant_priority`). No file: {} (every tenant weighs 1 and has the default floor).

    Raises:
        CommandError: the file cannot be read, or a line is malformed (naming the line).
    """
    if not path:
        return {}
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise CommandError(f"--tenant-weights {path}: {e.strerror or e}") from None
    tenants: dict[str, Tenant] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        try:
            if len(parts) not in (2, 3):
                raise ValueError("expected 'NAME WEIGHT [PRIORITY_FLOOR]'")
            name, weight = parts[0], _number(parts[1])
            if not MIN_WEIGHT <= weight <= MAX_WEIGHT:  # NaN fails too; all positive as float32
                raise ValueError(f"weight must be a number in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}], got {parts[1]}")
            floor = None
            if len(parts) == 3:
                if not parts[2].lstrip("+-").isdigit() or not MIN_PRIORITY <= int(parts[2]) <= MAX_PRIORITY:
                    raise ValueError(f"priority floor must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], "
                                     f"got {parts[2]}")
                floor = int(parts[2])
            if name in tenants:
                raise ValueError(f"{name} is listed twice")
            if len(name) > MAX_TENANT_CHARS:
                raise ValueError(f"name has {len(name)} characters; at most {MAX_TENANT_CHARS}")
        except ValueError as e:
            raise CommandError(f"--tenant-weights {path}, line {number}: {e}") from None
        tenants[name] = Tenant(weight, floor)
    return tenants


def _number(text: str) -> float:
    """float(text), or NaN when it is not a number (then the range check names it)."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def grant_priority(ask: SchedulingAsk, entry: Tenant, policy: str, keys_required: bool) -> SchedulingAsk:
    """The priority a request runs at: priority is granted by the operator, never taken by the caller.

    - policy "fcfs" (the default, as vLLM's `--scheduling-policy`): every request runs at priority 0, in arrival
      order within its tenant's fair share; a request asking for another priority is refused, as vLLM refuses it,
      so a caller does not believe it was honoured.
    - policy "priority": a request runs at max(its priority, its tenant's floor). The floor is the tenant's third
      column in --tenant-weights; a tenant without one has floor 0 when the port requires API keys (a key cannot
      overtake other keys' requests unless the operator grants it a negative floor) and no floor on an open port
      (whose callers are trusted, as its tenant field is: without keys a caller can name any tenant).

    Args:
        ask: the door's scheduling ask; entry: the resolved tenant's --tenant-weights line (Tenant() when unnamed);
        policy: one of SCHEDULING_POLICIES; keys_required: the port authenticates keys.

    Returns:
        the ask with the granted priority.

    Raises:
        RequestError: INVALID_ARGUMENT for a nonzero priority under "fcfs".
    """
    if policy == "fcfs":
        if ask.priority:
            raise invalid(f"priority {ask.priority} is not honoured here: this server schedules first come, first "
                          "served (the operator enables priorities with --scheduling-policy priority); send "
                          "priority 0")
        return ask
    floor = entry.priority_floor if entry.priority_floor is not None else (0 if keys_required else None)
    if floor is None or ask.priority >= floor:
        return ask
    return dataclasses.replace(ask, priority=floor)


def hints(ask: SchedulingAsk, tenant: str, weight: float, arrival: float, first_token_sent: bool,
          now: float | None = None) -> worker_pb2.SchedulingHints:
    """The worker's scheduling hints for one attempt.

    Args:
        ask: the door's priority and TTFT objective.
        tenant / weight: the resolved tenant and its weight.
        arrival: when the request arrived, time.monotonic() seconds.
        first_token_sent: the client already has its first token (a resumed attempt): no TTFT deadline.
        now: time.monotonic() now (tests); default the clock.

    Returns:
        SchedulingHints whose ttft_deadline_ms is what is left of ttft_slo_ms (at least 1 ms, so an objective
        already missed still means "refuse if queued"), or 0 without an objective.
    """
    msg = worker_pb2.SchedulingHints(priority=ask.priority, tenant=tenant, weight=weight)
    if ask.ttft_slo_ms and not first_token_sent:
        elapsed_ms = ((time.monotonic() if now is None else now) - arrival) * 1e3
        msg.ttft_deadline_ms = max(1, math.ceil(ask.ttft_slo_ms - elapsed_ms))
    return msg


def without_deadline(msg: worker_pb2.SchedulingHints) -> worker_pb2.SchedulingHints:
    """The hints for a remote-KV decode request: its first token comes from the prefill worker, so no deadline."""
    out = worker_pb2.SchedulingHints()
    out.CopyFrom(msg)
    out.ttft_deadline_ms = 0
    return out


def first_token_due(ask: SchedulingAsk, arrival: float, request_deadline: float,
                    first_token_sent: bool) -> tuple[float, str]:
    """When the next token must come at the latest, time.monotonic() seconds, and what sets it ("the call's
    deadline" or "ttft_slo_ms=N"). request_deadline: when the whole request must end (the client's gRPC deadline
    or our request timeout). After the first token only that applies."""
    due, why = request_deadline, "the call's deadline"
    if ask.ttft_slo_ms and not first_token_sent:
        slo_due = arrival + ask.ttft_slo_ms / 1e3
        if slo_due < due:
            due, why = slo_due, f"ttft_slo_ms={ask.ttft_slo_ms}"
    return due, why


def check_first_token_deadline(worker: str, predicted_wait_s: float | None, due: float, why: str,
                               now: float | None = None) -> None:
    """Refuse a request whose first token cannot come in time, before any worker is called.

    Args:
        worker: the worker the request would be routed to, as the message names it ("prefill worker host:port").
        predicted_wait_s: that worker's predicted wait for the request's first token
            (`PrefillQueue.predicted_wait_s`); None = no prediction yet, never refused.
        due / why: `first_token_due`'s answer.
        now: time.monotonic() now (tests); default the clock.

    Raises:
        RequestError: DEADLINE_EXCEEDED giving the predicted wait and the time left.
    """
    if predicted_wait_s is None or not math.isfinite(due):
        return
    left = due - (time.monotonic() if now is None else now)
    if predicted_wait_s > left:
        raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"the first token cannot come in time: {worker} is predicted to take "
                           f"{predicted_wait_s:.3f} s to reach it, and {max(left, 0.0):.3f} s are left before "
                           f"{why}; refused before any compute (retry with a later deadline or when less loaded)")
