"""A step's duration as a function of its shape: the performance model a mock engine sleeps by, fitted on the step
times of pdserve's own engine on a real device (`bench/step_times.py` measures them, `bench/fit_step_model.py` fits).

Two regimes, as the engine runs them on a GPU:

- decode-only steps (replayed CUDA graphs, padded to a captured batch size G(B)):
  ms = d0 + d1 * G(B) + d2 * sum(context) + d3 * max(context) * G(B)
  weights read once (d0), per-row work (d1), KV read by attention (d2), and the attention kernel's programs waiting
  on the longest context of the batch (d3);
- steps with prefill chunks (eager):
  ms = p0 + p1 * T + p2 * relu(T - k1) + p3 * relu(T - k2) + p4 * A + p5 * B + p6 * sum(context)
  T the prefill tokens (piecewise linear at knees k1, k2: a GEMM's cost per token falls as it leaves the memory-bound
  regime), A the causal attention work sum(q * (c + (q + 1) / 2)) over chunks of q tokens after c, and the decodes
  riding along (B rows, their contexts).

Coefficients come from a weighted least-squares fit of relative error (each step weighted 1 / its time), with
steps more than 50% off the fit dropped and the fit repeated (one-off stalls such as a kernel's first compile).
Plain data, JSON-serialisable (`StepTimeModel.to_json` / `from_json`); the profile files in `engine/mock/profiles/`
are such documents with their source beside the numbers.
"""
from __future__ import annotations

import bisect
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# A step off the fit by more than this fraction of its time is dropped from the next round of the fit.
OUTLIER_FRACTION = 0.5
FIT_ROUNDS = 3


@dataclass(frozen=True)
class StepShape:
    """What a step's time depends on.

    Attributes:
        prefill_tokens: prompt (or recomputed) tokens in the step's chunks.
        prefill_attn: causal attention work of those chunks: sum of q * (c + (q + 1) / 2), query-key pairs.
        decode_seqs: requests decoding one token each.
        decode_ctx: their context lengths summed, tokens (the KV their attention reads).
        decode_ctx_max: the longest of those contexts, tokens.
    """

    prefill_tokens: int = 0
    prefill_attn: float = 0.0
    decode_seqs: int = 0
    decode_ctx: int = 0
    decode_ctx_max: int = 0

    @classmethod
    def of_step(cls, chunks: Iterable[tuple[int, int]], decode_lens: Sequence[int]) -> StepShape:
        """From the step's prefill chunks, (tokens, tokens computed before) each, and the decodes' context lengths
        (tokens, the new one included)."""
        chunks = list(chunks)
        return cls(prefill_tokens=sum(q for q, _ in chunks),
                   prefill_attn=float(sum(q * (c + (q + 1) / 2) for q, c in chunks)),
                   decode_seqs=len(decode_lens), decode_ctx=sum(decode_lens),
                   decode_ctx_max=max(decode_lens, default=0))

    @classmethod
    def of_output(cls, out) -> StepShape:
        """From an `engine.outputs.SchedulerOutput` (drafted decodes count as decodes, not prefill)."""
        chunks = [(s.num_new_tokens, s.request.num_computed_tokens) for s in out.prefills if not s.spec_token_ids]
        lens = [s.request.num_computed_tokens + 1 for s in out.decodes]
        lens += [s.request.num_computed_tokens + s.num_new_tokens for s in out.prefills if s.spec_token_ids]
        return cls.of_step(chunks, lens)


@dataclass(frozen=True)
class StepTimeModel:
    """The fitted model above. Coefficients in ms per unit of their feature.

    Attributes:
        decode: d0..d3. mixed: p0..p6.
        batch_sizes: the captured decode batch sizes G pads to (ascending; a batch past the last is not padded).
        knees: k1, k2, tokens.
        source: where the fitted steps came from (free text: device, model, files, date).
        error: how well it predicts steps it was not fitted on (free-form figures from the fit).
    """

    decode: tuple[float, ...]
    mixed: tuple[float, ...]
    batch_sizes: tuple[int, ...] = ()
    knees: tuple[int, int] = (512, 2048)
    source: str = ""
    error: dict = field(default_factory=dict)

    def padded(self, batch: int) -> int:
        """G(batch): the smallest captured size holding `batch` rows, or batch itself past the last."""
        i = bisect.bisect_left(self.batch_sizes, batch)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else batch

    def features(self, s: StepShape) -> tuple[str, list[float]]:
        """("decode" or "mixed", the feature vector the coefficients multiply)."""
        if s.prefill_tokens == 0:
            g = self.padded(s.decode_seqs)
            return "decode", [1.0, g, s.decode_ctx, s.decode_ctx_max * g]
        t, (k1, k2) = s.prefill_tokens, self.knees
        return "mixed", [1.0, t, max(0, t - k1), max(0, t - k2), s.prefill_attn, s.decode_seqs, s.decode_ctx]

    def predict_ms(self, s: StepShape) -> float:
        """The step's duration, ms (never below 0). An empty step takes 0."""
        if s.prefill_tokens == 0 and s.decode_seqs == 0:
            return 0.0
        kind, x = self.features(s)
        coef = self.decode if kind == "decode" else self.mixed
        return max(0.0, float(np.dot(coef, x)))

    def scaled(self, speedup: float) -> StepTimeModel:
        """The model of a device `speedup` times as fast (every step's time divided by it), as the mock engine
        runs with --mock-speedup."""
        return StepTimeModel(tuple(c / speedup for c in self.decode), tuple(c / speedup for c in self.mixed),
                             self.batch_sizes, self.knees, self.source, self.error)

    def to_json(self) -> dict:
        return dict(decode=list(self.decode), mixed=list(self.mixed), batch_sizes=list(self.batch_sizes),
                    knees=list(self.knees), source=self.source, error=self.error)

    @classmethod
    def from_json(cls, doc: dict) -> StepTimeModel:
        """Raises: ValueError: a coefficient list of the wrong length, or a missing field (named)."""
        try:
            model = cls(decode=tuple(float(x) for x in doc["decode"]), mixed=tuple(float(x) for x in doc["mixed"]),
                        batch_sizes=tuple(int(x) for x in doc.get("batch_sizes", ())),
                        knees=tuple(int(x) for x in doc.get("knees", (512, 2048))),
                        source=str(doc.get("source", "")), error=dict(doc.get("error", {})))
        except KeyError as e:
            raise ValueError(f"step-time profile lacks {e.args[0]!r}") from None
        if len(model.decode) != 4 or len(model.mixed) != 7 or len(model.knees) != 2:
            raise ValueError("step-time profile: decode needs 4 coefficients, mixed 7, knees 2")
        return model


