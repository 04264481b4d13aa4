"""vLLM's gRPC engine service (`vllm.grpc.engine.VllmEngine`) on the coordinator's port, for the smg gateway.

The protocol is smg-grpc-proto's `vllm_engine.proto` (its generated stubs are imported, never copied). The gateway
tokenizes, applies the chat template, cuts stop strings and detokenizes itself, and sends prompt token ids; this
door maps its requests onto the coordinator's one request path (`coordinator.request_path`: admission, routing,
migration, stop handling, error statuses), so a request behaves the same through either door. What the
path cannot do yet is refused with INVALID_ARGUMENT (the gateway answers HTTP 400), never silently ignored:
structural tags, logit_bias, prompt logprobs, multimodal input, external KV transfer parameters. `n` > 1 runs as
our parallel sampling (the prompt's KV shared by the samples): chunks and completes carry each sample's `index`.
Structured outputs (json_schema, regex, grammar, json_object, choice) map onto `SamplingParams.structured_output`; a
constraint the workers cannot compile is INVALID_ARGUMENT too. `grammar_from_first_token` needs nothing: our
constraint always starts at the first generated token (no reasoning parser holds it back).

Generate streams `GenerateStreamChunk`s (token id deltas, as vLLM does) then one `GenerateComplete` when the request
asked to stream, else one `GenerateComplete` with every token. Abort cancels the named requests (their KV is freed
on the workers). HealthCheck follows the cluster's readiness; GetLoads reports the workers' polled stats.
"""
from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import time
import uuid
import zipfile
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2 as pb, vllm_engine_pb2_grpc as pb_grpc

from pdserve_server.coordinator.doors import grpc_call
from pdserve_server.coordinator.errors import RequestError, invalid
from pdserve_server.coordinator.request_path import RequestPath
from pdserve_server.coordinator.scheduling import SchedulingAsk
from pdserve_server.coordinator.validation import check_prompt, check_prompt_length, check_text_length, resolve_sampling
from pdserve.v1 import generate_pb2
from pdserve_server.server_common.grpc_server import unimplemented_quietly

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name  # "vllm.grpc.engine.VllmEngine"
FINISH_REASON = {generate_pb2.FINISH_REASON_STOP: "stop", generate_pb2.FINISH_REASON_LENGTH: "length",
                 generate_pb2.FINISH_REASON_ABORT: "abort"}
INT32_MAX = 2**31 - 1  # the proto's uint32 fields land in our int32 ones
TOKENIZER_CHUNK_BYTES = 64 << 10
# What a remote gateway needs to build the tokenizer and chat template (GetTokenizer's zip).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.json")


def to_sampling(p: pb.SamplingParams) -> generate_pb2.SamplingParams:
    """vLLM's sampling parameters as our public SamplingParams, unresolved (unset stays unset, so the server's
    defaults apply as on our own API). The proto's non-optional fields read 0 when the gateway left them out: 0
    top_p and repetition_penalty mean their defaults (as vLLM's own servicer reads them), 0 top_k means off.
    Detokenization options (skip_special_tokens, ...) are the gateway's business and ignored here.

    Raises:
        RequestError: INVALID_ARGUMENT for what this server cannot do yet (structural tags, logit_bias, prompt
            logprobs).
    """
    constraint = p.WhichOneof("constraint")
    if constraint == "structural_tag":
        raise invalid("sampling_params.structural_tag is not supported; use json_schema, regex, grammar, "
                      "json_object or choice")
    if p.logit_bias:
        raise invalid("sampling_params.logit_bias is not supported")
    if p.HasField("prompt_logprobs"):
        raise invalid("prompt logprobs are not supported")
    out = generate_pb2.SamplingParams(
        stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        include_stop_str_in_output=p.include_stop_str_in_output,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty)
    if p.n:  # 0: left out, one sample
        out.n = p.n
    if p.HasField("temperature"):
        out.temperature = p.temperature
    if p.top_p:
        out.top_p = p.top_p
    if p.top_k:
        out.top_k = min(p.top_k, INT32_MAX)
    if p.min_p:
        out.min_p = p.min_p
    if p.repetition_penalty:
        out.repetition_penalty = p.repetition_penalty
    if p.HasField("max_tokens"):
        out.max_tokens = min(p.max_tokens, INT32_MAX)
    if p.min_tokens:
        out.min_tokens = min(p.min_tokens, INT32_MAX)
    if p.HasField("logprobs"):
        out.logprobs = p.logprobs  # -1 ("all") is refused by validation with the allowed range
    if p.HasField("seed"):
        out.seed = p.seed % 2**64  # int32 there, uint64 here: a negative seed maps to one fixed seed
    if constraint == "choice":
        out.structured_output.choice.choices.extend(p.choice.choices)
    elif constraint is not None:  # json_schema, regex, grammar, json_object: the same names and types
        setattr(out.structured_output, constraint, getattr(p, constraint))
    return out


