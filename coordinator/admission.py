"""Admission: whether a request may start, and the per-caller limits it is held to while it runs (rate limits in
requests/s and tokens/s, batch slots in flight, prompt tokens queued for their first token). Every check reads the
flows in flight (`Cluster.flows`), so a request that ended in any way stops counting at once: there is no counter
to leak. The request path (`coordinator.request_path`) calls these in order; each refusal is a RequestError with
the status and, where waiting helps, a retry hint."""
from __future__ import annotations

import grpc

from pdserve_server.coordinator import flow as flows
from pdserve_server.coordinator.config import CoordinatorConfig
from pdserve_server.coordinator.errors import RequestError, invalid
from pdserve_server.coordinator.ratelimit import RateLimiter
from pdserve_server.coordinator.validation import shorten

MAX_REQUEST_ID_CHARS = 256  # ids are echoed in errors, logs and traces
CAPACITY_RETRY_S = 1.0  # RetryInfo of "server at capacity": about one short request's time, a hint not a promise


class Admission:
    """The limits of CoordinatorConfig over the flows in flight.

    Args:
        config: max_in_flight, max_in_flight_per_caller, max_queued_tokens_per_caller and the rate limits.
        in_flight: request key (`flow.scoped_id`) -> Flow, the cluster's requests in flight (`Cluster.flows`); read
            here, written by the request path.
    """

    def __init__(self, config: CoordinatorConfig, in_flight: dict[str, flows.Flow]):
        self.config, self.in_flight = config, in_flight
        self.limiter = RateLimiter(config.rate_limit_requests_per_s, config.rate_limit_tokens_per_s,
                                   config.rate_limit_burst_s)

    def admit(self, rid: str, caller: str) -> None:
        """Raises RequestError unless a request with this id may start now: RESOURCE_EXHAUSTED (request rate, slots),
        INVALID_ARGUMENT (a bad id), ALREADY_EXISTS (the caller has this id in flight)."""
        if wait := self.limiter.admit(caller, "requests", 1):
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"request rate limit reached ({self.config.rate_limit_requests_per_s:g} requests/s); "
                               f"retry after {wait:.2f} s", retry_after_s=wait)
        if len(rid) > MAX_REQUEST_ID_CHARS:
            raise invalid(f"request_id has {len(rid)} characters; at most {MAX_REQUEST_ID_CHARS} are allowed")
        if not rid.isprintable():  # ids are written into logs: a newline or an ANSI escape would forge lines
            raise invalid(f"request_id {shorten(rid)} contains control or unprintable characters; use printable "
                          "text")
        if flows.scoped_id(caller, rid) in self.in_flight:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already in flight")
        self._check_slots(caller, 1)

    def charge(self, caller: str, num_tokens: int) -> None:
        """Take the request's tokens from the caller's rate limit. Raises RequestError RESOURCE_EXHAUSTED (with a
        retry hint), or INVALID_ARGUMENT for a request bigger than the limit's whole burst."""
        wait = self.limiter.admit(caller, "tokens", num_tokens)
        if wait == float("inf"):  # retrying cannot help: the request itself is too big for the limit
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"prompt + n x max_tokens = {num_tokens} tokens exceeds this key's token burst "
                               f"({self.config.rate_limit_tokens_per_s:g}/s for {self.config.rate_limit_burst_s:g} s);"
                               " lower max_tokens or n")
        if wait:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"token rate limit reached ({self.config.rate_limit_tokens_per_s:g} tokens/s); "
                               f"retry after {wait:.2f} s", retry_after_s=wait)

    def slots(self, caller: str | None = None) -> int:
        """Sequences in flight (a request of n samples counts n), of every caller or of `caller`."""
        return sum(f.samples for f in self.in_flight.values() if caller is None or f.caller == caller)

    def _check_slots(self, caller: str, wanted: int, held: int = 0) -> None:
        """Raises RequestError RESOURCE_EXHAUSTED (with a retry hint) unless a request holding `held` of the slots in
        flight may hold `wanted` instead under --max-in-flight and --max-in-flight-per-caller."""
        if self.slots() - held + wanted > self.config.max_in_flight:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"server at capacity ({self.config.max_in_flight} sequences in flight, a request of n "
                               "samples counting n); retry later", retry_after_s=CAPACITY_RETRY_S)
        per_caller = self.config.max_in_flight_per_caller
        others = self.slots(caller) - held
        if per_caller and others + wanted > per_caller:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"this caller has {others} sequences in flight and asks for {wanted} more; one caller "
                               f"may have {per_caller} (a request of n samples counts n); retry when one finishes",
                               retry_after_s=CAPACITY_RETRY_S)

    def take_slots(self, flow: flows.Flow, n: int) -> None:
        """The request turned out to have n samples: it takes n slots instead of the 1 `admit` checked.

        Raises:
            RequestError: INVALID_ARGUMENT when n alone exceeds a limit (retrying cannot help), else
                RESOURCE_EXHAUSTED as `admit`'s slot check.
        """
        if n <= flow.samples:
            return
        for limit, flag in ((self.config.max_in_flight, "--max-in-flight"),
                            (self.config.max_in_flight_per_caller, "--max-in-flight-per-caller")):
            if limit and n > limit:
                raise invalid(f"sampling.n = {n} needs {n} sequences, more than this server admits at once ({flag} "
                              f"{limit}); lower n")
        self._check_slots(flow.caller, n, held=flow.samples)
        flow.samples = n  # no await since the check

    def queued_tokens(self, caller: str) -> int:
        """Prompt tokens of `caller`'s requests in flight that have not had their first token yet."""
        return sum(f.queued_tokens for f in self.in_flight.values() if f.caller == caller)

    def check_queued_tokens(self, caller: str, num_prompt_tokens: int) -> None:
        """Raises RequestError unless the caller may queue num_prompt_tokens more (max_queued_tokens_per_caller):
        RESOURCE_EXHAUSTED with a retry hint while its other requests wait for their first token, INVALID_ARGUMENT
        for a prompt the limit can never admit."""
        limit = self.config.max_queued_tokens_per_caller
        if not limit:
            return
        if num_prompt_tokens > limit:  # retrying cannot help
            raise invalid(f"the prompt has {num_prompt_tokens} tokens, more than the {limit} prompt tokens one caller "
                          "may have queued (--max-queued-tokens-per-caller); shorten the prompt")
        queued = self.queued_tokens(caller)
        if queued + num_prompt_tokens > limit:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"this caller has {queued} prompt tokens waiting for their first token; with this "
                               f"prompt's {num_prompt_tokens} that passes the {limit} one caller may have queued; "
                               f"retry after {CAPACITY_RETRY_S:g} s or when one of its requests starts "
                               "streaming", retry_after_s=CAPACITY_RETRY_S)