def fit(shapes: Sequence[StepShape], times_ms: Sequence[float], batch_sizes: Sequence[int] = (),
        knees: tuple[int, int] = (512, 2048), source: str = "") -> tuple[StepTimeModel, int]:
    """Least-squares fit of relative error, each regime apart, with outlier rounds (module docstring).

    Args:
        shapes, times_ms: the measured steps and their durations (ms, > 0).

    Returns:
        (the model, how many steps were dropped as outliers in the last round).

    Raises:
        ValueError: fewer steps of a regime than it has coefficients.
    """
    shell = StepTimeModel(decode=(0.0,) * 4, mixed=(0.0,) * 7, batch_sizes=tuple(sorted(batch_sizes)),
                          knees=knees, source=source)
    rows = [(shell.features(s), t) for s, t in zip(shapes, times_ms) if t > 0]
    keep = [True] * len(rows)
    model = shell
    for _ in range(FIT_ROUNDS):
        coef = {}
        for kind, width in (("decode", 4), ("mixed", 7)):
            sel = [(x, t) for ((k, x), t), ok in zip(rows, keep) if ok and k == kind]
            if len(sel) < width:
                raise ValueError(f"{len(sel)} {kind} steps: at least {width} are needed to fit")
            a = np.array([x for x, _ in sel], dtype=np.float64)
            y = np.array([t for _, t in sel], dtype=np.float64)
            w = 1.0 / y
            coef[kind] = tuple(float(c) for c in np.linalg.lstsq(a * w[:, None], y * w, rcond=None)[0])
        model = StepTimeModel(coef["decode"], coef["mixed"], shell.batch_sizes, knees, source)
        keep = [abs(float(np.dot(model.decode if k == "decode" else model.mixed, x)) - t) <= OUTLIER_FRACTION * t
                for (k, x), t in rows]
    return model, keep.count(False)


def prediction_error(model: StepTimeModel, shapes: Sequence[StepShape], times_ms: Sequence[float]) -> dict:
    """How far `model` is from measured steps: the whole trace's time (predicted / measured - 1), and the
    median and 90th percentile of each step's |predicted - measured| / measured, over all steps and per regime."""
    pred = np.array([model.predict_ms(s) for s in shapes])
    real = np.array(times_ms, dtype=np.float64)
    rel = np.abs(pred - real) / real
    decode = np.array([s.prefill_tokens == 0 for s in shapes])

    def med(mask) -> float | None:
        return round(float(np.median(rel[mask])), 4) if mask.any() else None
    return dict(steps=len(real), total=round(float(pred.sum() / real.sum() - 1), 4),
                step_median=med(np.ones_like(decode)), step_p90=round(float(np.percentile(rel, 90)), 4),
                decode_median=med(decode), mixed_median=med(~decode))


def profile_dir() -> Path:
    """The shipped profiles' folder (package data)."""
    return Path(__file__).resolve().parent / "profiles"


def profile_names() -> list[str]:
    """The shipped profiles, by name (their file names without .json)."""
    return sorted(p.stem for p in profile_dir().glob("*.json"))


def load_profile(spec: str) -> StepTimeModel:
    """A shipped profile by name, or a profile JSON file by path (`StepTimeModel.to_json`'s document).

    Raises:
        ValueError: neither a shipped name nor a readable profile file (the shipped names listed), or a file
            that is not a profile.
    """
    path = profile_dir() / f"{spec}.json" if spec in profile_names() else Path(spec)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"mock engine profile {spec!r}: not a shipped profile ({', '.join(profile_names())}) "
                         f"nor a readable profile file ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"mock engine profile {spec!r} is not a JSON object")
    return StepTimeModel.from_json(doc)
