"""How many prefill and decode workers a traffic needs to meet its latency objectives, from the same step-time model
the mock engine runs on (`engine.mock.step_model`): DistServe's placement search (Zhong et al., OSDI 2024) over
P:D splits, with each phase's latency from the profile and a queueing model, as NVIDIA Dynamo's SLA planner sizes
prefill and decode pools from profiled throughput at a latency target.

Per split (P prefill workers, D decode workers), at an arrival rate of r requests/s:

- prefill: a request's service S is its prompt's chunked prefill (budget-sized chunks, each a mixed step of the
  model, prefix-cache hits not computed); each prefill worker is an M/D/1 queue at utilisation rho = r / P * S, so
  TTFT = S + rho / (2 (1 - rho)) * S (the Pollaczek-Khinchine mean wait for deterministic service);
- decode: by Little's law a decode worker holds n = r / D * O * t(n) requests (O output tokens each, t(n) the
  decode step at batch n, the batch's mean context and its longest), solved by fixed-point iteration; ITL = t(n).

A split meets the objectives when rho < 1, TTFT <= the TTFT objective, n fits the batch (the engine's
max_num_seqs, and the decode worker's KV pool: `kv_batch_limit`) and ITL <= the ITL objective. Its goodput is
the highest rate at which it still does (bisection). Plain functions on plain data.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve_server.engine.mock.step_model import StepShape, StepTimeModel


@dataclass(frozen=True)
class Traffic:
    """A workload. rate: requests/s. prompt_tokens / output_tokens: means, tokens. prefix_hit: the share of prompt
    tokens the workers' prefix caches serve (not computed). max_context: the longest context a decode batch
    holds, tokens (a high percentile of prompt + output: a decode step waits on its longest sequence); None = the
    mean prompt and output."""

    rate: float
    prompt_tokens: float
    output_tokens: float
    prefix_hit: float = 0.0
    max_context: float | None = None


@dataclass(frozen=True)
class Objectives:
    """Latency targets, ms: time to first token and inter-token latency (means, as the model predicts means)."""

    ttft_ms: float
    itl_ms: float


@dataclass(frozen=True)
class SplitEstimate:
    """One P:D split at one rate. ttft_ms / itl_ms: predicted (inf where a phase cannot keep up); batch: requests
    per decode worker; prefill_utilisation: per prefill worker; meets: both objectives hold."""

    prefill: int
    decode: int
    rate: float
    ttft_ms: float
    itl_ms: float
    batch: float
    prefill_utilisation: float
    meets: bool


def prefill_service_ms(model: StepTimeModel, prompt_tokens: float, prefix_hit: float, budget: int) -> float:
    """A prompt's prefill alone on a worker: its computed tokens in chunks of `budget`, each chunk a step, ms."""
    left, done, ms = int(round(prompt_tokens * (1 - prefix_hit))), int(round(prompt_tokens * prefix_hit)), 0.0
    while left > 0:
        q = min(budget, left)
        ms += model.predict_ms(StepShape.of_step([(q, done)], []))
        left, done = left - q, done + q
    return ms


