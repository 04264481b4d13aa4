"""The coordinator's request metrics, as the client sees them (vLLM's names with the pdserve: prefix)."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve_server.coordinator.record import RequestRecord
from pdserve_server.server_common.metrics import LATENCY_BUCKETS, TOKEN_COUNT_BUCKETS, TOKEN_LATENCY_BUCKETS

# The relay is a fraction of a GPU's 5-50 ms inter-token latency: fine steps to 10 ms (the control plane's 2 ms
# objective is a bucket edge), coarse beyond (an overloaded coordinator).
RELAY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25,
                 0.5, 1.0, 2.5)


class CoordinatorMetrics:
    """Histograms and counters of finished requests, labelled by model_name as vLLM's are.

    Args:
        registry: the process's registry (served by `server_common.metrics.start_metrics_server`).
        model_name: the served model's name (the label value).
    """

    def __init__(self, registry: CollectorRegistry, model_name: str):
        label = ["model_name"]

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"pdserve:{name}", doc, label, buckets=buckets, registry=registry).labels(model_name)

        def count(name: str, doc: str, labels=()) -> Counter:
            return Counter(f"pdserve:{name}", doc, [*label, *labels], registry=registry)

        self.model_name = model_name
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token sent, seconds.", LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Between consecutive output tokens, seconds.",
                        TOKEN_LATENCY_BUCKETS)
        self.relay = hist("token_relay_latency_seconds", "Decode worker's send of a token message to the coordinator's "
                          "hand-off of its chunk to the client's stream, seconds: what the coordinator adds to "
                          "the tokens' latency (one clock on one host; across hosts their skew adds in).",
                          RELAY_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds", "(e2e - TTFT) / (output tokens - 1) per request.",
                         TOKEN_LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to final message, seconds.", LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to prefill start (prefill worker), seconds.",
                          LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "Prefill compute to first token, seconds.",
                            LATENCY_BUCKETS)
        self.transfer = hist("request_kv_transfer_time_seconds",
                             "KV transfer prefill -> decode after the first token, seconds.", LATENCY_BUCKETS)
        self.prompt_len = hist("request_prompt_tokens", "Prompt tokens per request.", TOKEN_COUNT_BUCKETS)
        self.output_len = hist("request_generation_tokens", "Output tokens per request.", TOKEN_COUNT_BUCKETS)
        self.prompt_tokens = count("prompt_tokens", "Prompt tokens of finished requests.").labels(model_name)
        self.generation_tokens = count("generation_tokens", "Output tokens of finished requests.").labels(model_name)
        self.cached_tokens = count("prompt_tokens_cached", "Prompt tokens served from a prefix cache.").labels(
            model_name)
        self.success = count("request_success", "Finished requests by finish reason.", ["finished_reason"])
        self.failure = count("request_failure", "Requests ended by an error status, by gRPC code.", ["code"])
        self.migrations = count("request_migrations", "Requests resumed on other workers after a worker was lost.")
        self.local_prefills = count("request_local_prefills", "Disaggregated requests prefilled on their decode "
                                    "worker, by reason: short (uncached prompt), queue (sooner than the prefill "
                                    "queue) or no_prefill_worker (none live).",
                                    ["reason"])
        self.in_flight = Gauge("pdserve:num_requests_in_flight", "Requests admitted and not yet finished.", label,
                               registry=registry).labels(model_name)
        self._workers_live = Gauge("pdserve:num_workers_live", "Workers in the routing set, by role (decode holds "
                                   "colocated workers).", [*label, "role"], registry=registry)

    def track_workers(self, live: Callable[[str], list]) -> None:
        """Report live(role) ("prefill", "decode") as pdserve:num_workers_live at every scrape."""
        for role in ("prefill", "decode"):
            self._workers_live.labels(self.model_name, role).set_function(lambda role=role: len(live(role)))

    def observe(self, r: RequestRecord) -> None:
        """Record one finished (or failed) request."""
        if r.migrations:
            self.migrations.labels(self.model_name).inc(r.migrations)
        if r.error_code:
            self.failure.labels(self.model_name, r.error_code).inc()
            return
        self.success.labels(self.model_name, r.finish_reason).inc()
        self.prompt_tokens.inc(r.prompt_tokens)
        self.generation_tokens.inc(r.output_tokens)
        self.cached_tokens.inc(r.cached_tokens)
        self.prompt_len.observe(r.prompt_tokens)
        self.output_len.observe(r.output_tokens)
        self.e2e.observe(r.e2e_s)
        if r.output_tokens:
            self.ttft.observe(r.ttft_s)
            self.queue.observe(r.queue_s)
            self.prefill.observe(r.prefill_s)
            if r.transfer_s:
                self.transfer.observe(r.transfer_s)
        for gap in r.token_gaps:
            self.itl.observe(gap)
        for relay in r.relays:
            self.relay.observe(relay)
        if r.output_tokens > 1:
            self.tpot.observe((r.e2e_s - r.ttft_s) / (r.output_tokens - 1))
