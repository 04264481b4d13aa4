"""The coordinator's KServe v2 door (`inference.GRPCInferenceService`, `coordinator/doors/kserve.py`), driven by the real,
unmodified `tritonclient.grpc` client with the tensors of Triton's vLLM backend. A real cluster of the tiny
random-weight model; every port is chosen at run time; every wait is bounded by a generous deadline."""
import json
import queue
import threading
import time
from pathlib import Path

import grpc

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from pdserve import Client, SamplingParams
from helpers import assert_idle

pytestmark = pytest.mark.e2e

WORKER_ARGS = ["--dtype", "float32", "--kv-tokens", "2048", "--max-model-len", "512", "--connector", "tcp"]
CALL_TIMEOUT_S = 120.0  # generous: a busy machine is slow, never wrong
PROMPT = "The capital of France is"
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, launch_module):
    return launch_module(tiny_model_dir, worker_args=WORKER_ARGS, coordinator_args=["--scheduling-policy", "priority"])


@pytest.fixture(scope="module")
def triton(cluster):
    client = grpcclient.InferenceServerClient(url=cluster.address)
    yield client
    client.close()


@pytest.fixture(scope="module")
def ours(cluster):
    """Our own API's greedy completion of PROMPT (12 tokens, EOS ignored)."""
    with Client(cluster.address) as c:
        out = c.complete(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert out.completion_tokens == 12 and out.text
    return out


def tensor(name: str, value, datatype: str) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, [1], datatype)
    t.set_data_from_numpy(np.array([value], dtype=object if datatype == "BYTES" else bool))
    return t


def inputs(prompt: str = PROMPT, stream: bool | None = None, sampling=GREEDY,
           exclude: bool | None = None) -> list[grpcclient.InferInput]:
    """Triton vLLM-backend tensors; sampling is a dict (sent as JSON), raw bytes, or None (left out)."""
    out = [tensor("text_input", prompt.encode(), "BYTES")]
    if stream is not None:
        out.append(tensor("stream", stream, "BOOL"))
    if sampling is not None:
        out.append(tensor("sampling_parameters",
                          sampling if isinstance(sampling, bytes) else json.dumps(sampling).encode(), "BYTES"))
    if exclude is not None:
        out.append(tensor("exclude_input_in_output", exclude, "BOOL"))
    return out


def text(result) -> str:
    return result.as_numpy("text_output")[0].decode()


def is_final(result) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


class Stream:
    """A tritonclient stream whose callback results land in a queue."""

    def __init__(self, client: grpcclient.InferenceServerClient):
        self.client, self.results = client, queue.Queue()
        client.start_stream(callback=lambda result, error: self.results.put((result, error)),
                            stream_timeout=CALL_TIMEOUT_S * 2)

    def next(self):
        return self.results.get(timeout=CALL_TIMEOUT_S)

    def until_final(self) -> list:
        """Results up to and including the one flagged triton_final_response (errors fail the test)."""
        out = []
        while True:
            result, error = self.next()
            assert error is None, error
            out.append(result)
            if is_final(result):
                return out


def test_health_and_metadata(cluster, triton):
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready("tiny") and triton.is_model_ready("tiny", "1")
    assert not triton.is_model_ready("nope") and not triton.is_model_ready("tiny", "2")
    meta = triton.get_model_metadata("tiny")
    assert meta.name == "tiny" and list(meta.versions) == ["1"]
    assert {(t.name, t.datatype) for t in meta.inputs} == {
        ("text_input", "BYTES"), ("stream", "BOOL"), ("sampling_parameters", "BYTES"),
        ("exclude_input_in_output", "BOOL")}
    assert [(t.name, t.datatype) for t in meta.outputs] == [("text_output", "BYTES")]
    config = triton.get_model_config("tiny").config
    assert config.model_transaction_policy.decoupled and config.max_batch_size == 0
    assert [i.name for i in config.input if not i.optional] == ["text_input"]
    assert triton.get_server_metadata().name == "pdserve"
    index = triton.get_model_repository_index().models
    assert [(m.name, m.version, m.state) for m in index] == [("tiny", "1", "READY")]


