"""Scheduling policy: which queued request goes next, which running request gives way, and how the token budget is
shared between tenants. The scheduler (`engine.scheduling.scheduler`) asks; this module decides. No model, no clock of
its own.

Order between requests, most important first:
1. priority: lower value sooner (vLLM's convention). A request may preempt running requests of a higher value
   (for a batch slot or for KV blocks); they resume later by recompute, losing no token.
2. fairness between tenants: the tenant that has received the least weighted service goes first. Service is the
   virtual token counter of VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024): every token a
   step computes for a request (prefill chunk, decode, draft) adds 1 / weight to its tenant's counter. A tenant that
   had nothing in the scheduler starts at the least counter among tenants with work (VTC's lift), so idle time is not
   banked as credit. Prefix-cache hits and KV received from a prefill worker cost nothing: not computed here.
3. arrival: the coordinator's arrival time (a migrated request keeps its original one), then admission order.

With one tenant and one priority this is first come, first served.
"""
from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Iterator

from pdserve_server.engine.request import Request


class SchedulingPolicy:
    """Per-tenant service counters and the order between requests.

    Call `admit` when a request enters the scheduler and `release` when it leaves (finished, aborted, failed):
    a tenant's counter lives while it has requests here.
    """

    def __init__(self) -> None:
        self.served: dict[str, float] = {}  # tenant -> weighted tokens computed (VTC counter)
        self._num_requests: Counter[str] = Counter()
        self._order: dict[str, int] = {}  # request id -> admission number (the last tie-break)
        self._next = itertools.count()

    def admit(self, req: Request) -> None:
        """A request entered the scheduler."""
        tenant = req.scheduling.tenant
        if not self._num_requests[tenant]:
            active = [self.served[t] for t, n in self._num_requests.items() if n and t != tenant]
            self.served[tenant] = max(self.served.get(tenant, 0.0), min(active, default=0.0))
        self._num_requests[tenant] += 1
        self._order[req.request_id] = next(self._next)

    def release(self, req: Request) -> None:
        """A request left the scheduler; a tenant with none left is forgotten (memory stays bounded)."""
        if self._order.pop(req.request_id, None) is None:
            return
        tenant = req.scheduling.tenant
        self._num_requests[tenant] -= 1
        if not self._num_requests[tenant]:
            del self._num_requests[tenant]
            self.served.pop(tenant, None)

    def charge(self, req: Request, num_tokens: int) -> None:
        """A step computed num_tokens for req: its tenant's counter grows by num_tokens / weight."""
        tenant = req.scheduling.tenant
        if tenant in self.served:
            self.served[tenant] += num_tokens / req.scheduling.weight

    def static_key(self, req: Request) -> tuple[int, float, int]:
        """Order within one tenant (and of the running batch): (priority, arrival, admission number)."""
        return req.scheduling.priority, req.arrival_time, self._order.get(req.request_id, -1)

    def key(self, req: Request) -> tuple[int, float, float, int]:
        """Order across tenants: (priority, tenant's service counter, arrival, admission number)."""
        return (req.scheduling.priority, self.served.get(req.scheduling.tenant, 0.0), req.arrival_time,
                self._order.get(req.request_id, -1))

    @staticmethod
    def outranks(a: Request, b: Request) -> bool:
        """a may preempt b: a has strictly higher priority (a lower value). Fairness never preempts."""
        return a.scheduling.priority < b.scheduling.priority


class RequestQueue:
    """Requests waiting (for a step, or for a KV reservation), in the policy's order.

    One list per tenant, each sorted by `SchedulingPolicy.static_key`; `peek` compares the tenants' heads with
    their current counters. O(tenants) per peek, O(log n + n) per push (list insert).
    """

    def __init__(self, policy: SchedulingPolicy):
        self.policy = policy
        self._by_tenant: dict[str, list[Request]] = {}
        self._len = 0

    def push(self, req: Request) -> None:
        queue = self._by_tenant.setdefault(req.scheduling.tenant, [])
        bisect.insort(queue, req, key=self.policy.static_key)
        self._len += 1

    def peek(self) -> Request | None:
        """The request that goes next, or None when empty."""
        heads = [q[0] for q in self._by_tenant.values()]
        return min(heads, key=self.policy.key, default=None)

    def pop(self) -> Request:
        """Remove and return the request `peek` names.

        Raises:
            IndexError: the queue is empty.
        """
        req = self.peek()
        if req is None:
            raise IndexError("pop from an empty RequestQueue")
        self.remove(req)
        return req

    def remove(self, req: Request) -> bool:
        """Remove req if queued. Returns whether it was."""
        queue = self._by_tenant.get(req.scheduling.tenant)
        i = self._index(queue, req) if queue else None
        if i is None:
            return False
        del queue[i]
        if not queue:
            del self._by_tenant[req.scheduling.tenant]
        self._len -= 1
        return True

    def _index(self, queue: list[Request], req: Request) -> int | None:
        """Where req is in its tenant's list, by identity (a dataclass's == compares every field)."""
        key = self.policy.static_key(req)
        i = bisect.bisect_left(queue, key, key=self.policy.static_key)
        while i < len(queue) and self.policy.static_key(queue[i]) == key:
            if queue[i] is req:
                return i
            i += 1
        return None

    def worst_first(self) -> list[Request]:
        """Every queued request, the one to give way first (lowest priority, newest) first."""
        return sorted(self, key=self.policy.static_key, reverse=True)

    def __iter__(self) -> Iterator[Request]:
        """Every queued request, tenant by tenant (no particular order between tenants)."""
        for queue in list(self._by_tenant.values()):
            yield from queue

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __contains__(self, req: object) -> bool:
        if not isinstance(req, Request):
            return False
        queue = self._by_tenant.get(req.scheduling.tenant)
        return bool(queue) and self._index(queue, req) is not None
