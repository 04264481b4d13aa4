"""Sampling parameters have one definition: the public message, resolved by the coordinator, converted once by the
workers into the engine's dataclass; and engine failure kinds map to gRPC statuses in one table."""
import dataclasses

import grpc
import pytest

from pdserve_server.coordinator.errors import RequestError
from pdserve_server.coordinator.validation import MAX_STRUCTURED_CHARS, Limits, resolve_sampling
from pdserve_server.engine.errors import ErrorKind
from pdserve_server.engine.request import SamplingParams as EngineSampling
from pdserve_server.engine.request import StructuredOutput as EngineStructured
from pdserve import SamplingParams
from pdserve.v1.generate_pb2 import Choices, StructuredOutput
from pdserve_server.worker_common.convert import sampling_from_proto
from pdserve_server.worker_common.errors import STATUS_FOR_KIND

LIMITS = Limits(context_length=100, kv_capacity_tokens=80, vocab_size=1000)
COORDINATOR_ONLY = {"stop", "include_stop_str_in_output"}  # stop strings act on text, at the coordinator


def test_the_coordinator_and_the_engine_bound_logprobs_and_n_alike():
    from pdserve_server.coordinator import validation
    from pdserve_server.engine import request
    assert (validation.MAX_LOGPROBS, validation.MAX_SAMPLES) == (request.MAX_LOGPROBS, request.MAX_SAMPLES)


def test_engine_and_public_sampling_name_the_same_fields():
    public = {f.name for f in SamplingParams.DESCRIPTOR.fields}
    engine = {f.name for f in dataclasses.fields(EngineSampling)}
    assert engine == public - COORDINATOR_ONLY


def test_defaults_resolved_by_the_coordinator_are_the_engines():
    """An empty request resolves to the documented defaults, which are the engine dataclass's defaults;
    max_tokens defaults to the rest of the context that the KV cache can hold."""
    resolved = resolve_sampling(SamplingParams(), num_prompt_tokens=30, limits=LIMITS)
    assert sampling_from_proto(resolved) == EngineSampling(max_tokens=80 - 30)
    assert not resolved.HasField("seed") and not resolved.HasField("logprobs")


def test_every_field_reaches_the_engine():
    sent = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=42, repetition_penalty=1.3,
                          presence_penalty=0.5, frequency_penalty=-0.5, max_tokens=7, min_tokens=2,
                          stop=["x"], stop_token_ids=[3, 4], ignore_eos=True, logprobs=3,
                          include_stop_str_in_output=True, structured_output=StructuredOutput(regex="[a-z]+"), n=1)
    got = sampling_from_proto(resolve_sampling(sent, num_prompt_tokens=10, limits=LIMITS))
    for f in dataclasses.fields(EngineSampling):
        if f.name == "structured_output":
            assert got.structured_output == EngineStructured("regex", "[a-z]+")
            continue
        want = getattr(sent, f.name)
        want = tuple(want) if f.name == "stop_token_ids" else want
        assert getattr(got, f.name) == pytest.approx(want), f.name


@pytest.mark.parametrize("constraint,engine", [
    (StructuredOutput(json_schema='{"type": "object"}'), EngineStructured("json_schema", '{"type": "object"}')),
    (StructuredOutput(grammar='root ::= "a"'), EngineStructured("grammar", 'root ::= "a"')),
    (StructuredOutput(json_object=True), EngineStructured("json_object", "")),
    (StructuredOutput(choice=Choices(choices=["a", "b c"])), EngineStructured("choice", '["a", "b c"]')),
])
def test_each_structured_output_kind_reaches_the_engine(constraint, engine):
    resolved = resolve_sampling(SamplingParams(structured_output=constraint), num_prompt_tokens=10, limits=LIMITS)
    assert sampling_from_proto(resolved).structured_output == engine


@pytest.mark.parametrize("constraint,needle", [
    (StructuredOutput(), "empty"),
    (StructuredOutput(json_object=False), "json_object must be true"),
    (StructuredOutput(json_schema='{"type": '), "json_schema is not valid JSON"),
    (StructuredOutput(json_schema='[1]'), "must be a JSON object"),
    (StructuredOutput(regex=" "), "regex is empty"),
    (StructuredOutput(grammar="x" * (MAX_STRUCTURED_CHARS + 1)), "characters"),
    (StructuredOutput(choice=Choices()), "choice has 0 strings"),
    # Deep nesting: past Python's recursion limit (RecursionError, answered UNKNOWN before), and within it
    (StructuredOutput(json_schema="[" * 30_000 + "]" * 30_000), "nests deeper than 64"),
    (StructuredOutput(json_schema='{"a": ' * 100 + "1" + "}" * 100), "nests deeper than 64"),
])
def test_malformed_structured_output_is_invalid_argument(constraint, needle):
    with pytest.raises(RequestError) as e:
        resolve_sampling(SamplingParams(structured_output=constraint), num_prompt_tokens=10, limits=LIMITS)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.message, e.value.message


