"""What one sample of a request has streamed to its client, and the messages that stream is made of: workers'
token events become text chunks (incremental detokenizing, stop strings), a finish becomes the final message, and
what was sent becomes the request's record (metrics, access log). A request has one `SampleStream`, or one per
sample with sampling.n > 1 (`coordinator.request_path` relays them)."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve_server.coordinator import flow as flows
from pdserve_server.coordinator.record import RequestRecord
from pdserve_server.coordinator.text import IncrementalDetokenizer, StopMatcher
from pdserve.v1 import generate_pb2


@dataclass
class Progress:
    """What a sample has sent its client so far, kept across migrations.

    Attributes:
        generated: output token ids sent; a resumed attempt starts after them.
        cached: prompt tokens the worker's prefix cache served.
        first_ms / last_ms: when the first and the latest token were sent (coordinator clock, ms).
        gaps: inter-token latencies, seconds. reason: a generate_pb2.FinishReason once it ended.
        relays: per chunk from a decode worker, seconds from its send (the worker's clock) to the chunk's
            hand-off to the door (the coordinator's): what the coordinator adds to those tokens' latency.
        stop_string / stop_token_id: what stopped it, when something did.
        migrations: resumptions on other workers so far.
        spec_draft / spec_accepted: speculative-decoding counts of the attempt that finished.
    """

    generated: list[int] = field(default_factory=list)
    cached: int = 0
    first_ms: float | None = None
    last_ms: float = 0.0
    gaps: list[float] = field(default_factory=list)
    relays: list[float] = field(default_factory=list)
    reason: int = generate_pb2.FINISH_REASON_UNSPECIFIED
    stop_string: str | None = None
    stop_token_id: int | None = None
    migrations: int = 0
    spec_draft: int = 0
    spec_accepted: int = 0

    @property
    def ended(self) -> bool:
        return self.reason != generate_pb2.FINISH_REASON_UNSPECIFIED


def merged(samples: list[Progress]) -> Progress:
    """The samples of a parallel-sampling request as one Progress for its record: every token, the first token's
    time, every gap; sample 0's finish reason once every sample has ended, else none (a request cancelled while
    some samples ran did not finish, whatever sample 0 did)."""
    firsts = [p.first_ms for p in samples if p.first_ms is not None]
    reason = samples[0].reason if all(p.ended for p in samples) else generate_pb2.FINISH_REASON_UNSPECIFIED
    return Progress(generated=[t for p in samples for t in p.generated], cached=max(p.cached for p in samples),
                    first_ms=min(firsts) if firsts else None, last_ms=max(p.last_ms for p in samples),
                    gaps=[g for p in samples for g in p.gaps], relays=[r for p in samples for r in p.relays],
                    reason=reason,
                    spec_draft=sum(p.spec_draft for p in samples),
                    spec_accepted=sum(p.spec_accepted for p in samples))


class SampleStream:
    """One sample's text: its detokenizer and stop matcher, and its `Progress`.

    Args:
        tokenizer: the coordinator's (`coordinator.tokenizer.Tokenizer`).
        prompt: the prompt's token ids (the detokenizer's context).
        sampling: the resolved sampling parameters (stop strings, logprobs).
        index: which sample (Chunk.index, Final.index).
    """

    def __init__(self, tokenizer, prompt: list[int], sampling: generate_pb2.SamplingParams, index: int = 0):
        self.tokenizer, self.sampling, self.index = tokenizer, sampling, index
        self.detok = IncrementalDetokenizer(tokenizer, prompt)
        self.stops = StopMatcher(list(sampling.stop), sampling.include_stop_str_in_output)
        self.progress = Progress()

    def chunk(self, item: flows.Tokens, on_first_token: Callable[[], None] = lambda: None,
              ) -> generate_pb2.GenerateResponse:
        """One worker Tokens event as a chunk; records it (progress.reason becomes STOP when a stop string
        matched). on_first_token: called at the sample's first token."""
        p = self.progress
        p.cached = item.num_cached_tokens or p.cached
        ids = [t.token_id for t in item.tokens]
        p.generated += ids
        text, p.stop_string = self.stops.feed(self.detok.add(ids))
        chunk = generate_pb2.Chunk(token_ids=ids, text=text, index=self.index)
        if self.sampling.HasField("logprobs"):
            chunk.logprobs.extend(self._logprobs(item.tokens))
        now = flows.now_ms()
        if p.first_ms is None:
            p.first_ms = now
            on_first_token()
            p.gaps += [0.0] * (len(ids) - 1)  # tokens that came with the first one
        elif ids:  # a coalesced chunk: its tokens share the gap
            p.gaps += [(now - p.last_ms) / 1e3 / len(ids)] * len(ids)
        p.last_ms = now
        if p.stop_string is not None:
            p.reason = generate_pb2.FINISH_REASON_STOP
        if item.sent_at:
            # clamped: across hosts the two clocks differ by their skew, which may run either way
            p.relays.append(max(0.0, time.time() - item.sent_at))
        return generate_pb2.GenerateResponse(chunk=chunk)

    def finish(self, item: flows.WorkerFinish) -> None:
        """The worker ended the sample."""
        p = self.progress
        p.reason, p.stop_token_id = item.finish_reason, item.stop_token_id
        p.spec_draft, p.spec_accepted = item.num_draft_tokens, item.num_accepted_tokens

    def ending(self, flow: flows.Flow, num_prompt_tokens: int, t0: float,
               end: float) -> list[generate_pb2.GenerateResponse]:
        """The sample's last messages: the text held back for a stop string that never came, then its Final.
        t0 / end: the request's arrival and this finish, ms (`flows.now_ms`)."""
        p, out = self.progress, []
        if p.stop_string is None and (tail := self.stops.flush()):
            out.append(generate_pb2.GenerateResponse(chunk=generate_pb2.Chunk(text=tail, index=self.index)))
        t = flow.timings
        ttft = (p.first_ms - t0) if p.first_ms is not None else 0.0
        matched = (p.stop_string if p.stop_string is not None
                   else "" if p.stop_token_id is None else str(p.stop_token_id))
        out.append(generate_pb2.GenerateResponse(final=generate_pb2.Final(
            finish_reason=p.reason, matched_stop=matched, request_id=flow.request_id, index=self.index,
            usage=generate_pb2.Usage(prompt_tokens=num_prompt_tokens, completion_tokens=len(p.generated),
                                     cached_prompt_tokens=p.cached, spec_draft_tokens=p.spec_draft,
                                     spec_accepted_tokens=p.spec_accepted),
            timings=generate_pb2.Timings(queue_ms=t.queue_ms, prefill_ms=t.prefill_ms, transfer_ms=t.transfer_ms,
                                         ttft_ms=ttft, decode_ms=(end - p.first_ms) if p.first_ms else 0.0,
                                         e2e_ms=end - t0))))
        return out

    def _logprobs(self, tokens) -> list[generate_pb2.PositionLogprobs]:
        out = []
        for t in tokens:
            lp = generate_pb2.PositionLogprobs()
            lp.CopyFrom(t.logprobs)
            lp.sampled.text = self.tokenizer.token_text(lp.sampled.token_id)
            for alt in lp.top:
                alt.text = self.tokenizer.token_text(alt.token_id)
            out.append(lp)
        return out


def request_record(flow: flows.Flow, num_prompt_tokens: int, p: Progress, t0: float,
           end: float | None = None) -> RequestRecord:
    """The request's record from what it sent so far (also when it fails or is cancelled midway: the access log
    and metrics count the tokens that were streamed). end: the finish time (ms, `flows.now_ms`) the final message
    reports, so both say the same e2e; default now."""
    t = flow.timings
    reason = (generate_pb2.FinishReason.Name(p.reason).removeprefix("FINISH_REASON_").lower()
              if p.ended else "")
    return RequestRecord(
        flow.request_id, prompt_tokens=num_prompt_tokens, output_tokens=len(p.generated), cached_tokens=p.cached,
        ttft_s=(p.first_ms - t0) / 1e3 if p.first_ms is not None else 0.0,
        e2e_s=((end if end is not None else flows.now_ms()) - t0) / 1e3,
        queue_s=t.queue_ms / 1e3, prefill_s=t.prefill_ms / 1e3, transfer_s=t.transfer_ms / 1e3,
        token_gaps=tuple(p.gaps), relays=tuple(p.relays), finish_reason=reason, prefill_worker=flow.prefill_worker,
        decode_worker=flow.decode_worker, migrations=p.migrations)