def kv_batch_limit(kv_tokens: int, traffic: Traffic, max_num_seqs: int = 256) -> int:
    """The most requests a decode worker's KV pool of `kv_tokens` holds at once for this traffic: each holds its
    prompt and, on average, half its output (the `max_batch` to plan with). A batch the pool cannot hold does not
    run at the predicted step time: requests wait for blocks or are preempted and recomputed, which stalls their
    TPOT (bench/planner_check.py's chat trace: one decode worker was planned a mean batch of ~72 requests, ~69k
    tokens, in a 65,536-token pool)."""
    per_request = traffic.prompt_tokens + traffic.output_tokens / 2
    return max(1, min(max_num_seqs, int(kv_tokens // max(per_request, 1.0))))


def decode_batch(model: StepTimeModel, per_worker_rate: float, traffic: Traffic, max_batch: int,
                 iterations: int = 200) -> tuple[float, float]:
    """(requests in flight on one decode worker, its step ms) by Little's law; (inf, inf) when the batch would
    exceed `max_batch` (the worker cannot keep up)."""
    context = int(traffic.prompt_tokens + traffic.output_tokens / 2)
    longest = int(traffic.max_context or traffic.prompt_tokens + traffic.output_tokens)
    n = 1.0
    for _ in range(iterations):
        b = max(1, int(round(n)))
        step = model.predict_ms(StepShape.of_step([], [context] * (b - 1) + [max(context, longest)]))
        nxt = per_worker_rate * traffic.output_tokens * step / 1e3
        if nxt > max_batch:
            return float("inf"), float("inf")
        if abs(nxt - n) < 0.01:
            return nxt, step
        n = nxt
    return n, step


def estimate(prefill_model: StepTimeModel, decode_model: StepTimeModel, traffic: Traffic, objectives: Objectives,
             prefill: int, decode: int, budget: int = 4096, max_batch: int = 256) -> SplitEstimate:
    """The split's predicted latencies at `traffic.rate` (module docstring)."""
    service = prefill_service_ms(prefill_model, traffic.prompt_tokens, traffic.prefix_hit, budget)
    rho = traffic.rate / prefill * service / 1e3
    ttft = service + rho / (2 * (1 - rho)) * service if rho < 1 else float("inf")
    batch, itl = decode_batch(decode_model, traffic.rate / decode, traffic, max_batch)
    return SplitEstimate(prefill, decode, traffic.rate, ttft, itl, batch, rho,
                         ttft <= objectives.ttft_ms and itl <= objectives.itl_ms)


def goodput(prefill_model: StepTimeModel, decode_model: StepTimeModel, traffic: Traffic, objectives: Objectives,
            prefill: int, decode: int, budget: int = 4096, max_batch: int = 256, ceiling: float = 1e5) -> float:
    """The highest arrival rate (requests/s, up to `ceiling`) at which the split meets the objectives; 0 if none."""
    def ok(rate: float) -> bool:
        t = replace(traffic, rate=rate)
        return estimate(prefill_model, decode_model, t, objectives, prefill, decode, budget, max_batch).meets
    lo, hi = 0.0, ceiling
    if not ok(1e-6):
        return 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def split_goodputs(prefill_model: StepTimeModel, decode_model: StepTimeModel, traffic: Traffic,
                   objectives: Objectives, workers: int, budget: int = 4096,
                   max_batch: int = 256) -> list[tuple[int, int, float]]:
    """Every split of exactly `workers` workers with its goodput: (P, D, requests/s), P = 1 .. workers - 1.

    Raises:
        ValueError: workers < 2.
    """
    if workers < 2:
        raise ValueError("a disaggregated split needs at least 2 workers")
    return [(p, workers - p, goodput(prefill_model, decode_model, traffic, objectives, p, workers - p, budget,
                                     max_batch)) for p in range(1, workers)]


def recommend(prefill_model: StepTimeModel, decode_model: StepTimeModel, traffic: Traffic,
              objectives: Objectives, max_workers: int, budget: int = 4096,
              max_batch: int = 256) -> tuple[SplitEstimate | None, list[tuple[int, int, float]]]:
    """The cheapest split (fewest workers; then the most goodput) that meets the objectives at `traffic.rate`,
    with at most `max_workers` workers; and every split's goodput, (P, D, requests/s), for the record. None when
    no split of that size meets them.

    Raises:
        ValueError: max_workers < 2.
    """
    if max_workers < 2:
        raise ValueError("a disaggregated split needs at least 2 workers")
    table = [row for total in range(2, max_workers + 1)
             for row in split_goodputs(prefill_model, decode_model, traffic, objectives, total, budget, max_batch)]
    feasible = [(p + d, -g, p, d) for p, d, g in table if g >= traffic.rate]
    if not feasible:
        return None, table
    _, _, p, d = min(feasible)
    return estimate(prefill_model, decode_model, traffic, objectives, p, d, budget, max_batch), table


def minimal_split(prefill_model: StepTimeModel, decode_model: StepTimeModel, traffic: Traffic,
                  objectives: Objectives, max_workers: int, budget: int = 4096,
                  max_batch: int = 256) -> SplitEstimate | None:
    """The cheapest split that meets the objectives at `traffic.rate`, with at most `max_workers` workers, or None.

    In this model the phases are independent (TTFT depends on P alone, ITL on D alone), so the cheapest split is
    the fewest prefill workers whose TTFT holds with the fewest decode workers whose ITL holds: O(max_workers)
    estimates, not `recommend`'s sweep of every split's goodput (what a running coordinator can afford every few
    seconds, `coordinator.capacity`). Same choice as `recommend`'s (the split of that size is unique).

    Raises:
        ValueError: max_workers < 2.
    """
    if max_workers < 2:
        raise ValueError("a disaggregated split needs at least 2 workers")
    prefill = next((p for p in range(1, max_workers) if estimate(prefill_model, decode_model, traffic, objectives, p,
                                                                 1, budget, max_batch).ttft_ms <= objectives.ttft_ms),
                   None)
    decode = next((d for d in range(1, max_workers) if estimate(prefill_model, decode_model, traffic, objectives, 1,
                                                                d, budget, max_batch).itl_ms <= objectives.itl_ms),
                  None)
    if prefill is None or decode is None or prefill + decode > max_workers:
        return None
    return estimate(prefill_model, decode_model, traffic, objectives, prefill, decode, budget, max_batch)


def best_split(prefill_model: StepTimeModel, decode_model: StepTimeModel, traffic: Traffic, objectives: Objectives,
               workers: int, budget: int = 4096, max_batch: int = 256) -> tuple[int, int, float]:
    """Of the splits of exactly `workers` workers, the one with the most goodput: (P, D, requests/s).

    Raises:
        ValueError: workers < 2.
    """
    return max(split_goodputs(prefill_model, decode_model, traffic, objectives, workers, budget, max_batch),
               key=lambda s: s[2])
