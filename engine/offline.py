"""Offline generation on a built engine, in the calling thread: no server, no engine thread, no transfer.

What tests and benchmarks use to run the scheduler and model runner directly (vLLM's `LLM.generate` plays this
role there). A worker never calls it: `engine.core.engine_core.EngineCore` owns the loop in a serving process.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pdserve_server.engine.builder import EngineParts
from pdserve_server.engine.outputs import RequestFailed, SchedulerOutput, TokenOutput
from pdserve_server.engine.request import Request, SamplingParams


def run_until_idle(parts: EngineParts, requests: Sequence[Request] = (),
                   on_step: Callable[[SchedulerOutput], None] | None = None,
                   max_steps: int | None = None) -> list[TokenOutput | RequestFailed]:
    """Admit `requests`, then schedule -> execute -> update until the scheduler has no work left.

    Args:
        on_step: called with each step's SchedulerOutput before it executes (e.g. to watch for chunked prefill).
        max_steps: bound on the steps; None for no bound.

    Returns:
        every event the scheduler emitted, in order (tokens, and RequestFailed for requests that failed or were
        refused for their deadline).

    Raises:
        ValueError: a request was refused at admission (the message gives its id and the failure).
        RuntimeError: a step scheduled nothing while work remained (the scheduler stalled), or max_steps passed.
    """
    sched, runner = parts.scheduler, parts.runner
    for req in requests:
        refused = sched.add_request(req)
        if refused is not None:
            raise ValueError(f"request {req.request_id} refused: {refused.kind.name}: {refused.message}")
    events: list[TokenOutput | RequestFailed] = []
    steps = 0
    while sched.has_work():
        out = sched.schedule()
        events += out.failed  # refused for their deadline
        if out.is_empty and not sched.has_work():
            break
        if out.is_empty:
            raise RuntimeError(f"the scheduler stalled with work left after {steps} steps")
        if on_step is not None:
            on_step(out)
        start = time.perf_counter()
        events += sched.update(out, runner.execute(out))
        sched.observe_step(out, (time.perf_counter() - start) * 1e3)  # as the engine loop does: step costs learnt
        steps += 1
        if max_steps is not None and steps >= max_steps and sched.has_work():
            raise RuntimeError(f"work left after max_steps={max_steps} steps")
    return events


def generate(parts: EngineParts, waves: Sequence[Sequence[list[int]]], params: SamplingParams,
             request_prefix: str = "r") -> list[list[int]]:
    """Output token ids for prompts given as waves: each wave is admitted at once (one batch) and run to completion
    before the next, so `[[p] for p in prompts]` runs them one at a time and `[prompts]` all together.

    Args:
        waves: lists of prompts (token ids).
        params: the sampling parameters of every request; EOS is the model's (`ModelConfig.eos_token_ids`) unless
            `params.ignore_eos`.

    Returns:
        the outputs of every request, waves in order and prompts in order within a wave.

    Raises:
        ValueError / RuntimeError: from `run_until_idle`.
    """
    eos = parts.model_config.eos_token_ids
    outputs: list[list[int]] = []
    for w, wave in enumerate(waves):
        reqs = [Request(f"{request_prefix}{w}-{i}", prompt, params, eos_token_ids=eos)
                for i, prompt in enumerate(wave)]
        run_until_idle(parts, reqs)
        outputs += [req.output_token_ids for req in reqs]
    return outputs