def test_unknown_model_is_not_found(cluster, triton):
    for call in (lambda: triton.infer("nope", inputs(), client_timeout=CALL_TIMEOUT_S),
                 lambda: triton.infer("tiny", inputs(), model_version="2", client_timeout=CALL_TIMEOUT_S),
                 lambda: triton.get_model_metadata("nope"), lambda: triton.get_model_config("nope")):
        with pytest.raises(InferenceServerException) as e:
            call()
        assert e.value.status() == "StatusCode.NOT_FOUND" and "unknown model" in e.value.message(), e.value


def test_infer_equals_our_greedy_text(cluster, triton, ours):
    whole = triton.infer("tiny", inputs(), request_id="k-1", client_timeout=CALL_TIMEOUT_S)
    assert text(whole) == PROMPT + ours.text  # the prompt comes first unless excluded, as Triton's vLLM backend
    assert whole.get_response().id == "k-1" and whole.get_response().model_version == "1"
    # Triton's priority 1 (the highest level) becomes our priority -9 (`kserve_sampling.to_priority`): same greedy text.
    completion = triton.infer("tiny", inputs(exclude=True, stream=False), model_version="1", priority=1,
                              client_timeout=CALL_TIMEOUT_S)
    assert text(completion) == ours.text
    # Values as JSON strings, as the backend converts them; and without the tensor, the request's own parameters.
    as_strings = triton.infer("tiny", inputs(exclude=True, sampling={k: str(v).lower() for k, v in GREEDY.items()}),
                              client_timeout=CALL_TIMEOUT_S)
    as_parameters = triton.infer("tiny", inputs(exclude=True, sampling=None), parameters=GREEDY,
                                 client_timeout=CALL_TIMEOUT_S)
    assert text(as_strings) == text(as_parameters) == ours.text
    assert_idle(cluster)


def test_stream_chunks_equal_our_greedy_text(cluster, triton, ours):
    stream = Stream(triton)
    try:
        triton.async_stream_infer("tiny", inputs(stream=True), request_id="s-1")
        results = stream.until_final()
        assert len(results) >= 3  # chunks, then the final flag
        assert "".join(text(r) for r in results) == ours.text  # streamed text never includes the prompt
        assert [is_final(r) for r in results] == [False] * (len(results) - 1) + [True]
        assert text(results[-1]) == "" and {r.get_response().id for r in results} == {"s-1"}
        # The same stream takes more requests: a non-streamed one answers once, flagged final.
        triton.async_stream_infer("tiny", inputs(stream=False))
        (once,) = stream.until_final()
        assert text(once) == PROMPT + ours.text
    finally:
        triton.stop_stream()
    assert_idle(cluster)


def test_stream_errors_leave_the_stream_open(cluster, triton, ours):
    stream = Stream(triton)
    try:
        triton.async_stream_infer("tiny", inputs(stream=True, sampling=b"{not json"))
        result, error = stream.next()
        assert result is None and "[StatusCode.INVALID_ARGUMENT]" in str(error)
        assert "sampling_parameters is not valid JSON" in str(error)
        triton.async_stream_infer("tiny", inputs(stream=True, exclude=False))
        result, error = stream.next()
        assert result is None and "exclude_input_in_output = false is not allowed" in str(error)
        triton.async_stream_infer("tiny", inputs(stream=True))
        assert "".join(text(r) for r in stream.until_final()) == ours.text
    finally:
        triton.stop_stream()
    assert_idle(cluster)


def test_cancelled_stream_frees_the_request(cluster, triton):
    stream = Stream(triton)
    try:
        triton.async_stream_infer("tiny", inputs(stream=True, sampling={"max_tokens": 400, "ignore_eos": True}))
        result, error = stream.next()
        assert error is None and not is_final(result)
    finally:
        triton.stop_stream(cancel_requests=True)
    assert_idle(cluster, timeout_s=60)


