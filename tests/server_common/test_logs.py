"""Log lines an operator reads: a failed request's access line is a warning (a client's cancel is not), and a line
logged inside a traced request names its trace in text and JSON output."""
import json
import logging

import pytest

from pdserve_server.coordinator.record import RequestRecord, log_access


@pytest.mark.parametrize("error_code, level", [("", logging.INFO), ("CANCELLED", logging.INFO),
                                               ("UNAVAILABLE", logging.WARNING), ("INTERNAL", logging.WARNING)])
def test_a_failed_request_is_a_warning_in_the_access_log(caplog, error_code, level):
    caplog.set_level(logging.INFO, logger="pdserve.access")
    log_access(RequestRecord("r1", prompt_tokens=3, output_tokens=2, error_code=error_code),
               "boom" if error_code else "")
    (line,) = caplog.records
    assert line.levelno == level and line.access["error_code"] == error_code


def test_a_line_logged_inside_a_span_names_its_trace_in_text_and_json():
    from opentelemetry.sdk.trace import TracerProvider
    from pythonjsonlogger.json import JsonFormatter

    from pdserve_server.server_common.tracing import TraceContextFilter, TraceFormatter

    inside = logging.LogRecord("x", logging.WARNING, __file__, 1, "hello", None, None)
    outside = logging.LogRecord("x", logging.WARNING, __file__, 1, "hello", None, None)
    with TracerProvider().get_tracer("t").start_as_current_span("request") as span:
        TraceContextFilter().filter(inside)
    TraceContextFilter().filter(outside)
    trace_id = format(span.get_span_context().trace_id, "032x")
    assert TraceFormatter("%(message)s").format(inside) == f"hello [trace {trace_id}]"
    assert TraceFormatter("%(message)s").format(outside) == "hello"
    assert json.loads(JsonFormatter("%(message)s").format(inside))["trace_id"] == trace_id


def test_a_worker_says_what_it_resolved_at_start(tiny_model_dir):
    """`--dtype auto`, a threads count of 0 and the KV pool were logged nowhere: the start-up
    line says what they resolved to."""
    import os
    from types import SimpleNamespace

    from pdserve_server.engine.args import EngineArgs
    from pdserve_server.engine.builder import resolve_configs
    from pdserve_server.worker_common.config import WorkerConfig
    from pdserve_server.worker_common.worker import describe

    engine = EngineArgs(model_dir=str(tiny_model_dir), dtype="auto", kv_tokens=1024, quantization="int8")
    model, cache, sched = resolve_configs(engine)
    worker = SimpleNamespace(model_config=model, cache_config=cache, scheduler_config=sched)
    line = describe(WorkerConfig(role="decode", engine=engine), worker, {"kv_connector": "tcp", "kv_address": ""})
    threads = len(os.sched_getaffinity(0))
    assert f"{model.dtype} + int8 linears on cpu, {threads} threads" in line and model.dtype != "auto"
    # tiny: 2 layers x K,V x 2 kv heads x 16 dims, 64 blocks of 16 tokens
    itemsize = 2 if model.dtype == "bfloat16" else 4
    mib = 64 * 16 * 2 * 2 * 2 * 16 * itemsize / 2**20
    assert f"KV pool {cache.num_blocks} blocks x 16 tokens = 1024 tokens ({model.dtype}, {mib:.1f} MiB)" in line, line
    assert f"context {sched.max_model_len} tokens" in line and line.endswith(", kv_connector tcp")
    assert "512 tokens a step (a burst of arrivals up to 8192 in one)" in line, line  # the default: bursts on
    # a bf16 cache under fp32 weights: half the bytes, said so
    mib = 64 * 16 * 2 * 2 * 2 * 16 * 4 / 2**20
    engine = EngineArgs(model_dir=str(tiny_model_dir), dtype="float32", kv_cache_dtype="bfloat16", kv_tokens=1024,
                        burst_prefill_tokens=0)
    model, cache, sched = resolve_configs(engine)
    worker = SimpleNamespace(model_config=model, cache_config=cache, scheduler_config=sched)
    line = describe(WorkerConfig(role="decode", engine=engine), worker, {})
    assert "float32 on cpu" in line and f"1024 tokens (bfloat16, {mib / 2:.1f} MiB)" in line, line
    assert "512 tokens a step" in line and "burst" not in line, line
