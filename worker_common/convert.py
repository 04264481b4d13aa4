"""Conversions between the internal proto messages and engine dataclasses."""
from __future__ import annotations

from engine.outputs import SampledToken
from engine.request import FinishReason, SamplingParams
from pdserve.v1 import generate_pb2, worker_pb2

FINISH_REASON_TO_PROTO = {FinishReason.STOP: generate_pb2.FINISH_REASON_STOP,
                          FinishReason.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
                          FinishReason.ABORT: generate_pb2.FINISH_REASON_ABORT}


def sampling_from_proto(p: worker_pb2.ResolvedSampling) -> SamplingParams:
    """ResolvedSampling (already validated by the coordinator) -> SamplingParams."""
    return SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        seed=p.seed if p.has_seed else None, repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty, max_tokens=p.max_tokens,
        min_tokens=p.min_tokens, stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos,
        logprobs=None if p.logprobs < 0 else p.logprobs)


def sampling_to_proto(s: SamplingParams) -> worker_pb2.ResolvedSampling:
    return worker_pb2.ResolvedSampling(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, has_seed=s.seed is not None,
        seed=s.seed or 0, repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, max_tokens=s.max_tokens, min_tokens=s.min_tokens,
        stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
        logprobs=-1 if s.logprobs is None else s.logprobs)


def token_to_proto(t: SampledToken) -> worker_pb2.SampledToken:
    msg = worker_pb2.SampledToken(token_id=t.token_id)
    if t.logprob is not None:
        msg.logprobs.CopyFrom(generate_pb2.PositionLogprobs(
            sampled=generate_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob),
            top=[generate_pb2.TokenLogprob(token_id=i, logprob=lp) for i, lp in t.top_logprobs]))
    return msg
