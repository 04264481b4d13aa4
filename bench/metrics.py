"""Per-level serving metrics from client-side timestamps, as vLLM's `benchmark_serving` defines them.

- TTFT: first token chunk - request sent.
- ITL: gaps between consecutive token chunks of one request (all gaps of all requests pooled).
- TPOT: (e2e - TTFT) / (output_tokens - 1), per request with > 1 output token.
- E2E: stream closed - request sent.
- Throughput: output tokens / level wall time; requests/s likewise.
- Goodput (DistServe, Zhong et al. 2024): completed requests/s whose TTFT <= SLO and TPOT <= SLO.
All times in ms in the output.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backends import RequestResult


@dataclass(frozen=True)
class Slo:
    """Service-level objectives for goodput, ms."""

    ttft_ms: float
    tpot_ms: float


def _pcts(values: list[float], prefix: str) -> dict[str, float]:
    arr = np.asarray(values, dtype=float) if values else np.asarray([np.nan])
    return {f"{prefix}_mean": float(np.mean(arr)),
            **{f"{prefix}_p{q}": float(np.percentile(arr, q)) for q in (50, 90, 99)}}


def summarize(results: list[RequestResult], duration_s: float, slo: Slo) -> dict[str, float]:
    """Aggregate one concurrency level's results; failed requests count in `failed` and nowhere else."""
    ok = [r for r in results if r.ok]
    ttft = [(r.chunk_times[0] - r.start) * 1e3 for r in ok]
    e2e = [(r.end - r.start) * 1e3 for r in ok]
    itl = [(b - a) * 1e3 for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tpot_by_req = [(r.end - r.chunk_times[0]) * 1e3 / (r.output_tokens - 1)
                   if r.output_tokens > 1 else 0.0 for r in ok]
    good = sum(1 for t, p in zip(ttft, tpot_by_req) if t <= slo.ttft_ms and p <= slo.tpot_ms)
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration_s,
        "output_tokens": out_tokens, "output_tok_s": out_tokens / duration_s, "req_s": len(ok) / duration_s,
        "goodput_req_s": good / duration_s, "slo_attained": good / len(results) if results else 0.0,
        **_pcts(ttft, "ttft_ms"), **_pcts(itl, "itl_ms"),
        **_pcts([t for r, t in zip(ok, tpot_by_req) if r.output_tokens > 1], "tpot_ms"), **_pcts(e2e, "e2e_ms"),
    }