@pytest.mark.parametrize("params,code,needle", [
    (SamplingParams(temperature=-1), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (SamplingParams(max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (SamplingParams(max_tokens=75), grpc.StatusCode.INVALID_ARGUMENT, "context window"),
    (SamplingParams(max_tokens=60), grpc.StatusCode.RESOURCE_EXHAUSTED, "KV cache"),
    (SamplingParams(stop_token_ids=[5000]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    (SamplingParams(logprobs=21), grpc.StatusCode.INVALID_ARGUMENT, "logprobs"),
])
def test_bad_sampling_gets_a_status_naming_the_field(params, code, needle):
    with pytest.raises(RequestError) as e:
        resolve_sampling(params, num_prompt_tokens=30, limits=LIMITS)
    assert e.value.code == code and needle in e.value.message


def test_every_engine_error_kind_has_a_status():
    assert set(STATUS_FOR_KIND) == set(ErrorKind)
    assert all(isinstance(code, grpc.StatusCode) for code in STATUS_FOR_KIND.values())


def test_a_client_that_stops_reading_is_dropped():
    """A stream nobody reads would hold its batch slot and KV blocks; the coordinator gives up after
    stall_timeout_s (DEADLINE_EXCEEDED), which cancels the worker calls and frees everything."""
    import asyncio

    from pdserve_server.coordinator.doors import grpc_call

    class NeverReads:
        async def write(self, msg):
            await asyncio.sleep(3600)  # flow control holds the write: the client's window is full

    with pytest.raises(RequestError) as e:
        asyncio.run(grpc_call.write(NeverReads(), SamplingParams(), stall_timeout_s=0.2))
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and "read nothing" in e.value.message


@pytest.mark.parametrize("remaining_s, code", [(0.0, "DEADLINE_EXCEEDED"), (5.0, "CANCELLED")])
def test_a_send_to_a_client_that_went_is_recorded_as_its_deadline_or_cancel(remaining_s, code):
    """When the client's deadline or cancel races a send, gRPC fails the send (InternalError) instead of cancelling
    the handler: the request must still be recorded as what it was (access log, metrics), never as a success."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from pdserve_server.coordinator.config import CoordinatorConfig
    from pdserve_server.coordinator.membership import Cluster
    from pdserve_server.coordinator.metrics import CoordinatorMetrics
    from pdserve_server.coordinator.doors.generation import GenerationServicer
    from pdserve_server.coordinator.request_path import RequestPath
    from pdserve.v1 import generate_pb2

    class GoneClient:
        def invocation_metadata(self):
            return ()

        def peer(self):
            return "ipv4:127.0.0.1:5"

        def time_remaining(self):
            return remaining_s

        async def write(self, msg):
            raise grpc.aio.InternalError("Failed \"execute_batch\"")  # what grpc raises for a closed call

    registry = CollectorRegistry()
    path = RequestPath(CoordinatorConfig(model_dir="m", model_name="n"), Cluster(router=None, colocated=True),
                       tokenizer=None, metrics=CoordinatorMetrics(registry, "n"))
    servicer = GenerationServicer(path)
    records = []
    path._finished = lambda record, error: records.append((record, error))

    async def prepare(request):
        return [1, 2, 3], generate_pb2.SamplingParams(max_tokens=4)

    async def stream(flow, *args):
        yield generate_pb2.GenerateResponse(chunk=generate_pb2.Chunk(token_ids=[7], text="x"))

    servicer._prepare, path._stream = prepare, stream
    with pytest.raises(grpc.aio.InternalError):
        asyncio.run(servicer.Generate(generate_pb2.GenerateRequest(request_id="r"), GoneClient()))
    (record, error), = records
    assert record.error_code == code and record.prompt_tokens == 3 and error, (record, error)
    in_flight = registry.get_sample_value("pdserve:num_requests_in_flight", {"model_name": "n"})
    assert not servicer.cluster.flows and in_flight == 0  # nothing held


def test_stop_conditions_are_bounded():
    """10^6 stop strings were accepted and matched on the event loop every chunk (other streams froze ~10 s)."""
    from pdserve_server.coordinator.validation import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

    ok = SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS, stop_token_ids=[1] * MAX_STOP_TOKEN_IDS)
    resolve_sampling(ok, num_prompt_tokens=10, limits=LIMITS)
    for bad, what in ((SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1)), "at most 32 are allowed"),
                      (SamplingParams(stop=["x" * (MAX_STOP_STRING_CHARS + 1)]), "at most 256 each"),
                      (SamplingParams(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)), "at most 256 are allowed")):
        with pytest.raises(RequestError) as e:
            resolve_sampling(bad, num_prompt_tokens=10, limits=LIMITS)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and what in e.value.message
