"""The KServe v2 inference protocol (`inference.GRPCInferenceService`) on the coordinator's port, with the tensors of
Triton's vLLM backend, so `tritonclient.grpc` (and other KServe v2 / Triton clients) work against pdserve unmodified.

Protocol: the gRPC form of the KServe v2 ("Open Inference") protocol as Triton serves it (Triton's
docs/protocol/README.md and the KServe v2 predict-protocol spec); its generated stubs are tritonclient's
(`tritonclient.grpc.service_pb2`, `service_pb2_grpc`, `model_config_pb2`), imported, never copied. One model exists:
config.model_name, version "1" ("" picks it); any other name or version is NOT_FOUND, as on Triton.

The model's tensors are those of Triton's vLLM backend (triton-inference-server/vllm_backend, src/utils/request.py):
  - text_input (BYTES, shape [1]): the prompt, tokenized by the coordinator's tokenizer as pdserve.v1's `text`.
  - stream (BOOL, [1], optional, default false): stream text deltas; only over ModelStreamInfer.
  - sampling_parameters (BYTES, [1], optional): a JSON object of vLLM SamplingParams fields (read by
    `coordinator.doors.kserve_sampling`, whose `SAMPLING_FIELDS` lists them);
    values may be JSON strings ("0.5"), as the backend converts them; null means the default. Unset max_tokens is
    vLLM's default, 16. Without the tensor, the request's own parameters are read the same way (reserved ones, such
    as priority, see Scheduling below, or sequence_id, left out), as the backend does. Structured outputs:
    `structured_outputs` (or `guided_decoding`) as an object of vLLM's StructuredOutputsParams fields (json,
    regex, grammar, choice, json_object), or vLLM's `guided_json` / `guided_regex` / `guided_grammar` /
    `guided_choice` keys; one at most.
  - exclude_input_in_output (BOOL, [1], optional): without streaming the text is the prompt + the completion unless
    this is true; streamed text never includes the prompt, and stream with this explicitly false is refused.
  - text_output (BYTES, shape [1]): the only output.

Scheduling: Triton's request parameter `priority` (an unsigned integer, tritonclient's `infer(priority=...)`;
1 is the highest level, 0 means the model's default level) is mapped as follows, then granted as every door's
priority is (`scheduling.grant_priority`: refused unless 0 under the default `--scheduling-policy fcfs`, bounded by
the tenant's floor under `priority`). This model's default level is
`kserve_sampling.DEFAULT_PRIORITY_LEVEL` (10), as if its config said `default_priority_level: 10`, and a level
p >= 1 becomes our priority p - 10 (pdserve.v1's GenerateRequest.priority: lower runs sooner, 0 is the default):
levels 1-9 run sooner than requests that give none, 10 as soon, 11 and above later; 0 or no parameter is our 0. A
negative, fractional or non-numeric priority is INVALID_ARGUMENT. The tenant is the caller (API key, else peer);
there is no TTFT objective parameter (the call's gRPC deadline still applies: `timeout` / client_timeout).

Sizes are checked before contents are read, so no request's parsing grows with its size: the port takes messages
up to the size the context window needs (`CoordinatorConfig.max_request_bytes`; larger ones are RESOURCE_EXHAUSTED
from gRPC), each input's shape must be [1] and a raw content exactly one element's bytes (Triton's rule), raw and
typed contents together are refused, and sampling_parameters is at most MAX_SAMPLING_JSON_BYTES of JSON nesting at
most `validation.MAX_JSON_DEPTH` levels; each is INVALID_ARGUMENT naming the input.

ModelInfer answers once with the whole text. ModelStreamInfer takes any number of requests on one call and runs them
concurrently; with stream=true each request gets one response per text delta, then a last response with empty text,
each carrying the `triton_final_response` parameter (true on the last only), as Triton's decoupled models answer;
with stream=false one response with the whole text, flagged final. A failed request in a stream gets a response
with `error_message` (led by its status's name, e.g. "[StatusCode.INVALID_ARGUMENT] ...", since a stream response
has no status code) and the stream goes on; a unary call ends with the status itself.

Every inference goes through the coordinator's one request path (`coordinator.request_path`: admission, routing,
disaggregated prefill and decode, migration, stop strings, error statuses, access log).
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import logging
import struct
import sys
import types
import uuid
from importlib import metadata

import grpc

from pdserve_server.coordinator.doors import grpc_call
from pdserve_server.coordinator.doors.kserve_sampling import to_priority, to_sampling
from pdserve_server.coordinator.errors import RequestError, invalid
from pdserve_server.coordinator.request_path import RequestPath
from pdserve_server.coordinator.scheduling import SchedulingAsk
from pdserve_server.coordinator.validation import (MAX_STRUCTURED_CHARS, check_prompt, check_text_length, parse_json,
                                                   resolve_sampling, shorten)
from pdserve.v1 import generate_pb2
from pdserve_server.server_common.errors import CommandError
from pdserve_server.server_common.grpc_server import unimplemented_quietly

log = logging.getLogger(__name__)


def _import_protos() -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    """tritonclient's generated KServe modules (model_config_pb2, service_pb2, service_pb2_grpc), imported without
    running `tritonclient/grpc/__init__.py`, which loads the whole client, numpy among it (the coordinator process
    stays free of numerical libraries). A stand-in package object serves the import and is removed after it; a
    later `import tritonclient.grpc` runs the real package and finds these modules already imported.

    Raises:
        CommandError: tritonclient is not installed or its modules do not load (protobuf or grpcio too old for its
            generated code), with what to install.
    """
    package, names = "tritonclient.grpc", ("model_config_pb2", "service_pb2", "service_pb2_grpc")
    try:
        if package in sys.modules:  # the client is loaded already (a test process): the same modules
            return tuple(importlib.import_module(f"{package}.{n}") for n in names)
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(f"no package {package}")
        stand_in = types.ModuleType(package)
        stand_in.__path__ = list(spec.submodule_search_locations)
        sys.modules[package] = stand_in
        try:
            return tuple(importlib.import_module(f"{package}.{n}") for n in names)
        finally:
            if sys.modules.get(package) is stand_in:
                del sys.modules[package]
    except Exception as e:  # ImportError, protobuf's VersionError, the RuntimeError of a grpcio older than the stubs
        raise CommandError(
            f"the KServe v2 service (inference.GRPCInferenceService) needs the protos of the tritonclient package, "
            f"which did not load ({type(e).__name__}: {e}); install it with `pip install tritonclient` (no extras: "
            "tritonclient[grpc] pins protobuf<7, which pdserve's stubs cannot use), or run scripts/install.sh") from e


model_config_pb2, pb, pb_grpc = _import_protos()

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name  # "inference.GRPCInferenceService"
MODEL_VERSION = "1"
# Input name -> (KServe datatype, required), with Triton's vLLM backend's names and types; every one has shape [1].
INPUTS = {"text_input": ("BYTES", True), "stream": ("BOOL", False), "sampling_parameters": ("BYTES", False),
          "exclude_input_in_output": ("BOOL", False)}
OUTPUT = "text_output"
FINAL = "triton_final_response"
# Request parameters that belong to the protocol or to tritonclient, never sampling fields.
# sampling_parameters' JSON: room for the largest structured-output constraint (validation.MAX_STRUCTURED_CHARS),
# escaped, beside the other fields; larger text is refused before it is parsed.
MAX_SAMPLING_JSON_BYTES = 4 * MAX_STRUCTURED_CHARS
RESERVED_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "headers",
                       "binary_data_output")


def _parameter_value(p):
    """An InferParameter's value (bool, int, float or str)."""
    kind = p.WhichOneof("parameter_choice")
    return getattr(p, kind) if kind else None


