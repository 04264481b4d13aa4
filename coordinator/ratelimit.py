"""Per-caller rate limits: token buckets for requests and for tokens per second (RESOURCE_EXHAUSTED with a retry
hint when empty). A caller is an API key, or the peer's address when the port has no keys."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_IDLE_CALLERS = 10_000  # buckets of callers back at full are dropped beyond this many


@dataclass
class TokenBucket:
    """`rate` units per second refill up to `capacity` (the burst); a caller takes `cost` units per admission."""

    rate: float
    capacity: float
    level: float
    updated: float

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait_s(self, cost: float) -> float:
        """Seconds until `cost` can be taken (0: now); inf when it exceeds the burst (never)."""
        if cost > self.capacity:
            return float("inf")
        return max(0.0, (cost - self.level) / self.rate)


class RateLimiter:
    """Requests per second and tokens per second per caller; a rate of 0 turns that limit off.

    Args:
        requests_per_s, tokens_per_s: refill rates.
        burst_s: bucket capacity in seconds of refill (at least one request's worth).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, requests_per_s: float, tokens_per_s: float, burst_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.limits = {"requests": requests_per_s, "tokens": tokens_per_s}
        self.burst_s, self.clock = burst_s, clock
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    @property
    def enabled(self) -> bool:
        return any(rate > 0 for rate in self.limits.values())

    def admit(self, caller: str, kind: str, cost: float) -> float:
        """Take `cost` from the caller's `kind` bucket ("requests" or "tokens") if it holds enough.

        Returns 0.0 when admitted, else the seconds to wait before retrying (inf: larger than the burst allows);
        a refused admission takes nothing.
        """
        rate = self.limits[kind]
        if rate <= 0:
            return 0.0
        now = self.clock()
        bucket = self._buckets.get((caller, kind))
        if bucket is None:
            self._prune(now)
            capacity = max(rate * self.burst_s, 1.0 if kind == "requests" else rate)
            bucket = self._buckets[(caller, kind)] = TokenBucket(rate, capacity, capacity, now)
        bucket.refill(now)
        wait = bucket.wait_s(cost)
        if wait == 0.0:
            bucket.level -= cost
        return wait

    def _prune(self, now: float) -> None:
        if len(self._buckets) < MAX_IDLE_CALLERS:
            return
        for key, bucket in list(self._buckets.items()):
            bucket.refill(now)
            if bucket.level >= bucket.capacity:
                del self._buckets[key]
