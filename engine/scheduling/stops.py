"""When a request stops: the one rule every sampled token is checked against (`Scheduler`, after each token)."""
from __future__ import annotations

from pdserve_server.engine.request import FinishReason, Request


def stop_after(req: Request, token_id: int, max_model_len: int) -> tuple[FinishReason | None, int | None]:
    """(finish reason, the stop token that matched) once `token_id` has been appended to req's output, or
    (None, None) while it goes on.

    In order: an EOS token (unless ignore_eos) or one of `stop_token_ids` once more than min_tokens are out (STOP,
    that token); a structured-output constraint that allows nothing more (STOP; the token named when it is an EOS
    or stop token); max_tokens out or the context at max_model_len tokens (LENGTH); a prefill-only request after
    its first token (PREFILL_DONE: its blocks are held for the transfer).
    """
    sp = req.sampling
    num_out = len(req.output_token_ids)
    # The sampler masks stop tokens while num_out <= min_tokens; checking again keeps the rule in one place.
    if num_out > sp.min_tokens and (
            (not sp.ignore_eos and token_id in req.eos_token_ids) or token_id in sp.stop_token_ids):
        return FinishReason.STOP, token_id
    if req.matcher is not None and req.matcher.stopped:  # the constraint's language allows nothing more
        named = token_id in req.eos_token_ids or token_id in sp.stop_token_ids
        return FinishReason.STOP, token_id if named else None
    if num_out >= sp.max_tokens or req.num_tokens >= max_model_len:
        return FinishReason.LENGTH, None
    if req.prefill_only:
        return FinishReason.PREFILL_DONE, None
    return None, None
