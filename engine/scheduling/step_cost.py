"""How long a step takes, learned from the steps run, and the prefill chunk that keeps a step within an inter-token
latency target while requests are decoding: Sarathi-Serve's stall-free batching (Agrawal et al., OSDI 2024), whose
token budget comes from the TBT SLO and the measured cost of prefill tokens.

A step's time is modelled as t = decode_ms + prefill_tokens * ms_per_prefill_token: decode_ms is the recent time of
a step that only decodes (weights streamed once, whatever the batch), ms_per_prefill_token the recent extra time a
prefill token adds. Both are exponentially weighted means, so they follow the batch size and the context length as
they drift. Plain state, owned by the scheduler (engine thread); tests feed it made-up durations.
"""
from __future__ import annotations

from dataclasses import dataclass

# Weight of the newest sample in the moving means: about the last 10 steps count.
EWMA_ALPHA = 0.2
# A prefill sample needs this many tokens: below it the per-token cost drowns in the step's fixed cost.
MIN_PREFILL_SAMPLE_TOKENS = 32


@dataclass
class StepCost:
    """The two moving means above (ms; None until measured).

    Attributes:
        decode_ms: a decode-only step's duration, ms.
        ms_per_prefill_token: what one prefill token adds to a step, ms.
    """

    decode_ms: float | None = None
    ms_per_prefill_token: float | None = None

    def observe(self, num_decode_tokens: int, num_prefill_tokens: int, step_ms: float) -> None:
        """Learn from one step: `num_decode_tokens` (one a decoding request, drafts included) and
        `num_prefill_tokens` (prompt chunks) computed in `step_ms` ms (the forward and sampling, wall time)."""
        if num_prefill_tokens == 0:
            if num_decode_tokens:
                self.decode_ms = _mean(self.decode_ms, step_ms)
            return
        if num_prefill_tokens < MIN_PREFILL_SAMPLE_TOKENS:
            return
        base = self.decode_ms if num_decode_tokens and self.decode_ms is not None else 0.0
        self.ms_per_prefill_token = _mean(self.ms_per_prefill_token, max(step_ms - base, 0.0) / num_prefill_tokens)

    def prefill_budget(self, itl_target_ms: float, floor: int) -> int | None:
        """Prefill tokens a step that also decodes may take to stay within `itl_target_ms`, at least `floor` (so
        prompts always progress, however far the decodes alone are over the target); None while the costs are
        not measured yet (no cap: the first prefill measures them)."""
        if self.ms_per_prefill_token is None or self.decode_ms is None:
            return None
        if self.ms_per_prefill_token <= 0:
            return None
        return max(floor, int((itl_target_ms - self.decode_ms) / self.ms_per_prefill_token))


def _mean(old: float | None, sample: float) -> float:
    return sample if old is None else old + EWMA_ALPHA * (sample - old)