def _output_logprobs(positions) -> pb.OutputLogProbs:
    """Our per-position logprobs (generate_pb2.PositionLogprobs) in vLLM's layout; top lists only when some were
    asked for (as vLLM sends them)."""
    out = pb.OutputLogProbs()
    for lp in positions:
        out.token_ids.append(lp.sampled.token_id)
        out.token_logprobs.append(lp.sampled.logprob)
        if lp.top:
            out.top_logprobs.append(pb.TopLogProbs(values=[t.logprob for t in lp.top],
                                                   token_ids=[t.token_id for t in lp.top]))
    return out


class _Reply:
    """One Generate call's translation of our response messages into vLLM's: deltas as chunks when streaming,
    else everything of a sample gathered into its GenerateComplete (one per sample, each with its index)."""

    def __init__(self, stream: bool, sampling: pb.SamplingParams):
        self.stream, self.stops, self.stop_token_ids = stream, set(sampling.stop), set(sampling.stop_token_ids)
        self.prompt_tokens = 0
        self.ids: dict[int, list[int]] = {}  # by sample index
        self.logprobs: dict[int, list] = {}

    def convert(self, msg: generate_pb2.GenerateResponse) -> pb.GenerateResponse | None:
        """The vLLM message for one of ours, or None when there is nothing to send yet."""
        if msg.WhichOneof("response") == "chunk":
            c = msg.chunk
            if not c.token_ids:  # text released at the end (the gateway detokenizes for itself)
                return None
            if not self.stream:
                self.ids.setdefault(c.index, []).extend(c.token_ids)
                self.logprobs.setdefault(c.index, []).extend(c.logprobs)
                return None
            chunk = pb.GenerateStreamChunk(token_ids=c.token_ids, prompt_tokens=self.prompt_tokens,
                                           completion_tokens=len(c.token_ids),  # a delta count, as vLLM's
                                           index=c.index)
            if c.logprobs:
                chunk.output_logprobs.CopyFrom(_output_logprobs(c.logprobs))
            return pb.GenerateResponse(chunk=chunk)
        f = msg.final
        done = pb.GenerateComplete(
            output_ids=self.ids.get(f.index, []), finish_reason=FINISH_REASON.get(f.finish_reason, "stop"),
            index=f.index,
            prompt_tokens=f.usage.prompt_tokens, completion_tokens=f.usage.completion_tokens,
            cached_tokens=f.usage.cached_prompt_tokens, spec_draft_tokens=f.usage.spec_draft_tokens,
            spec_accepted_tokens=f.usage.spec_accepted_tokens)
        if self.logprobs.get(f.index):
            done.output_logprobs.CopyFrom(_output_logprobs(self.logprobs[f.index]))
        if f.finish_reason == generate_pb2.FINISH_REASON_STOP and f.matched_stop:
            # Final.matched_stop is a stop string, or a stop token id in decimal. As vLLM, report a token only when
            # it is one the request listed (end-of-sequence is no "matched stop").
            if f.matched_stop.isdecimal() and int(f.matched_stop) in self.stop_token_ids:
                done.matched_token_id = int(f.matched_stop)
            elif f.matched_stop in self.stops:
                done.matched_stop_str = f.matched_stop
        return pb.GenerateResponse(complete=done)


