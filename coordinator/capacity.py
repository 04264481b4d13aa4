"""How many prefill and decode workers the traffic this coordinator sees needs, as metrics an autoscaler acts on
(`--planner-profile`): the planner (`engine.mock.planner.minimal_split`, DistServe's placement over the profiled
step times of the workers' device and model) fed the requests finished in the last `--planner-window-s` seconds,
re-planned every quarter window.

Prometheus gauges (labelled by model_name, as every coordinator metric):

- `pdserve:planner_recommended_workers{role="prefill"|"decode"}`: the cheapest split that meets
  `--planner-ttft-ms` and `--planner-itl-ms` at the observed rate, each decode worker's batch within the smallest
  live decode worker's KV pool; -1 while no split of at most
  `--planner-max-workers` does; 0 before the window holds `MIN_REQUESTS` finished requests.
- `pdserve:planner_arrival_rate`: the observed rate the split is for, requests/s.

A KEDA Prometheus scaler (or an HPA on an external metric) per role scales the workers' Deployments to them
(docs/deploy.md). The model predicts means: set the objectives below the SLOs you must keep.
"""
from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge

from pdserve_server.coordinator.record import RequestRecord

log = logging.getLogger(__name__)

MIN_REQUESTS = 5  # finished requests in the window before a plan is made (a rate from fewer is noise)


class TrafficWindow:
    """The successful requests finished in the last `window_s` seconds: (finish time, prompt, output and cached
    prompt tokens), oldest first. Event loop only."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.started = time.monotonic()
        self._done: deque[tuple[float, int, int, int]] = deque()

    def add(self, record: RequestRecord, now: float | None = None) -> None:
        if record.error_code or not record.output_tokens:
            return
        self._done.append((time.monotonic() if now is None else now, record.prompt_tokens, record.output_tokens,
                           record.cached_tokens))

    def traffic(self, now: float | None = None):
        """The window's traffic (`engine.mock.planner.Traffic`: rate over the window, or over the time since start
        while that is shorter; mean prompt and output tokens; the prefix-cache share; the 99th-percentile context),
        or None with fewer than MIN_REQUESTS."""
        from pdserve_server.engine.mock.planner import Traffic

        now = time.monotonic() if now is None else now
        while self._done and self._done[0][0] < now - self.window_s:
            self._done.popleft()
        if len(self._done) < MIN_REQUESTS:
            return None
        span = min(self.window_s, max(now - self.started, 1e-3))
        prompts = [d[1] for d in self._done]
        contexts = sorted(d[1] + d[2] for d in self._done)
        return Traffic(rate=len(self._done) / span, prompt_tokens=statistics.fmean(prompts),
                       output_tokens=statistics.fmean(d[2] for d in self._done),
                       prefix_hit=sum(d[3] for d in self._done) / max(sum(prompts), 1),
                       max_context=contexts[min(len(contexts) - 1, int(0.99 * len(contexts)))])


class CapacityPlanner:
    """The window, the plan and its gauges (module docstring).

    Args:
        profile: a step-time profile of the workers' device and model (`engine.mock.step_model.load_profile`: a
            shipped name or a file).
        ttft_ms / itl_ms: the objectives, ms. max_workers: the most workers a plan may use.
        window_s: seconds of finished requests the plan is for. registry / model_name: where the gauges go.
        pool_tokens: the smallest live decode worker's KV pool, tokens (None while none is known): a decode batch
            the pool cannot hold does not count as meeting the objectives (`planner.kv_batch_limit`).

    Raises:
        ValueError: an unknown profile (its message lists the shipped ones).
    """

    def __init__(self, profile: str, ttft_ms: float, itl_ms: float, max_workers: int, window_s: float,
                 registry: CollectorRegistry, model_name: str,
                 pool_tokens: Callable[[], int | None] = lambda: None):
        from pdserve_server.engine.mock.planner import Objectives
        from pdserve_server.engine.mock.step_model import load_profile

        self.model = load_profile(profile)
        self.objectives = Objectives(ttft_ms, itl_ms)
        self.max_workers = max_workers
        self.pool_tokens = pool_tokens
        self.window = TrafficWindow(window_s)
        workers = Gauge("pdserve:planner_recommended_workers", "Workers the planner finds the observed traffic "
                        "needs, by role (-1: no split of at most --planner-max-workers meets the objectives; 0: too "
                        "few requests yet).", ["model_name", "role"], registry=registry)
        self._prefill, self._decode = workers.labels(model_name, "prefill"), workers.labels(model_name, "decode")
        self._rate = Gauge("pdserve:planner_arrival_rate", "Requests/s finished over the planner's window.",
                           ["model_name"], registry=registry).labels(model_name)

    def observe(self, record: RequestRecord) -> None:
        """One finished request (`RequestPath`)."""
        self.window.add(record)

    def _split(self, traffic, pool_tokens: int | None) -> tuple[int, int]:
        """The plan for `traffic` (None: too few requests) with decode pools of `pool_tokens`, as the gauges show
        it."""
        from pdserve_server.engine.mock.planner import kv_batch_limit, minimal_split

        if traffic is None:
            return 0, 0
        max_batch = kv_batch_limit(pool_tokens, traffic) if pool_tokens else 256
        split = minimal_split(self.model, self.model, traffic, self.objectives, self.max_workers,
                              max_batch=max_batch)
        return (split.prefill, split.decode) if split is not None else (-1, -1)

    def _show(self, counts: tuple[int, int], traffic) -> None:
        self._prefill.set(counts[0])
        self._decode.set(counts[1])
        self._rate.set(traffic.rate if traffic is not None else 0.0)

    def plan(self, now: float | None = None) -> tuple[int, int]:
        """Re-plan from the window and set the gauges; returns (prefill, decode) as the gauges show them."""
        traffic = self.window.traffic(now)
        counts = self._split(traffic, self.pool_tokens())
        self._show(counts, traffic)
        return counts

    async def run(self) -> None:
        """Re-plan every quarter window until cancelled: the window read on the event loop (which appends to it),
        the search on a thread."""
        while True:
            await asyncio.sleep(self.window.window_s / 4)
            try:
                traffic = self.window.traffic()
                self._show(await asyncio.to_thread(self._split, traffic, self.pool_tokens()), traffic)
            except Exception:  # noqa: BLE001 - a planning fault must not end the coordinator: logged, retried
                log.exception("capacity planner: re-planning failed")
