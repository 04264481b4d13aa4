"""What a worker refuses at once, before a request queues: requests that are malformed, or that could never fit its
context or its KV pool. Pure checks over the request, the step limits and the pool's geometry (`Scheduler.add_request`
calls them; duplicate ids and structured-output constraints are the scheduler's, which holds the state they need)."""
from __future__ import annotations

from pdserve_server.engine.config import SchedulerConfig
from pdserve_server.engine.errors import ErrorKind
from pdserve_server.engine.scheduling.kv_cache_manager import KVCacheManager
from pdserve_server.engine.outputs import RequestFailed
from pdserve_server.engine.request import SAMPLE_ID_SEPARATOR, Request


def max_context(req: Request) -> int:
    """Tokens the request may hold: a prefill-only request computes what it has (prompt, and output a lost worker
    had generated) plus one; a decode request its prompt plus max_tokens outputs, however many it brings."""
    return req.num_tokens + 1 if req.prefill_only else req.num_prompt_tokens + req.sampling.max_tokens


def refusal(request: Request, config: SchedulerConfig, kv: KVCacheManager, max_chunk: int) -> RequestFailed | None:
    """Why the request can never run here (INVALID_REQUEST or CAPACITY, with a message that says what to change),
    or None.

    Args:
        request: the request as it arrives.
        config: the worker's vocabulary and context limits.
        kv: the KV pool (block size, usable blocks, sliding window).
        max_chunk: most tokens one step computes for this request (`Scheduler._chunk_limit`): under a sliding
            window, what it holds at its peak depends on it.
    """
    if not request.prompt_token_ids:
        return RequestFailed(request.request_id, ErrorKind.INVALID_REQUEST, "the prompt is empty")
    if SAMPLE_ID_SEPARATOR in request.request_id:
        return RequestFailed(request.request_id, ErrorKind.INVALID_REQUEST, "the request id contains a NUL character")
    if request.sampling.n > 1 and (failure := _parallel_refusal(request)):
        return failure
    # An embedding lookup out of range would fail the whole step, not just this request: the prompt and the output a
    # migrated request brings (generated elsewhere, computed here as context) are checked alike.
    for field, ids in (("prompt", request.prompt_token_ids), ("output_token_ids", request.output_token_ids)):
        bad = next((t for t in ids if not 0 <= t < config.vocab_size), None)
        if bad is not None:
            return RequestFailed(request.request_id, ErrorKind.INVALID_REQUEST,
                                 f"token id {bad} in {field} is outside the vocabulary [0, {config.vocab_size})")
    need = max_context(request)
    if need > config.max_model_len:
        return RequestFailed(request.request_id, ErrorKind.INVALID_REQUEST,
                             f"prompt ({request.num_prompt_tokens}) + max_tokens exceeds max_model_len "
                             f"{config.max_model_len}")
    # n samples share the prompt's full blocks (but the last token's); each holds the rest on its own. Under a
    # sliding window each holds at most its window's blocks, however long it grows.
    n = request.sampling.n
    shared = (request.num_prompt_tokens - 1) // kv.block_size if n > 1 else 0
    blocks = min(shared + n * (kv.blocks_needed(need) - shared), n * kv.peak_blocks(need, max_chunk))
    if blocks > kv.num_usable_blocks:
        return RequestFailed(request.request_id, ErrorKind.CAPACITY,
                             f"request needs {blocks} KV blocks, the pool has {kv.num_usable_blocks}; lower "
                             "max_tokens (or n) or raise the KV budget")
    return None


def _parallel_refusal(request: Request) -> RequestFailed | None:
    """A parallel-sampling request (n > 1) forks where it decodes, from a prompt it computed itself."""
    why = ("a prefill-only request" if request.prefill_only else
           "a request whose prompt KV comes from a prefill worker" if request.remote_kv else
           "a resumed request (output_token_ids)" if request.output_token_ids else None)
    if why is None:
        return None
    return RequestFailed(request.request_id, ErrorKind.INVALID_REQUEST,
                         f"n = {request.sampling.n} (parallel sampling) cannot be {why}: the samples fork from a "
                         "prompt computed on the worker that decodes them")