def _one_element(tensor, raw: bytes | None, datatype: str) -> bytes | bool:
    """The single element of a shape [1] tensor, from raw_input_contents when it came that way (BYTES: a 4-byte
    little-endian length, then the bytes; BOOL: one byte), else from its typed contents. Triton's rule: the raw
    content's size must be exactly what the datatype and shape give; it is checked before anything is decoded, so
    a request's cost here does not grow with its size.

    Raises:
        RequestError: INVALID_ARGUMENT naming the tensor, for raw contents of the wrong size, raw and typed contents
            together, or typed contents that are not one element.
    """
    typed = tensor.contents.bytes_contents if datatype == "BYTES" else tensor.contents.bool_contents
    if raw is None:
        if len(typed) != 1:
            raise invalid(f"input {tensor.name!r} must be one element of shape [1]; got {len(typed)} element(s)")
        return typed[0]
    if tensor.HasField("contents"):
        raise invalid(f"input {tensor.name!r} has both raw_input_contents and typed contents; send one of them")
    if datatype == "BOOL":
        if len(raw) != 1:
            raise invalid(f"input {tensor.name!r}: raw BOOL content of shape [1] must be 1 byte, got {len(raw)}")
        return raw[0] != 0
    if len(raw) < 4:
        raise invalid(f"input {tensor.name!r}: raw BYTES content of {len(raw)} bytes ends inside the element's "
                      "4-byte length")
    (n,) = struct.unpack_from("<I", raw)
    if 4 + n != len(raw):
        raise invalid(f"input {tensor.name!r}: raw BYTES content of shape [1] must be 4 + {n} bytes (one "
                      f"length-prefixed element), got {len(raw)}")
    return raw[4:]


