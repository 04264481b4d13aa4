"""A worker's Prometheus metrics: the engine's load and cache gauges (read from the scheduler's stats object at
scrape time) and the KV path's own, as SGLang's and vLLM's NIXL connector export them."""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve_server.engine.core.async_engine import Engine
from pdserve_server.server_common.metrics import BYTE_BUCKETS, LATENCY_BUCKETS

LABELS = ["model_name", "role"]


class EngineStatsCollector(Collector):
    """Gauges and counters from `EngineCore.stats` (a `SchedulerStats` the engine thread replaces every
    iteration): nothing here reads the scheduler itself."""

    def __init__(self, engine: Engine, labels: list[str]):
        self.engine, self.labels = engine, labels

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        for family, name, doc, value in (
                (gauge, "num_requests_running", "Requests in the running batch.", s.num_running),
                (gauge, "num_requests_waiting", "Requests queued for scheduling or a KV reservation.", s.num_waiting),
                (gauge, "num_requests_paused", "Requests held out of the batch: their reader fell behind.",
                 s.num_paused),
                (gauge, "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", s.kv_cache_usage),
                (gauge, "num_kv_blocks_free", "Free KV blocks (prefix-cached ones included).", s.num_free_blocks),
                (counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 s.prefix_cache_query_tokens),
                (counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hit_tokens),
                (counter, "num_preemptions", "Requests preempted (KV freed, recomputed later).", s.num_preemptions),
                (counter, "engine_steps", "Engine steps run.", s.num_steps),
                (counter, "spec_decode_num_draft_tokens", "Speculative (n-gram) draft tokens verified.",
                 s.spec_draft_tokens),
                (counter, "spec_decode_num_accepted_tokens", "Speculative (n-gram) draft tokens accepted.",
                 s.spec_accepted_tokens)):
            metric = family(f"pdserve:{name}", doc, labels=LABELS)
            metric.add_metric(self.labels, value)
            yield metric
        yield from self._tiers(s.kv_offload)

    def _tiers(self, tiers) -> Iterator[Metric]:
        """The KV offload tiers' counters, one series per tier (`engine.offload`); none without tiers."""
        if not tiers:
            return
        for name, doc, field in (
                ("kv_offload_hit_blocks", "KV blocks loaded back from an offload tier instead of recomputed.", "hits"),
                ("kv_offload_loaded_bytes", "Bytes loaded from an offload tier into the KV cache.", "loaded_bytes"),
                ("kv_offload_stored_bytes", "Bytes of evicted KV blocks written to an offload tier.", "stored_bytes"),
                ("kv_offload_load_seconds", "Time spent loading blocks from an offload tier.", "load_seconds"),
                ("kv_offload_evicted_blocks", "Blocks an offload tier deleted to stay within its size.", "evictions"),
                ("kv_offload_corrupt_blocks", "Offload tier entries found truncated or corrupt (recomputed).",
                 "corrupt"),
                ("kv_offload_dropped_blocks", "Evicted blocks not stored: the tier's writer was behind.", "dropped"),
                ("kv_offload_declined_blocks", "Blocks a tier held but recomputed: loading measured slower.",
                 "declined"),
                ("kv_offload_prefetched_blocks", "Of the hit blocks, those read ahead while their request was "
                 "queued (the engine only copied them).", "prefetched")):
            metric = CounterMetricFamily(f"pdserve:{name}", doc, labels=[*LABELS, "tier"])
            for tier in tiers:
                metric.add_metric([*self.labels, tier.tier], getattr(tier, field))
            yield metric


class WorkerMetrics:
    """Registers the engine collector and the KV path's metrics on a worker's registry.

    Args:
        registry: the process's registry.
        engine: whose stats the gauges report.
        model_name, role: label values ("prefill", "decode" or "colocated").
    """

    def __init__(self, registry: CollectorRegistry, engine: Engine, model_name: str, role: str):
        labels = [model_name, role]
        registry.register(EngineStatsCollector(engine, labels))
        mode = [*LABELS, "mode"]  # "blocks" (sent whole after the first token) or "layers" (layer-wise streaming)
        self._transfer_time = Histogram(
            "pdserve:kv_transfer_time_seconds", "One request's KV send: from the first token to the decode worker's "
            "acknowledgement (with layer-wise streaming, the part that did not overlap the prefill).", mode,
            buckets=LATENCY_BUCKETS, registry=registry)
        self._transfer_bytes = Histogram("pdserve:kv_transfer_bytes", "Bytes of one request's KV send.", mode,
                                         buckets=BYTE_BUCKETS, registry=registry)
        self.staged_bytes = Counter("pdserve:kv_transfer_staged_bytes",
                                    "KV bytes copied between device and host memory to send them (0: in place).",
                                    LABELS, registry=registry).labels(*labels)
        self._failures = Counter("pdserve:kv_transfer_failures", "KV transfers that failed, by kind (either side).",
                                 [*LABELS, "kind"], registry=registry)
        self.reservations_expired = Counter(
            "pdserve:kv_reservations_expired", "Decode reservations freed because no KV came within the lease.",
            LABELS, registry=registry).labels(*labels)
        self.token_stream_messages = Counter(
            "pdserve:token_stream_messages", "Messages sent on token streams (StreamTokens: a message per engine step "
            "carrying the tokens of every request a coordinator has here).", LABELS, registry=registry).labels(*labels)
        self.token_stream_parts = Counter(
            "pdserve:token_stream_request_parts", "Requests' parts of the token stream messages (over "
            "pdserve:token_stream_messages: the requests a message carries).", LABELS,
            registry=registry).labels(*labels)
        self.labels = labels

    def token_stream_sent(self, parts: int) -> None:
        """A token stream message with `parts` requests' tokens was sent."""
        self.token_stream_messages.inc()
        self.token_stream_parts.inc(parts)

    def transfer_done(self, layerwise: bool, seconds: float, num_bytes: int, staged_bytes: int) -> None:
        """Record one finished KV send: seconds after the first token (see the histogram's help), bytes sent, and
        bytes staged through host memory."""
        mode = "layers" if layerwise else "blocks"
        self._transfer_time.labels(*self.labels, mode).observe(seconds)
        self._transfer_bytes.labels(*self.labels, mode).observe(num_bytes)
        self.staged_bytes.inc(staged_bytes)

    def transfer_failed(self, kind: str) -> None:
        """Count a failed transfer by its ErrorKind value (e.g. "transfer_failed", "kv_timeout")."""
        self._failures.labels(*self.labels, kind).inc()
