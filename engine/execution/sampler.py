"""Token sampling with per-request parameters (temperature, top-k, top-p, min-p, penalties, seeds, logprobs).

Semantics follow vLLM's SamplingParams. Seeded requests draw from a generator seeded by (seed, output position),
so the prefill worker (first token) and the decode worker (the rest) produce the same stream as one process would.

Numerically safe for any parameters that pass validation: penalties may push logits to +-inf (a repetition
penalty of 1e-38 divides by it), so +inf is clamped to the largest finite value and NaN to -inf (never drawn), and
temperature scaling works on logits minus their maximum, so a temperature of 1e-45 tends to greedy instead of
overflowing. A row that still cannot be sampled fails that request alone (`RunnerOutput.failed`).
"""
from __future__ import annotations

import torch

from pdserve_server.engine.errors import EngineError, ErrorKind
from pdserve_server.engine.outputs import RunnerOutput, SampledToken
from pdserve_server.engine.request import Request

_MASK64 = (1 << 63) - 1


class Sampler:
    """Samples one token per row of logits.

    Args:
        vocab_size: logits width.
        seed: seed of the shared generator used by unseeded requests.
    """

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> RunnerOutput:
        """logits: [N, vocab] on the model's device, fp32 or the model's 16-bit dtype, one row per request, in order.
        A token per request, or its error. The rows of requests with a structured-output matcher are masked in
        place first (`_mask_constrained`).

        Plain-greedy rows take their argmax where the logits are, so a GPU worker copies N token ids to the host
        rather than N x vocab floats (vLLM samples on the device for the same reason); the other rows come to the
        host together, once, for the per-request path (penalties, seeded generators, logprobs)."""
        out = RunnerOutput()
        constrained = [i for i, r in enumerate(requests) if r.matcher is not None]
        if constrained:  # structured outputs: disallowed tokens to -inf, for every path below
            _mask_constrained(logits, requests, constrained, self.vocab_size)
        greedy = [r.argmax_next for r in requests]
        simple = [i for i, g in enumerate(greedy) if g]
        if simple:  # batched fast path for the common greedy case; no row copy when every row is greedy
            ids = greedy_argmax(logits if len(simple) == len(requests) else logits[simple]).tolist()
            for i, t in zip(simple, ids):
                out.sampled[requests[i].request_id] = SampledToken(t)
        rest = [i for i, g in enumerate(greedy) if not g]
        rows = logits[rest].cpu().float() if rest else logits[:0]  # penalties, softmax and logprobs in fp32
        for row, i in zip(rows, rest):
            req = requests[i]
            try:
                out.sampled[req.request_id] = self._sample_row(row.clone(), req)
            except Exception as e:  # one request's sampling must not fail the batch
                out.failed[req.request_id] = EngineError(ErrorKind.INTERNAL, f"sampling failed: {e}")
        return out

    def _sample_row(self, row: torch.Tensor, req: Request) -> SampledToken:
        sp = req.sampling
        _apply_penalties(row, req)
        # Penalties may overflow: +inf -> the largest finite value (ties share the mass), NaN -> never drawn.
        row = torch.nan_to_num(row, nan=float("-inf"), posinf=torch.finfo(row.dtype).max)
        if len(req.output_token_ids) < sp.min_tokens:
            banned = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(req.eos_token_ids))
            if banned:
                row[torch.tensor(banned)] = float("-inf")
        if not torch.isfinite(row.max()):
            raise ValueError("every token is masked out (-inf logits)")
        logprobs = torch.log_softmax(row, dim=-1) if sp.logprobs is not None else None
        if sp.greedy:
            token = int(row.argmax())
        else:
            token = self._draw(row, req)
        if logprobs is None:
            return SampledToken(token)
        top = []
        if sp.logprobs:
            vals, idx = logprobs.topk(sp.logprobs)
            top = list(zip(idx.tolist(), vals.tolist()))
        return SampledToken(token, float(logprobs[token]), top)

    def _draw(self, row: torch.Tensor, req: Request) -> int:
        sp = req.sampling
        x = (row - row.max()) / sp.temperature  # the best token scales to 0: no overflow at tiny temperatures
        if 0 < sp.top_k < x.numel():
            kth = torch.topk(x, sp.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if sp.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            cum = sorted_p.cumsum(0)
            drop = (cum - sorted_p) > sp.top_p  # keep the smallest prefix whose mass reaches top_p
            probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
        if sp.min_p > 0.0:
            probs = probs.masked_fill(probs < sp.min_p * probs.max(), 0.0)
        gen = self.generator
        if sp.seed is not None:
            gen = torch.Generator().manual_seed(
                (sp.seed * 6364136223846793005 + len(req.output_token_ids) * 1442695040888963407) & _MASK64)
        return int(torch.multinomial(probs, 1, generator=gen))


def _mask_constrained(logits: torch.Tensor, requests: list[Request], rows: list[int], vocab_size: int) -> None:
    """In place: the rows of constrained requests keep only the tokens their matchers allow (one batched bitmask
    fill for the step, `engine.structured`). logits: [N, vocab] as in `Sampler.__call__`; rows: indices into it."""
    from pdserve_server.engine.structured import apply_bitmask, fill_bitmask

    bitmask = fill_bitmask([requests[i].matcher for i in rows], vocab_size)
    with torch.inference_mode():  # the runner's logits are inference tensors: in-place only in this mode
        if len(rows) == len(requests):
            apply_bitmask(logits, bitmask)
        else:
            sub = logits[rows]
            apply_bitmask(sub, bitmask)
            logits[rows] = sub


TWO_PASS_ROWS = 5  # fewest rows greedy_argmax takes in two passes (its docstring)


def greedy_argmax(logits: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """`logits.argmax(dim=-1)` (the first index of each row's maximum; NaN counts as the maximum), computed in two
    passes: the maximum of every `chunk` columns, then the argmax inside the first chunk holding the row's maximum.

    Why: torch's CPU argmax does not vectorize its index tracking, while amax does; at 64 rows x 49152 (SmolLM2's
    vocab) fp32 on one thread argmax took 2.05 ms and amax 0.17 ms, a measurable part of a decode step. Below
    `TWO_PASS_ROWS` rows the two passes' dozen op calls cost more than they save (2 threads, AVX2 EPYC, 49152 columns:
    argmax 51 / 56 / 101 us at 1 / 2 / 4 rows against 89 / 93 / 108, then 197 against 137 at 8), so argmax runs.

    Args:
        logits: [N, vocab] float, any device.

    Returns:
        [N] int64 on the logits' device, equal to `logits.argmax(dim=-1)`.
    """
    n, vocab = logits.shape
    if vocab <= 2 * chunk or n < TWO_PASS_ROWS or logits.device.type != "cpu":  # a GPU: one kernel, no host sync
        return logits.argmax(dim=-1)
    whole = vocab // chunk * chunk
    maxima = logits[:, :whole].reshape(n, -1, chunk).amax(dim=-1)  # [N, whole / chunk]
    if whole < vocab:
        maxima = torch.cat((maxima, logits[:, whole:].amax(dim=-1, keepdim=True)), dim=1)
    row_max = maxima.amax(dim=-1, keepdim=True)
    if torch.isnan(row_max).any():  # NaN != NaN would hide the chunk: keep torch's own semantics for such rows
        return logits.argmax(dim=-1)
    first = (maxima == row_max).to(torch.uint8).argmax(dim=-1, keepdim=True)  # the first chunk holding the max
    cols = (first * chunk + torch.arange(chunk, device=logits.device)).clamp_(max=vocab - 1)  # tail: repeats the last
    return cols.gather(1, logits.gather(1, cols).argmax(dim=-1, keepdim=True)).squeeze(1)


def _apply_penalties(row: torch.Tensor, req: Request) -> None:
    """In place. Repetition (CTRL, Keskar et al. 2019; HF convention) over prompt + output; presence/frequency
    (OpenAI API definition) over output only."""
    sp = req.sampling
    if sp.repetition_penalty != 1.0:
        ids = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long)
        vals = row[ids]
        row[ids] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
    if (sp.presence_penalty or sp.frequency_penalty) and req.output_token_ids:
        counts = torch.bincount(torch.tensor(req.output_token_ids, dtype=torch.long), minlength=row.numel()).float()
        row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).float()