def read_inputs(request) -> dict[str, bytes | bool]:
    """The request's inputs by name, each the single element of its shape [1] tensor. Names, datatypes and shapes
    are checked before any content is read.

    Raises:
        RequestError: INVALID_ARGUMENT naming the tensor: unknown, repeated, of another datatype or shape, contents
            that are not one element of that shape, raw contents that do not match the inputs, or text_input
            missing.
    """
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise invalid(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; "
                      "send one per input, in order, or none")
    if len(request.inputs) > len(INPUTS):
        raise invalid(f"{len(request.inputs)} inputs; this model takes at most {len(INPUTS)}: {', '.join(INPUTS)}")
    out: dict[str, bytes | bool] = {}
    for i, t in enumerate(request.inputs):
        if t.name not in INPUTS:
            raise invalid(f"unexpected input {shorten(t.name)}; this model takes {', '.join(INPUTS)}")
        if t.name in out:
            raise invalid(f"input {t.name!r} is given twice")
        datatype = INPUTS[t.name][0]
        if t.datatype != datatype:
            raise invalid(f"input {t.name!r} has datatype {shorten(t.datatype)}; expected {datatype}")
        if list(t.shape) != [1]:
            shape = list(t.shape[:8]) + (["..."] if len(t.shape) > 8 else [])
            raise invalid(f"input {t.name!r} must be one element of shape [1]; got shape {shape}")
        out[t.name] = _one_element(t, raw[i] if raw else None, datatype)
    if "text_input" not in out:
        raise invalid("input 'text_input' (BYTES, shape [1]: the prompt) is required")
    return out


