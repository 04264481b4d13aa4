"""How long a step takes, learned from the steps run, and the prefill chunk that keeps a step within an inter-token
latency target while requests are decoding: Sarathi-Serve's stall-free batching (Agrawal et al., OSDI 2024), whose
token budget comes from the TBT SLO and the measured cost of prefill tokens.

A step's time is modelled as t = decode_ms + prefill_tokens * ms_per_prefill_token: decode_ms is the recent time of
a step that only decodes (weights streamed once, whatever the batch), ms_per_prefill_token the recent extra time a
prefill token adds. Both are exponentially weighted means, so they follow the batch size and the context length as
they drift. Plain state, owned by the scheduler (engine thread); tests feed it made-up durations.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Weight of the newest sample in the moving means: about the last 10 steps count.
EWMA_ALPHA = 0.2
# A prefill sample needs this many tokens: below it the per-token cost drowns in the step's fixed cost.
MIN_PREFILL_SAMPLE_TOKENS = 32
# The line through recent prefill steps (`marginal_ms_per_prefill_token`) forgets at this rate: ~the last 20 count.
FIT_DECAY = 0.95
# ...and is trusted once the recent chunk sizes spread this much (standard deviation over mean); below it one size
# dominates and the slope is not determined.
MIN_FIT_SPREAD = 0.25


@dataclass
class StepCost:
    """The two moving means above (ms; None until measured).

    Attributes:
        decode_ms: a decode-only step's duration, ms.
        ms_per_prefill_token: what one prefill token adds to a step, ms.
    """

    decode_ms: float | None = None
    ms_per_prefill_token: float | None = None
    # exponentially weighted sums over prefill samples (tokens x, extra ms y): weight, x, y, x*x, x*y
    _fit: list[float] = field(default_factory=lambda: [0.0] * 5, repr=False)

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
        extra = max(step_ms - base, 0.0)
        self.ms_per_prefill_token = _mean(self.ms_per_prefill_token, extra / num_prefill_tokens)
        x = float(num_prefill_tokens)
        self._fit = [s * FIT_DECAY + v for s, v in zip(self._fit, (1.0, x, extra, x * x, x * extra))]

    @property
    def marginal_ms_per_prefill_token(self) -> float | None:
        """What one more prefill token adds to a step, ms, without the fixed part of a prefill step: the slope of a
        weighted least-squares line `extra_ms = a + b * tokens` through the recent prefill steps. The mean ratio
        (`ms_per_prefill_token`, which spreads the fixed part over the tokens) while recent chunks are of one size
        and the slope is not determined; never above that ratio, nor below 0. On a CPU the two agree closely; on a
        GPU an eager prefill step's launches cost ~20 ms whatever its size (docs/benchmarks.md), so the ratio of a
        64-token chunk overstates a token's cost several times. None until a prefill step is measured."""
        w, sx, sy, sxx, sxy = self._fit
        ratio = self.ms_per_prefill_token
        if ratio is None or w <= 0:
            return ratio
        mean_x = sx / w
        var_x = sxx / w - mean_x * mean_x
        if var_x < (MIN_FIT_SPREAD * mean_x) ** 2:
            return ratio
        slope = (sxy / w - mean_x * sy / w) / var_x
        return min(max(slope, 0.0), ratio)

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
