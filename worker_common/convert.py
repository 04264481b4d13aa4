"""Conversions between the internal proto messages and the engine's dataclasses (the only place they meet)."""
from __future__ import annotations

import dataclasses
import json

from pdserve_server.engine.outputs import SampledToken
from pdserve_server.engine.request import FinishReason, SamplingParams, SchedulingParams, StructuredOutput
from pdserve.v1 import generate_pb2, worker_pb2

FINISH_REASON_TO_PROTO = {FinishReason.STOP: generate_pb2.FINISH_REASON_STOP,
                          FinishReason.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
                          FinishReason.ABORT: generate_pb2.FINISH_REASON_ABORT}


def sampling_from_proto(p: generate_pb2.SamplingParams) -> SamplingParams:
    """The resolved public message (every default filled by the coordinator) -> the engine's SamplingParams.

    Field by field by name, so a new sampling option needs no edit here. An unset optional field (seed,
    logprobs) takes the engine's default, None = off; repeated fields become tuples; fields the engine has no
    use for (stop strings, handled by the coordinator) are not read. structured_output is the one message field
    (`structured_from_proto`).
    """
    kwargs = {}
    for f in dataclasses.fields(SamplingParams):
        desc = p.DESCRIPTOR.fields_by_name[f.name]
        if f.name == "structured_output":
            kwargs[f.name] = structured_from_proto(p.structured_output) if p.HasField(f.name) else None
        elif desc.is_repeated:
            kwargs[f.name] = tuple(getattr(p, f.name))
        elif not desc.has_presence or p.HasField(f.name):
            kwargs[f.name] = getattr(p, f.name)
    return SamplingParams(**kwargs)


def scheduling_from_proto(msg: worker_pb2.SchedulingHints | None, now: float,
                          with_deadline: bool = True) -> SchedulingParams:
    """The coordinator's scheduling hints -> the engine's SchedulingParams.

    Args:
        msg: the request's hints; None or an unset field take the engine's defaults (priority 0, tenant "",
            weight 1, no deadline), so a caller that sends none is scheduled as before.
        now: the worker call's start, time.time() seconds: ttft_deadline_ms counts from it.
        with_deadline: False for a remote-KV decode request, whose first token the prefill worker gives: its
            ttft_deadline_ms is ignored.

    Returns:
        SchedulingParams with deadline = now + ttft_deadline_ms / 1000 (Unix seconds), None when it is 0.

    Raises:
        EngineError: INVALID_REQUEST for a weight that is set but not > 0 and finite (the worker's edge answers
            INVALID_ARGUMENT).
    """
    if msg is None:
        return SchedulingParams()
    deadline = now + msg.ttft_deadline_ms / 1e3 if with_deadline and msg.ttft_deadline_ms else None
    return SchedulingParams(priority=msg.priority, tenant=msg.tenant,
                            weight=msg.weight if msg.HasField("weight") else 1.0, deadline=deadline,
                            cache_salt=msg.cache_salt)


def structured_from_proto(c: generate_pb2.StructuredOutput) -> StructuredOutput | None:
    """The public constraint -> the engine's (kind, text); None when no kind is set. A choice list travels as JSON
    text; json_object = false counts as unset (the coordinator refuses it first)."""
    kind = c.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not c.json_object):
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "choice":
        return StructuredOutput("choice", json.dumps(list(c.choice.choices)))
    return StructuredOutput(kind, getattr(c, kind))


def token_to_proto(t: SampledToken, index: int = 0) -> worker_pb2.SampledToken:
    """An engine SampledToken -> the worker proto's, with logprobs (text filled in later by the coordinator);
    index: its sample of a parallel-sampling request (`TokenOutput.index`)."""
    msg = worker_pb2.SampledToken(token_id=t.token_id, index=index)
    if t.logprob is not None:
        msg.logprobs.CopyFrom(generate_pb2.PositionLogprobs(
            sampled=generate_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob),
            top=[generate_pb2.TokenLogprob(token_id=i, logprob=lp) for i, lp in t.top_logprobs]))
    return msg