class _Request:
    """One inference request as the request path takes it (`request_path.DoorRequest`): its reading, and its
    answers (the text so far, the KServe responses).

    Args:
        write: sends one ModelInferResponse of a ModelStreamInfer call; None for ModelInfer, whose one answer is
            made from the gathered text once the request ended.
    """

    operation = "text_completion"

    def __init__(self, servicer: KServeServicer, request, write=None):
        self.servicer, self.request, self.write = servicer, request, write
        self.streaming_call = write is not None
        self.request_id = request.id or uuid.uuid4().hex
        self.stream = self.prepend = False
        self.prompt_text = ""
        self.priority = 0
        self.parts: list[str] = []

    async def prepare(self) -> tuple[list[int], generate_pb2.SamplingParams]:
        """(prompt token ids, resolved sampling) for the request path.

        Raises:
            RequestError: NOT_FOUND for another model or version; INVALID_ARGUMENT for bad tensors, JSON, fields,
                or the prompt (empty, too long); RESOURCE_EXHAUSTED when it can never fit the KV cache.
        """
        s, r = self.servicer, self.request
        s.check_model(r.model_name, r.model_version)
        self.priority = to_priority(r.parameters)
        for o in r.outputs:
            if o.name != OUTPUT:
                raise invalid(f"unknown output {shorten(o.name)}; this model's only output is {OUTPUT!r}")
        inputs = read_inputs(r)
        self.stream = bool(inputs.get("stream", False))
        if self.stream and not self.streaming_call:
            raise invalid("stream = true needs ModelStreamInfer (tritonclient: start_stream, then "
                          "async_stream_infer); ModelInfer answers once: send stream = false or leave it out")
        exclude = inputs.get("exclude_input_in_output")
        if self.stream and exclude is False:
            raise invalid("when streaming, exclude_input_in_output = false is not allowed (streamed text never "
                          "includes the prompt)")
        self.prepend = not self.stream and not exclude
        try:
            self.prompt_text = inputs["text_input"].decode()
        except UnicodeDecodeError as e:
            raise invalid(f"text_input is not valid UTF-8 ({e})") from None
        if not self.prompt_text:
            raise invalid("text_input is empty: the prompt must be non-empty")
        sampling = to_sampling(self._sampling_fields(inputs.get("sampling_parameters")))
        limits = s.cluster.limits
        check_text_length(len(self.prompt_text), s.tokenizer.max_chars_per_token, limits)
        prompt = await asyncio.to_thread(s.tokenizer.encode, self.prompt_text)
        check_prompt(prompt, limits)
        return prompt, resolve_sampling(sampling, len(prompt), limits)

    def scheduling(self) -> SchedulingAsk:
        """The request's priority (read by `prepare`), for the request path."""
        return SchedulingAsk(priority=self.priority)

    async def send(self, msg: generate_pb2.GenerateResponse) -> None:
        if (out := self.convert(msg)) is not None and self.write is not None:
            await self.write(out)

    def _sampling_fields(self, text: bytes | None) -> dict:
        """sampling_parameters' JSON object, or without it the request's parameters less the reserved ones.
        Raises RequestError INVALID_ARGUMENT for text that is no JSON object."""
        if text is None:
            return {k: _parameter_value(v) for k, v in self.request.parameters.items()
                    if k not in RESERVED_PARAMETERS and not k.startswith("triton_")}
        if len(text) > MAX_SAMPLING_JSON_BYTES:  # before parsing: the parse runs on the event loop
            raise invalid(f"sampling_parameters has {len(text)} bytes; at most {MAX_SAMPLING_JSON_BYTES} are allowed")
        fields = parse_json(text, "sampling_parameters")
        if not isinstance(fields, dict):
            raise invalid(f"sampling_parameters must be a JSON object, got {shorten(text.decode(errors='replace'))}")
        return fields

    def response(self, text: str, final: bool | None) -> pb.ModelInferResponse:
        """A ModelInferResponse carrying `text` as text_output; `final` sets triton_final_response (streams)."""
        r = pb.ModelInferResponse(model_name=self.servicer.config.model_name, model_version=MODEL_VERSION,
                                  id=self.request.id)
        r.outputs.add(name=OUTPUT, datatype="BYTES", shape=[1])
        data = text.encode()
        r.raw_output_contents.append(struct.pack("<I", len(data)) + data)
        if final is not None:
            r.parameters[FINAL].bool_param = final
        return r

    def whole_text(self) -> str:
        return (self.prompt_text if self.prepend else "") + "".join(self.parts)

    def convert(self, msg: generate_pb2.GenerateResponse) -> pb.ModelInferResponse | None:
        """The stream response for one of our messages (None: nothing to send yet). Without streaming, text is
        gathered until the final message, which becomes the one response."""
        if msg.WhichOneof("response") == "chunk":
            if self.stream:
                return self.response(msg.chunk.text, False) if msg.chunk.text else None
            self.parts.append(msg.chunk.text)
            return None
        return self.response("" if self.stream else self.whole_text(), True)


