"""What one scheduler step may still take: the token budget and the prefill cap, in one place for both of the step's
passes (running requests, then admissions)."""
from __future__ import annotations


class StepBudget:
    """Tokens one step may still schedule.

    Args:
        max_tokens: the step's token budget (`SchedulerConfig.max_num_batched_tokens`; decode tokens, prefill chunks
            and drafts alike).
        prefill: prefill tokens the step may take (the ITL target's cap, `Scheduler._prefill_cap`), None for no cap.
            A prefill chunk is a request's computation of more than one token.
    """

    def __init__(self, max_tokens: int, prefill: int | None):
        self.max_tokens, self.tokens, self.prefill = max_tokens, max_tokens, prefill

    def __bool__(self) -> bool:
        return self.tokens > 0

    def chunk(self, wanted: int, limit: int) -> int | None:
        """Tokens a request that has `wanted` more to compute takes this step: at most the tokens left and its chunk
        `limit`, and a prefill chunk at most the prefill cap's rest. None when the cap leaves a prefill chunk under
        two tokens (it waits for the next step; a decode token is never capped)."""
        n = min(wanted, self.tokens, limit)
        if n > 1 and self.prefill is not None:
            n = min(n, self.prefill)
            if n < 2:
                return None
        return n

    def take(self, n: int, num_drafts: int = 0) -> None:
        """A request was scheduled for n tokens (and num_drafts draft tokens to verify)."""
        self.tokens -= n + num_drafts
        if n > 1 and self.prefill is not None:
            self.prefill -= n

    def recount(self, num_scheduled: int) -> None:
        """Preemption took requests out of the step: the tokens left are the budget less what is still scheduled
        (`SchedulerOutput.num_tokens`). The prefill cap is not given back (the step's latency target stays spent)."""
        self.tokens = self.max_tokens - num_scheduled
