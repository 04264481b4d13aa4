"""Conversions between the internal proto messages and the engine's dataclasses (the only place they meet)."""
from __future__ import annotations

import dataclasses

from engine.outputs import SampledToken
from engine.request import FinishReason, SamplingParams
from pdserve.v1 import generate_pb2, worker_pb2

FINISH_REASON_TO_PROTO = {FinishReason.STOP: generate_pb2.FINISH_REASON_STOP,
                          FinishReason.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
                          FinishReason.ABORT: generate_pb2.FINISH_REASON_ABORT}


def sampling_from_proto(p: generate_pb2.SamplingParams) -> SamplingParams:
    """The resolved public message (every default filled by the coordinator) -> the engine's SamplingParams.

    Field by field by name, so a new sampling option needs no edit here. An unset optional field (seed,
    logprobs) takes the engine's default, None = off; repeated fields become tuples; fields the engine has no
    use for (stop strings, handled by the coordinator) are not read.
    """
    kwargs = {}
    for f in dataclasses.fields(SamplingParams):
        desc = p.DESCRIPTOR.fields_by_name[f.name]
        if desc.is_repeated:
            kwargs[f.name] = tuple(getattr(p, f.name))
        elif not desc.has_presence or p.HasField(f.name):
            kwargs[f.name] = getattr(p, f.name)
    return SamplingParams(**kwargs)


def token_to_proto(t: SampledToken) -> worker_pb2.SampledToken:
    """An engine SampledToken -> the worker proto's, with logprobs (text filled in later by the coordinator)."""
    msg = worker_pb2.SampledToken(token_id=t.token_id)
    if t.logprob is not None:
        msg.logprobs.CopyFrom(generate_pb2.PositionLogprobs(
            sampled=generate_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob),
            top=[generate_pb2.TokenLogprob(token_id=i, logprob=lp) for i, lp in t.top_logprobs]))
    return msg