@unimplemented_quietly("pdserve's coordinator")
class VllmEngineServicer(pb_grpc.VllmEngineServicer):
    """`vllm.grpc.engine.VllmEngine` over the coordinator's request path (see the module docstring). RPCs not
    defined here (Embed, FlushCache, profiling) answer UNIMPLEMENTED quietly (`unimplemented_quietly`), and
    SubscribeKvEvents does without `--kv-events-relay`.

    Args:
        path: the coordinator's request path (shared by every door).
    """

    def __init__(self, path: RequestPath):
        self.path = path
        self.config, self.cluster, self.tokenizer = path.config, path.cluster, path.tokenizer
        self.model_dir = Path(self.config.model_dir).resolve()
        config_path = self.model_dir / "config.json"
        self.hf_config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.started = time.time()
        self.last_receive = 0.0

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """Stream one request's tokens (see the module docstring). Errors end the call with our statuses:
        INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ALREADY_EXISTS, UNAVAILABLE, DEADLINE_EXCEEDED."""
        self.last_receive = time.time()
        await grpc_call.run(self.path, context, _Generate(self, request, context))

    async def _prompt(self, request: pb.GenerateRequest) -> list[int]:
        """The prompt's token ids: the gateway's, or our tokenization of `text`, after truncate_prompt_tokens.

        Raises:
            RequestError: INVALID_ARGUMENT for a missing, empty, too long or out-of-vocabulary prompt, and for
                inputs this server does not take (multimodal, external KV transfer parameters).
        """
        if request.HasField("mm_inputs") or request.extra_mm_inputs or request.HasField("media_refs"):
            raise invalid("multimodal inputs are not supported: this model takes text only")
        if request.HasField("kv_transfer_params") or request.kv_transfer_params_json:
            raise invalid("kv_transfer_params are not supported: pdserve moves KV between its own workers")
        p = request.sampling_params
        keep = p.truncate_prompt_tokens if p.HasField("truncate_prompt_tokens") else None
        if keep is not None and keep < 1:
            raise invalid(f"sampling_params.truncate_prompt_tokens must be >= 1, got {keep}")
        kind = request.WhichOneof("input")
        if kind == "tokenized":
            ids = request.tokenized.input_ids
            start = max(0, len(ids) - keep) if keep is not None else 0  # vLLM keeps the prompt's end
            check_prompt_length(len(ids) - start, self.cluster.limits)  # before copying: ids may be millions
            prompt = list(ids[start:])
        elif kind == "text":
            check_text_length(len(request.text), self.tokenizer.max_chars_per_token, self.cluster.limits)
            prompt = await asyncio.to_thread(self.tokenizer.encode, request.text)
            if keep is not None:
                prompt = prompt[-keep:]
        else:
            raise invalid("one of tokenized or text is required")
        check_prompt(prompt, self.cluster.limits)
        return prompt

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        """Cancel each named request still in flight (unknown ids are ignored, as finished ones are)."""
        caller = grpc_call.caller(context, self.path.keys_required)
        for rid in request.request_ids:
            self.path.abort(caller, rid)
        return pb.AbortResponse()

    async def HealthCheck(self, request, context) -> pb.HealthCheckResponse:
        """Healthy while requests can be served (`Cluster.ready`), as our readiness says."""
        if self.cluster.ready:
            return pb.HealthCheckResponse(healthy=True, message="serving")
        missing = " or ".join(self.cluster.missing_roles()) or "worker"
        return pb.HealthCheckResponse(healthy=False, message=f"no live {missing} worker")

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        """The served model. model_path and tokenizer_path name the coordinator's model directory: a gateway on
        this host loads the tokenizer from it (it would treat a path it cannot see as a hub id); one elsewhere can
        take GetTokenizer's copy."""
        try:
            limits, cfg = self.cluster.limits, self.hf_config
        except RequestError as e:  # no worker seen yet: UNAVAILABLE, not grpc's UNKNOWN
            await context.abort(e.code, e.client_message)
        eos = cfg.get("eos_token_id")
        eos = [self.cluster.eos_token_id] if eos is None else eos if isinstance(eos, list) else [eos]
        return pb.GetModelInfoResponse(
            model_path=str(self.model_dir), tokenizer_path=str(self.model_dir), is_generation=True,
            served_model_name=self.config.model_name, max_context_length=limits.context_length,
            vocab_size=limits.vocab_size, supports_vision=False, model_type=cfg.get("model_type") or "",
            architectures=cfg.get("architectures") or [],
            eos_token_ids=eos,
            pad_token_id=cfg.get("pad_token_id") or 0, bos_token_id=cfg.get("bos_token_id") or 0,
            max_req_input_len=limits.context_length - 1)  # a prompt must leave room for one output token

    async def GetServerInfo(self, request, context) -> pb.GetServerInfoResponse:
        """Requests in flight and uptime. The KV connector fields stay empty: our prefill/decode split is inside
        the cluster, and the gateway must not pair this server with another as a vLLM prefill or decode."""
        return pb.GetServerInfoResponse(
            active_requests=len(self.cluster.flows), is_paused=False, last_receive_timestamp=self.last_receive,
            uptime_seconds=time.time() - self.started, server_type="pdserve", data_parallel_size=1,
            block_size=self.cluster.block_size)

    async def GetLoads(self, request, context) -> pb.GetLoadsResponse:
        """The cluster as one rank, from the workers' last polled stats (`coordinator.membership`, every
        --stats-interval-s): running = requests in decode batches; waiting = requests queued or prefilling
        (prefill workers' queues and running prefills, decode workers' waiting requests); token_usage = the share of
        live decode workers' KV blocks in use, [0, 1]; cache_hit_rate = prompt tokens found in prefill workers'
        prefix caches over those looked up, since they started."""
        decode = [w for w in self.cluster.router.live("decode") if w.stats is not None]
        prefill = [w for w in self.cluster.router.live("prefill") if w.stats is not None]
        running = sum(w.stats.num_running for w in decode)
        waiting = sum(w.stats.num_waiting for w in decode) + sum(w.stats.num_waiting + w.stats.num_running
                                                                 for w in prefill)
        total = sum(w.stats.num_total_blocks for w in decode)
        used = total - sum(w.stats.num_free_blocks for w in decode)
        hits = sum(w.stats.prefix_cache_hit_tokens for w in prefill or decode)
        queried = sum(w.stats.prefix_cache_query_tokens for w in prefill or decode)
        block = self.cluster.block_size
        load = pb.SchedulerLoad(
            dp_rank=0, num_running_reqs=running, num_waiting_reqs=waiting, num_total_reqs=running + waiting,
            num_used_tokens=min(used * block, INT32_MAX), max_total_num_tokens=min(total * block, INT32_MAX),
            token_usage=used / total if total else 0.0, cache_hit_rate=hits / queried if queried else 0.0)
        return pb.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(), version=_version(),
                                   dp_rank_count=1, loads=[load])

    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest, context):
        """The workers' KV events as one engine's (`coordinator.kv_relay`), from `start_sequence_number` (0: a
        snapshot of the live blocks first). UNIMPLEMENTED unless the coordinator runs with --kv-events-relay."""
        relay = self.cluster.router.prefixes.relay
        if relay is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "KV events are not relayed here: start the coordinator with --kv-events-relay "
                                "(and its workers with --kv-events)")
        agent = dict(context.invocation_metadata() or ()).get("user-agent", "")
        log.info("KV events: a subscriber at %s (%s) from sequence %d", context.peer(), agent,
                 request.start_sequence_number)
        async for batch in relay.subscribe(request.start_sequence_number):
            yield batch

    async def GetTokenizer(self, request, context):
        """The model directory's tokenizer files (tokenizer.json, configs, chat templates) as a zip, streamed in
        chunks of at most 64 KiB; the last chunk carries the zip's SHA-256 (hex)."""
        data = await asyncio.to_thread(_tokenizer_zip, self.model_dir)
        digest = hashlib.sha256(data).hexdigest()
        for start in range(0, len(data), TOKENIZER_CHUNK_BYTES):
            end = start + TOKENIZER_CHUNK_BYTES
            yield common_pb2.GetTokenizerChunk(data=data[start:end], sha256=digest if end >= len(data) else "")


