"""How long a worker would take to give a new prompt its first token: the prompt tokens queued there and the rate at
which that worker has been getting through them, both as this coordinator saw them.

The rate is measured, not configured: each first token gives a sample, (prompt tokens that were queued there when
the request was routed + its own) / (seconds from routing to its first token), smoothed exponentially. It is the
worker's prefill throughput as it actually runs (batched prompts, chunking, a decode batch sharing the steps on a
decode worker that prefills locally), so a prefill worker and a decode worker are compared on what each delivers.
Tokens are prompt tokens whether or not the worker's prefix cache holds them: the rate then counts cached tokens
too, consistently on both sides of a comparison (the prefix cache has its own local-prefill rule,
`LocalPrefillPolicy.max_uncached_tokens`).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

RATE_SMOOTHING = 0.3  # weight of the newest sample: a few first tokens follow a change of load


@dataclass
class PrefillQueue:
    """One worker's prefill backlog as this coordinator routed it.

    Attributes:
        pending_tokens: prompt tokens of requests routed here whose first token has not come yet.
        tokens_per_s: smoothed prompt tokens per second (see the module docstring); None before the first sample.
    """

    pending_tokens: int = 0
    tokens_per_s: float | None = None

    def predicted_wait_s(self, num_tokens: int, prior_tokens_per_s: float | None = None) -> float | None:
        """Seconds until a prompt of num_tokens routed here now would have its first token: the backlog and the
        prompt at the measured rate (`prior_tokens_per_s` until there is one). None when no rate is known."""
        rate = self.tokens_per_s or prior_tokens_per_s
        return None if not rate else (self.pending_tokens + num_tokens) / rate

    @contextmanager
    def track(self, num_tokens: int, clock: Callable[[], float] = time.monotonic) -> Iterator[Callable[[], None]]:
        """Count a prompt of num_tokens in the backlog until its first token: call the yielded function when it
        arrives (the tokens leave the backlog, and a rate sample is taken). Leaving the block without it (an error,
        a cancel) only gives the tokens back."""
        ahead, start = self.pending_tokens, clock()
        self.pending_tokens += num_tokens
        done = False

        def first_token() -> None:
            nonlocal done
            if done:
                return
            done = True
            self.pending_tokens -= num_tokens
            elapsed = clock() - start
            if elapsed > 0:
                sample = (ahead + num_tokens) / elapsed
                self.tokens_per_s = (sample if self.tokens_per_s is None
                                     else RATE_SMOOTHING * sample + (1 - RATE_SMOOTHING) * self.tokens_per_s)
        try:
            yield first_token
        finally:
            if not done:
                self.pending_tokens -= num_tokens