@unimplemented_quietly("pdserve's coordinator")
class KServeServicer(pb_grpc.GRPCInferenceServiceServicer):
    """`inference.GRPCInferenceService` over the coordinator's request path (see the module docstring). RPCs not
    defined here (statistics, model load/unload, shared memory, trace and log settings) answer UNIMPLEMENTED.

    Args:
        path: the coordinator's request path (shared by every door).
    """

    def __init__(self, path: RequestPath):
        self.path = path
        self.config, self.cluster, self.tokenizer = path.config, path.cluster, path.tokenizer

    def check_model(self, name: str, version: str) -> None:
        """Raises RequestError NOT_FOUND unless name is the served model and version "1" or ""."""
        if name != self.config.model_name:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"Request for unknown model: {shorten(name)} is not "
                                                          f"found; this server serves {self.config.model_name!r}")
        if version not in ("", MODEL_VERSION):
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"Request for unknown model: {name!r} version "
                                                          f"{shorten(version)} is not found; its only version is "
                                                          f"{MODEL_VERSION!r}")

    async def _known_model(self, request, context) -> None:
        try:
            self.check_model(request.name, request.version)
        except RequestError as e:
            await context.abort(e.code, e.client_message)

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        """Ready while requests can be served (`Cluster.ready`), as the health service's readiness."""
        return pb.ServerReadyResponse(ready=self.cluster.ready)

    async def ModelReady(self, request, context):
        """The served model is ready with the server; another name or version is not (false, no error: Triton's)."""
        known = request.name == self.config.model_name and request.version in ("", MODEL_VERSION)
        return pb.ModelReadyResponse(ready=known and self.cluster.ready)

    async def ServerMetadata(self, request, context):
        try:
            version = metadata.version("pdserve")
        except metadata.PackageNotFoundError:
            version = ""
        return pb.ServerMetadataResponse(name="pdserve", version=version)

    async def ModelMetadata(self, request, context):
        """The model's tensors (`INPUTS`, `OUTPUT`). Raises NOT_FOUND for another model or version."""
        await self._known_model(request, context)
        return pb.ModelMetadataResponse(
            name=self.config.model_name, versions=[MODEL_VERSION], platform="vllm",
            inputs=[pb.ModelMetadataResponse.TensorMetadata(name=n, datatype=d, shape=[1])
                    for n, (d, _) in INPUTS.items()],
            outputs=[pb.ModelMetadataResponse.TensorMetadata(name=OUTPUT, datatype="BYTES", shape=[-1])])

    async def ModelConfig(self, request, context):
        """The model's configuration as Triton's vLLM backend completes it (decoupled, no batching dimension).
        Raises NOT_FOUND for another model or version."""
        await self._known_model(request, context)
        dtype = {"BYTES": model_config_pb2.TYPE_STRING, "BOOL": model_config_pb2.TYPE_BOOL}
        return pb.ModelConfigResponse(config=model_config_pb2.ModelConfig(
            name=self.config.model_name, backend="vllm", max_batch_size=0,
            input=[model_config_pb2.ModelInput(name=n, data_type=dtype[d], dims=[1], optional=not required)
                   for n, (d, required) in INPUTS.items()],
            output=[model_config_pb2.ModelOutput(name=OUTPUT, data_type=model_config_pb2.TYPE_STRING, dims=[-1])],
            model_transaction_policy=model_config_pb2.ModelTransactionPolicy(decoupled=True)))

    async def RepositoryIndex(self, request, context):
        """The one model, READY or UNAVAILABLE (with why); request.ready lists it only when ready."""
        ready = self.cluster.ready
        if request.ready and not ready:
            return pb.RepositoryIndexResponse()
        reason = "" if ready else f"no live {' or '.join(self.cluster.missing_roles()) or 'worker'} worker"
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(
            name=self.config.model_name, version=MODEL_VERSION, state="READY" if ready else "UNAVAILABLE",
            reason=reason)])

    async def ModelInfer(self, request, context):
        """One request, answered once with the whole text (stream = true is refused: use ModelStreamInfer).
        Errors end the call with the request path's statuses: NOT_FOUND, INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
        ALREADY_EXISTS (an id in flight), UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED."""
        req = _Request(self, request)
        await grpc_call.run(self.path, context, req)
        return req.response(req.whole_text(), None)

    async def ModelStreamInfer(self, request_iterator, context):
        """Every request of the call, concurrently, each answered as the module docstring says; the call ends
        when the client has closed its side and every request has finished. Writes are serialized, and a client
        that takes none for stall_timeout_s fails the request writing (its KV freed)."""
        lock = asyncio.Lock()

        async def write(response: pb.ModelStreamInferResponse) -> None:
            async with lock:
                await grpc_call.write(context, response, self.config.stall_timeout_s)

        async with asyncio.TaskGroup() as tasks:
            async for request in request_iterator:
                tasks.create_task(self._stream_one(request, context, write))

    async def _stream_one(self, request, context, write) -> None:
        """One request of a ModelStreamInfer call: a RequestError becomes its own failed response (the call and the
        requests beside it go on)."""
        async def write_response(out: pb.ModelInferResponse) -> None:
            await write(pb.ModelStreamInferResponse(infer_response=out))

        try:
            await self.path.run(grpc_call.call_of(context, self.path.keys_required),
                                _Request(self, request, write_response))
        except RequestError as e:
            await self._tell_failed(request, write, e.code, e.client_message)
        except grpc.aio.InternalError:
            pass  # a write raced the call's end: the client is gone (the path has recorded it)
        except Exception:  # a bug in this door: this request fails alone, the stream and its neighbours go on
            log.exception("ModelStreamInfer request %r: internal error", request.id)
            await self._tell_failed(request, write, grpc.StatusCode.INTERNAL,
                                    "internal error; the coordinator's log has it under this request id")

    @staticmethod
    async def _tell_failed(request, write, code: grpc.StatusCode, message: str) -> None:
        """One request of a stream failed: its own response with `error_message` (led by the status's name, as a
        stream response has no status code); the stream goes on."""
        failed = pb.ModelInferResponse(model_name=request.model_name, model_version=request.model_version,
                                       id=request.id)
        with contextlib.suppress(RequestError, grpc.aio.InternalError):  # the client is gone or stalled
            await write(pb.ModelStreamInferResponse(error_message=f"[{code}] {message}", infer_response=failed))


def add_to_server(servicer: KServeServicer, server: grpc.aio.Server) -> None:
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