@pytest.mark.parametrize("kwargs, needle", [
    ({"sampling": b"{not json"}, "sampling_parameters is not valid JSON"),
    ({"sampling": [1, 2]}, "sampling_parameters must be a JSON object"),
    ({"sampling": {"max_tokens": 4, "best_of_n": 2}}, "unknown field 'best_of_n'"),
    ({"sampling": {"max_tokens": "many"}}, "sampling_parameters.max_tokens must be an integer"),
    ({"sampling": {"n": 2}}, "parallel sampling is not supported"),
    ({"sampling": {"max_tokens": 5000}}, "exceeds the context window"),
    ({"sampling": {"top_p": 1.5}}, "top_p"),
    ({"stream": True}, "stream = true needs ModelStreamInfer"),
    ({"prompt": ""}, "text_input is empty"),
])
def test_bad_requests_are_invalid_argument(cluster, triton, kwargs, needle):
    with pytest.raises(InferenceServerException) as e:
        triton.infer("tiny", inputs(**kwargs), client_timeout=CALL_TIMEOUT_S)
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and needle in e.value.message(), e.value


def test_bad_tensors_are_invalid_argument(cluster, triton):
    cases = [([tensor("prompt", b"hi", "BYTES")], "unexpected input 'prompt'"),
             ([tensor("text_input", True, "BOOL")], "expected BYTES"),
             ([tensor("stream", False, "BOOL")], "input 'text_input' (BYTES, shape [1]: the prompt) is required")]
    two = grpcclient.InferInput("text_input", [2], "BYTES")
    two.set_data_from_numpy(np.array([b"a", b"b"], dtype=object))
    cases.append(([two], "must be one element of shape [1]"))
    for tensors, needle in cases:
        with pytest.raises(InferenceServerException) as e:
            triton.infer("tiny", tensors, client_timeout=CALL_TIMEOUT_S)
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and needle in e.value.message(), e.value
    assert_idle(cluster)


DEEP_JSON = b"[" * 100_000 + b"]" * 100_000  # past Python's recursion limit: RecursionError before


def test_deep_json_is_invalid_argument_and_the_stream_goes_on(cluster, triton, ours):
    """Deep JSON was UNKNOWN (a Python class name) on ModelInfer, and on ModelStreamInfer it ended the whole call:
    the good requests beside it got nothing."""
    with pytest.raises(InferenceServerException) as e:
        triton.infer("tiny", inputs(sampling=DEEP_JSON), client_timeout=CALL_TIMEOUT_S)
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and "nests deeper than" in e.value.message()
    stream = Stream(triton)
    try:
        triton.async_stream_infer("tiny", inputs(stream=True), request_id="good-1")
        triton.async_stream_infer("tiny", inputs(stream=True, sampling=DEEP_JSON), request_id="deep")
        triton.async_stream_infer("tiny", inputs(stream=True), request_id="good-2")
        texts, errors, finals = {"good-1": "", "good-2": ""}, [], 0
        while finals < 2 or not errors:
            result, error = stream.next()
            if error is not None:
                errors.append(str(error))
                continue
            rid = result.get_response().id
            texts[rid] += text(result)
            finals += is_final(result)
        assert texts == {"good-1": ours.text, "good-2": ours.text}
        assert len(errors) == 1 and "[StatusCode.INVALID_ARGUMENT]" in errors[0] and "nests deeper" in errors[0]
    finally:
        triton.stop_stream()
    assert_idle(cluster)