def _tokenizer_zip(model_dir: Path) -> bytes:
    """A zip of model_dir's tokenizer files (`TOKENIZER_FILES` and *.jinja), each at the archive's top level.
    Fixed timestamps keep its SHA-256 the same for the same files."""
    names = sorted({*(n for n in TOKENIZER_FILES if (model_dir / n).is_file()),
                    *(p.name for p in model_dir.glob("*.jinja") if p.is_file())})
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in names:
            zf.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), (model_dir / name).read_bytes(),
                        compress_type=zipfile.ZIP_DEFLATED)
    return buf.getvalue()


def _version() -> str:
    try:
        return "pdserve " + metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return "pdserve"


class _Generate:
    """One vLLM Generate call as the request path takes it (`request_path.DoorRequest`). "text_completion" for the
    trace: the gateway rendered any chat itself, so every request is token ids here. smg's GenerateRequest has no
    priority or tenant: default scheduling, the caller (the gateway) as tenant."""

    operation = "text_completion"

    def __init__(self, door: VllmEngineServicer, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        self.door, self.request, self.context = door, request, context
        self.request_id = request.request_id or uuid.uuid4().hex
        self.reply = _Reply(request.stream, request.sampling_params)

    async def prepare(self) -> tuple[list[int], generate_pb2.SamplingParams]:
        prompt = await self.door._prompt(self.request)
        self.reply.prompt_tokens = len(prompt)
        return prompt, resolve_sampling(to_sampling(self.request.sampling_params), len(prompt),
                                        self.door.cluster.limits)

    def scheduling(self) -> SchedulingAsk:
        return SchedulingAsk()

    async def send(self, msg: generate_pb2.GenerateResponse) -> None:
        if (out := self.reply.convert(msg)) is not None:  # the same stalled-client limit as every door
            await grpc_call.write(self.context, out, self.door.config.stall_timeout_s)
