"""See inside it: one trace across coordinator, prefill, KV transfer and decode (an in-process OTLP/gRPC collector
receives the spans), Prometheus counts that match what was sent, and a JSON access log line per request."""
import json
import os
import time
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from helpers import scrape_when, total
from pdserve import Client, SamplingParams

pytestmark = pytest.mark.e2e
WORKER = ["--dtype", "float32", "--kv-tokens", "1024", "--max-model-len", "256", "--connector", "tcp"]
TRACE_ID, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: keeps (service.name, span) pairs."""

    def __init__(self):
        self.spans = []

    def Export(self, request, context):
        for rs in request.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
            for ss in rs.scope_spans:
                self.spans += [(service, span) for span in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def collector():
    c = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(c, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    c.env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
             "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    yield c
    server.stop(0)


def attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = (v.string_value or v.int_value or v.double_value or v.bool_value
                      or [x.string_value for x in v.array_value.values])
    return out


def traced_request(cluster, collector, expect: set[str]) -> dict:
    """One greedy request with a client traceparent; returns {span name: (service, span)} of its trace."""
    with Client(cluster.address) as c:
        out = c.complete([5, 6, 7, 8, 9], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                         metadata=[("traceparent", f"00-{TRACE_ID}-{CLIENT_SPAN}-01")])
    assert out.completion_tokens == 4
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        mine = {s.name: (svc, s) for svc, s in collector.spans if s.trace_id.hex() == TRACE_ID}
        if expect <= set(mine):
            return mine
        time.sleep(0.2)
    pytest.fail(f"spans {sorted(expect - set(mine))} never arrived; got {sorted(mine)}")


GENERATE = "/pdserve.v1.Generation/Generate"
PREFILL, DECODE = "/pdserve.v1.Prefill/Prefill", "/pdserve.v1.Decode/Decode"


def abandon_streams(cluster, count: int, concurrency: int = 16) -> None:
    """`count` streams that the client drops after a few chunks (the worker streams are cancelled mid-write)."""
    def one(i: int) -> None:
        with Client(cluster.address) as c:
            for n, _ in enumerate(c.generate("hello there " * (i % 5 + 1),
                                             SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))):
                if n >= 3:
                    break
    with futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(count)))


def test_one_trace_across_every_hop(tiny_model_dir, tmp_path, collector, launch):
    cluster = launch(tiny_model_dir, worker_args=WORKER, env=collector.env, log_dir=str(tmp_path))
    spans = traced_request(cluster, collector, {GENERATE, "route decode", "route prefill", PREFILL, DECODE,
                                                 "queue", "prefill", "kv transfer", "kv receive", "wait for kv",
                                                 "decode"})
    # Cancelled streams end their server spans in their own task: the instrumentation's stream wrapper left
    # the generator to be closed from another one, which logged "Failed to detach context" with a traceback
    # (6 times in 80 abandoned streams before `tracing._written`).
    abandon_streams(cluster, 64)
    cluster.stop()  # every log complete
    for name in ("coordinator", "prefill-0", "decode-0"):
        assert "Failed to detach context" not in (tmp_path / f"{name}.log").read_text(), name

    def by(name):
        return spans[name][1]

    services = {name: svc for name, (svc, _) in spans.items()}
    assert services[GENERATE] == "pdserve-coordinator" and services["kv transfer"] == "pdserve-prefill"
    assert services["kv receive"] == "pdserve-decode" and services["decode"] == "pdserve-decode"
    generate = by(GENERATE)
    assert generate.parent_span_id.hex() == CLIENT_SPAN  # continues the client's traceparent
    # The coordinator's client spans for the worker calls are under its server span; each worker's server span
    # is under the client span that called it (two spans per worker call: client, server).
    client_calls = {s.name: s for svc, s in collector.spans
                    if s.trace_id.hex() == TRACE_ID and svc == "pdserve-coordinator" and s.kind == s.SPAN_KIND_CLIENT}
    for method in (PREFILL, DECODE):
        assert client_calls[method].parent_span_id == generate.span_id
        server = next(s for svc, s in collector.spans if s.trace_id.hex() == TRACE_ID and s.name == method
                      and s.kind == s.SPAN_KIND_SERVER)
        assert server.parent_span_id == client_calls[method].span_id
    prefill_server = next(s for _, s in collector.spans if s.name == PREFILL and s.kind == s.SPAN_KIND_SERVER)
    decode_server = next(s for _, s in collector.spans if s.name == DECODE and s.kind == s.SPAN_KIND_SERVER)
    for name in ("queue", "prefill", "kv transfer"):
        assert by(name).parent_span_id == prefill_server.span_id, name
    for name in ("wait for kv", "decode"):
        assert by(name).parent_span_id == decode_server.span_id, name
    assert by("kv receive").parent_span_id == by("kv transfer").span_id  # context carried in the KV offer
    assert attrs(by("kv transfer"))["pdserve.kv.bytes"] > 0
    a = attrs(generate)
    assert a["gen_ai.request.max_tokens"] == 4 and a["gen_ai.usage.input_tokens"] == 5
    assert a["gen_ai.usage.output_tokens"] == 4 and a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.request.model"] == "tiny" and a["pdserve.decode_worker"]
    assert not any(s.name.startswith("/grpc.health") for _, s in collector.spans)  # probes are not traced
    # The access log line of the request names its trace (log <-> trace, both ways).
    log = (tmp_path / "coordinator.log").read_text()
    assert any("pdserve.access" in line and line.endswith(f"[trace {TRACE_ID}]") for line in log.splitlines())


def test_colocated_trace_has_no_transfer(tiny_model_dir, collector, launch):
    cluster = launch(tiny_model_dir, colocated=True, worker_args=WORKER, env=collector.env)
    spans = traced_request(cluster, collector, {GENERATE, DECODE, "decode"})
    assert "kv transfer" not in spans and "kv receive" not in spans and PREFILL not in spans
    assert spans["decode"][0] == "pdserve-colocated"


def test_metrics_count_what_was_sent_and_access_log_is_json(tiny_model_dir, launch):
    cluster = launch(tiny_model_dir, worker_args=[*WORKER, "--max-model-len", "512", "--metrics-port", "0"],
                     coordinator_args=["--metrics-port", "0", "--log-format", "json"])
    assert set(cluster.metrics_urls) == {"coordinator", "prefill-0", "decode-0"}
    outs = []
    with Client(cluster.address) as c:
        for i in range(5):
            outs.append(c.complete([5 + i] * (8 + i), SamplingParams(max_tokens=3 + i, temperature=0,
                                                                     ignore_eos=True)))
    # A finished request's histograms are observed one after another while the metrics thread may scrape: wait on
    # the last one observed (TPOT, coordinator/metrics.py::observe), not on e2e, or TTFT can lag by one (seen on CI).
    coordinator = scrape_when(cluster.metrics_urls["coordinator"],
                              "pdserve:request_time_per_output_token_seconds_count", len(outs))
    prefill = scrape_when(cluster.metrics_urls["prefill-0"], "pdserve:kv_transfer_time_seconds_count", len(outs))
    decode = scrape_when(cluster.metrics_urls["decode-0"], "pdserve:num_requests_running", 0)
    with Client(cluster.address) as c, pytest.raises(grpc.RpcError) as late:  # after the scrapes: not counted
        # 0.25 s: past the reservation and the prefill of 12 tokens (the access log must name both workers),
        # before 490 tokens are decoded. 240 tokens within 0.4 s was too few on a fast VM: it finished first
        c.complete([9] * 12, SamplingParams(max_tokens=490, temperature=0, ignore_eos=True), request_id="late",
                   timeout=0.25)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    n = len(outs)
    assert total(coordinator, "pdserve:time_to_first_token_seconds_count") == n
    assert total(coordinator, "pdserve:e2e_request_latency_seconds_count") == n
    assert total(coordinator, "pdserve:request_success_total", finished_reason="length") == n
    assert total(coordinator, "pdserve:prompt_tokens_total") == sum(o.prompt_tokens for o in outs)
    assert total(coordinator, "pdserve:generation_tokens_total") == sum(o.completion_tokens for o in outs)
    assert total(coordinator, "pdserve:inter_token_latency_seconds_count") == sum(o.completion_tokens - 1 for o in outs)
    assert total(coordinator, "pdserve:request_time_per_output_token_seconds_count") == n
    # one relay per message from the decode worker (the prefill worker's first token carries no send time), each a
    # wall-clock difference on one clock: more than 0, and seconds at most (mixed clocks give 0 or ~1.7e9 s)
    relays = total(coordinator, "pdserve:token_relay_latency_seconds_count")
    assert 1 <= relays <= sum(o.completion_tokens - 1 for o in outs)
    assert 0 < total(coordinator, "pdserve:token_relay_latency_seconds_sum") < 10 * relays
    assert total(coordinator, "pdserve:num_requests_in_flight") == 0
    assert total(coordinator, "pdserve:num_workers_live", role="prefill") == 1
    assert total(coordinator, "pdserve:num_workers_live", role="decode") == 1
    assert total(prefill, "pdserve:kv_transfer_time_seconds_count", model_name="tiny") == n  # the served name
    assert total(prefill, "pdserve:kv_transfer_bytes_sum") > 0
    assert total(prefill, "pdserve:prefix_cache_queries_total") == sum(o.prompt_tokens for o in outs)
    assert total(decode, "pdserve:num_requests_running") == 0
    assert total(decode, "pdserve:kv_cache_usage_perc", role="decode") == 0.0  # everything freed
    assert total(decode, "pdserve:engine_steps_total") >= sum(o.completion_tokens - 1 for o in outs) / n
    ttft_labels = next(labels for (name, labels) in coordinator if name == "pdserve:time_to_first_token_seconds_count")
    assert ("model_name", "tiny") in ttft_labels  # vLLM's label, so dashboards filter the same way

    cluster.stop()  # the log complete
    lines = [json.loads(line) for line in open(cluster.log_files["coordinator"]) if line.startswith("{")]
    access = [line["access"] for line in lines if line.get("name") == "pdserve.access"]
    late = next(a for a in access if a["request_id"] == "late")  # a failed request still says where it was
    assert late["error_code"] == "DEADLINE_EXCEEDED" and "deadline" in late["error"].lower(), late
    assert late["prompt_tokens"] == 12 and late["decode_worker"] and late["prefill_worker"], late
    access.remove(late)
    assert len(access) == n and {a["request_id"] for a in access} == {o.request_id for o in outs}
    assert all(a["error_code"] == "" and a["finish_reason"] == "length" and a["decode_worker"] for a in access)
    first = next(a for a in access if a["request_id"] == outs[0].request_id)
    assert first["prompt_tokens"] == outs[0].prompt_tokens and first["output_tokens"] == outs[0].completion_tokens