def hostile_requests(address: str, codes: list, count: int = 6) -> None:
    """`count` KServe requests, alternately of 15 million empty BYTES elements (60 MB: one froze every door for ~21
    s) and of 250,000 in 1 MB; each one's status code lands in `codes`."""
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    sizes = [4 * 15_000_000, 4 * 250_000]
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)]) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for i in range(count):
            r = service_pb2.ModelInferRequest(model_name="tiny")
            r.inputs.add(name="text_input", datatype="BYTES", shape=[1])
            r.raw_input_contents.append(bytes(sizes[i % 2]))
            try:
                stub.ModelInfer(r, timeout=CALL_TIMEOUT_S)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())


def stream_gaps(cluster) -> list[float]:
    """Seconds from a 480-token greedy request's start to its first chunk, then between its chunks."""
    times = [time.monotonic()]
    with Client(cluster.address) as c:
        for _ in c.generate(PROMPT, SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True),
                            timeout=CALL_TIMEOUT_S * 2):
            times.append(time.monotonic())
    return [b - a for a, b in zip(times, times[1:])]


def test_hostile_kserve_requests_do_not_stall_a_bystander(cluster):
    """Oversized raw contents are refused by size (gRPC's message limit, sized from the context window, then
    Triton's byte-size rule) without walking their elements on the coordinator's event loop, so a bystander keeps
    its pace: its largest wait (first chunk or next chunk) while hostile requests arrive stays within a small
    multiple of its largest wait alone, measured just before on the same cluster (generous: a busy machine is
    slow, never wrong)."""
    baseline = max(stream_gaps(cluster) + stream_gaps(cluster))
    codes: list = []
    attacker = threading.Thread(target=hostile_requests, args=(cluster.address, codes), daemon=True)
    attacker.start()
    gaps, streams = [], 0
    while attacker.is_alive() and streams < 100:  # the bystander streams for as long as the attack lasts
        gaps += stream_gaps(cluster)
        streams += 1
    attacker.join(timeout=CALL_TIMEOUT_S)
    assert max(gaps) <= 4 * baseline + 1.0, (max(gaps), baseline, streams)
    assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT] * 3, codes


def test_long_token_id_prompts_are_refused_before_they_are_copied(cluster):
    """Token-id prompts on the vLLM-gRPC and our own door: a message past the size sized from the context window is
    RESOURCE_EXHAUSTED from gRPC (5 million ids held the event loop 0.7 s before); one within it is refused on its
    length, before its ids are copied."""
    from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

    from pdserve.v1 import generate_pb2, generate_pb2_grpc

    with grpc.insecure_channel(cluster.address, options=[("grpc.max_send_message_length", -1)]) as channel:
        vllm = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        ours = generate_pb2_grpc.GenerationStub(channel)
        for n, code in ((5_000_000, grpc.StatusCode.RESOURCE_EXHAUSTED), (100_000, grpc.StatusCode.INVALID_ARGUMENT)):
            ids = [7] * n
            calls = [lambda: list(vllm.Generate(vllm_engine_pb2.GenerateRequest(
                         request_id=f"long-{n}", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=ids)),
                         timeout=CALL_TIMEOUT_S)),
                     lambda: list(ours.Generate(generate_pb2.GenerateRequest(
                         request_id=f"long-{n}", token_ids=generate_pb2.TokenIds(ids=ids)), timeout=CALL_TIMEOUT_S))]
            for call in calls:
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == code, e.value
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    assert f"prompt has {n} tokens; the context window is 512" in e.value.details()
    assert_idle(cluster)


def test_health_reflection_and_a_light_coordinator(cluster, triton):
    """The standard health service and reflection know the service; serving it loaded no numerical library into
    the coordinator (tritonclient's client package, which imports numpy, is never imported there)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(cluster.address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="inference.GRPCInferenceService"), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert "inference.GRPCInferenceService" in set(ProtoReflectionDescriptorDatabase(channel).get_services())
    triton.infer("tiny", inputs(sampling={"max_tokens": 2}), client_timeout=CALL_TIMEOUT_S)
    maps = Path(f"/proc/{cluster.processes['coordinator'].pid}/maps").read_text()
    assert "numpy" not in maps and "rapidjson" not in maps and "triton" not in maps
