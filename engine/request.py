"""Engine-side request state. Tokens are counted, not phases: prefill chunks, prefix-cache hits and KV received
from a prefill worker all simply advance `num_computed_tokens`."""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve_server.engine.errors import EngineError, ErrorKind

if TYPE_CHECKING:
    from pdserve_server.engine.kv_stream import KvLayerProgress

MAX_LOGPROBS = 20  # most alternatives per position (vLLM's default cap); coordinator.validation has the same
MAX_SAMPLES = 64  # most parallel samples (n) of one request
SAMPLE_ID_SEPARATOR = "\x00"  # engine-internal id of sample i > 0: f"{request_id}\x00{i}" (no external id has it)


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output (the public `pdserve.v1.StructuredOutput`), compiled by `engine.structured`.

    Attributes:
        kind: "json_schema", "regex", "grammar" (GBNF or Lark), "json_object" or "choice".
        spec: the schema / regex / grammar text; "" for json_object; a JSON list of strings for choice.
    """

    kind: str
    spec: str = ""


@dataclass(frozen=True)
class SamplingParams:
    """Resolved sampling parameters of one request. Semantics follow vLLM's SamplingParams.

    The field names are those of the public `pdserve.v1.SamplingParams` message, which workers convert
    field by field (`worker_common.convert.sampling_from_proto`). The defaults here are the documented public
    defaults (generate.proto), which the coordinator resolves; a test holds the two together. max_tokens has no
    default: only the coordinator knows the context left.

    Attributes:
        max_tokens: output tokens at most.
        temperature: 0 = greedy.
        top_p: nucleus mass in (0, 1].
        top_k: 0 = off.
        min_p: 0 = off.
        seed: None = unseeded.
        repetition_penalty: 1 = off (CTRL; applies to prompt and output tokens).
        presence_penalty, frequency_penalty: 0 = off (OpenAI; output tokens only).
        min_tokens: EOS / stop token ids suppressed before this many output tokens.
        stop_token_ids: extra ids that end generation.
        ignore_eos: do not stop on the model's EOS.
        logprobs: None = off; k = sampled token's logprob plus the top-k alternatives.
        structured_output: None = unconstrained; else the language the output must belong to (the sampler masks
            the tokens it does not allow; `engine.structured`).
        n: parallel samples of the same prompt (vLLM's `n`): the prompt is computed once and its KV blocks shared
            (`Scheduler`'s fork); sample i > 0 of a seeded request draws with seed + i, as vLLM's.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    structured_output: StructuredOutput | None = None
    n: int = 1

    def __post_init__(self) -> None:
        """The same ranges the coordinator enforces, checked again because the worker API may be called directly.

        Raises:
            EngineError: INVALID_REQUEST naming the field.
        """
        checks = [
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0.0, ">= 0 and finite"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("top_k", self.top_k >= 0, ">= 0"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0.0, "> 0"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]"),
            ("max_tokens", self.max_tokens >= 1, ">= 1"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "in [0, max_tokens]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]"),
            ("n", 1 <= self.n <= MAX_SAMPLES, f"in [1, {MAX_SAMPLES}]"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise EngineError(ErrorKind.INVALID_REQUEST,
                                  f"sampling.{name} must be {rule}, got {getattr(self, name)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that reads other tokens: no penalties and no logprobs. The next token is then the
        argmax of the logits alone (the sampler's batched path; what speculative decoding can verify)."""
        return (self.greedy and self.logprobs is None and self.repetition_penalty == 1.0
                and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0)


@dataclass(frozen=True)
class SchedulingParams:
    """How a request is scheduled beside others (`engine.scheduling.policy` applies it).

    Attributes:
        priority: lower runs sooner (vLLM's convention); requests of a lower value are admitted first and may
            preempt running requests of a higher value. Default 0.
        tenant: whose work this is (an API key's id, or the caller's `tenant` field); the token budget is shared
            fairly between tenants with work queued. "" is one anonymous tenant.
        weight: the tenant's share, > 0: a tenant of weight 2 gets twice the tokens of one of weight 1 while both
            have work queued.
        deadline: Unix seconds (wall clock) by which the first token is due; a request still queued then, nothing
            computed for it, is refused (DEADLINE) rather than prefilled. None = no deadline.
        cache_salt: prefix-cache isolation: non-empty, the request's block hashes chain from this salt's own root
            (`engine.scheduling.block_pool.chain_root`), so its prefix-cache blocks serve only requests of the same
            salt (vLLM's `cache_salt`). "" shares with every request without one.
    """

    priority: int = 0
    tenant: str = ""
    weight: float = 1.0
    deadline: float | None = None
    cache_salt: str = ""

    def __post_init__(self) -> None:
        """Raises:
            EngineError: INVALID_REQUEST for a weight that is not positive and finite."""
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise EngineError(ErrorKind.INVALID_REQUEST, f"scheduling.weight must be > 0 and finite, got {self.weight}")


class RequestStatus(enum.Enum):
    WAITING_FOR_BLOCKS = "waiting_for_blocks"  # remote-KV request queued for a reservation
    WAITING_FOR_KV = "waiting_for_kv"          # blocks reserved, KV transfer pending
    WAITING = "waiting"
    RUNNING = "running"
    PAUSED = "paused"                           # its reader fell behind: out of the batch, blocks kept while they last
    PREEMPTED = "preempted"
    HELD = "held"                               # prefill done; blocks held until the KV send completes
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    PREFILL_DONE = "prefill_done"  # prefill-only request sampled its first token


@dataclass
class Request:
    """One generation request inside an engine.

    Attributes:
        prompt_token_ids: the prompt.
        output_token_ids: sampled tokens so far. A request may start with some: the tokens a lost worker had
            generated when the coordinator resumes it elsewhere (sampling, penalties, max_tokens and seeds then
            continue as if nothing happened). A remote-KV decode request appends the prefill's token on arrival.
        num_computed_tokens: tokens whose KV is in this engine's cache.
        num_cached_tokens: prompt tokens served by the prefix cache at first scheduling.
        prefill_only: stop after the first sampled token and hold the blocks (prefill worker).
        remote_kv: the prompt's KV arrives from a prefill worker (decode worker).
        kv_layers: prefill worker, layer-wise streaming: told as each layer of the last prefill chunk is written,
            so the KV sender can send that layer while the rest of the forward runs. None = not streamed.
        num_draft_tokens / num_accepted_tokens: speculative decoding: draft tokens verified / accepted so far.
        matcher: the constraint's `engine.structured.Matcher`, advanced with every output token (set by the
            scheduler at admission, output_token_ids replayed into it); None when unconstrained.
        scheduling: priority, tenant and deadline (`SchedulingParams`).
        parent_id / sample_index: sample sample_index > 0 of a parallel-sampling request (sampling.n > 1) is a
            request of its own inside the scheduler, forked from the request parent_id (sample 0); its events carry
            the parent's id and its index.
        fork_pending: a request with sampling.n > 1 not yet forked: it computes its prompt but the last token, then
            forks (`Scheduler`), and every sample computes the last token on its own.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    prefill_only: bool = False
    remote_kv: bool = False
    arrival_time: float = field(default_factory=time.time)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    kv_layers: KvLayerProgress | None = field(default=None, repr=False, compare=False)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    matcher: Any = field(default=None, repr=False, compare=False)
    scheduling: SchedulingParams = field(default_factory=SchedulingParams)
    parent_id: str | None = None
    sample_index: int = 0
    fork_pending: bool = field(default=False, init=False)
    _all_token_ids: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        self.fork_pending = self.sampling.n > 1 and self.parent_id is None

    @property
    def external_id(self) -> str:
        """The id the request's events carry: its own, or its parent's for a forked sample."""
        return self.parent_id if self.parent_id is not None else self.request_id

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output (a live list: do not mutate)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def argmax_next(self) -> bool:
        """The next token is the argmax of its logits alone: plain greedy, and no stop token is masked any more
        (min_tokens reached)."""
        return self.sampling.plain_greedy and len(self.output_token_ids) >= self.sampling.min_tokens

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
