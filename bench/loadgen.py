"""Closed-loop load: keep `concurrency` requests in flight until every request has run or time is up."""
from __future__ import annotations

import asyncio
import time

from backends import RequestResult
from prompts import BenchRequest


async def run_level(backend, requests: list[BenchRequest], concurrency: int, time_limit_s: float,
                    on_done=None) -> tuple[list[RequestResult], float]:
    """Send `requests` with at most `concurrency` in flight. Returns (results, wall seconds).

    Requests not started when `time_limit_s` runs out are skipped; those in flight are cancelled and recorded as
    errors, so a stuck server bounds the run instead of hanging it. `on_done(result)` is called per request
    (progress bar).
    """
    queue = list(reversed(requests))
    results: list[RequestResult] = []
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s

    async def worker() -> None:
        while queue and time.perf_counter() < deadline:
            req = queue.pop()
            try:
                res = await asyncio.wait_for(backend.run(req), max(0.001, deadline - time.perf_counter()))
            except asyncio.TimeoutError:
                res = RequestResult(start=0.0, error="time limit", end=time.perf_counter())
            results.append(res)
            if on_done is not None:
                on_done(res)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - t0
