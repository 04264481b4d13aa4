"""No request can fail another inside an engine: parameters that overflow, a row whose sampling raises, bad token
ids and a faulting step each stay with the request(s) that caused them."""
import asyncio
import random

import pytest

from conftest import hf_greedy
from pdserve_server.engine.args import EngineArgs
from pdserve_server.engine.core.async_engine import AsyncEngine
from pdserve_server.engine.builder import build_engine
from pdserve_server.engine.core.engine_core import EngineCore
from pdserve_server.engine.errors import EngineError, ErrorKind
from pdserve_server.engine.offline import run_until_idle
from pdserve_server.engine.outputs import RequestFailed
from pdserve_server.engine.request import Request, SamplingParams

ARGS = dict(block_size=8, kv_tokens=2048, max_model_len=512)


@pytest.fixture
def parts(tiny_model_dir):
    return build_engine(EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), **ARGS))


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(3, 30))] for _ in range(n)]


def run(parts, requests):
    """Step to completion; returns the failure events by request id."""
    failures = {ev.request_id: ev for ev in run_until_idle(parts, requests) if isinstance(ev, RequestFailed)}
    pool = parts.scheduler.kv.pool
    assert pool.integrity_errors() == [] and pool.num_free_blocks == pool.num_blocks
    return failures


@pytest.mark.parametrize("extreme", [
    dict(temperature=1e-37), dict(temperature=1e-38), dict(temperature=1e-45),
    dict(temperature=1.0, repetition_penalty=1e-38), dict(temperature=0.7, repetition_penalty=1e38),
    dict(temperature=1e-45, repetition_penalty=1e-38, logprobs=5),
])
def test_extreme_but_valid_sampling_fails_nobody(parts, tiny_model_dir, extreme):
    """These overflowed to inf/NaN and the step handler aborted the whole batch (8 bystanders got UNAVAILABLE)."""
    honest = [Request(f"h{i}", p, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
              for i, p in enumerate(prompts(8))]
    odd = Request("odd", prompts(1, seed=9)[0], SamplingParams(max_tokens=5, ignore_eos=True, seed=1, **extreme))
    assert run(parts, [*honest, odd]) == {}
    for req in honest:
        assert req.output_token_ids == hf_greedy(tiny_model_dir, req.prompt_token_ids, 5)
    assert len(odd.output_token_ids) == 5
    if extreme.get("temperature") == 1e-45 and "repetition_penalty" not in extreme:
        assert odd.output_token_ids == hf_greedy(tiny_model_dir, odd.prompt_token_ids, 5)  # tends to greedy


def test_a_row_whose_sampling_raises_fails_only_its_request(parts, tiny_model_dir, monkeypatch):
    sampler = parts.runner.sampler
    draw = sampler._draw

    def faulty(row, req):
        if req.request_id == "bad":
            raise RuntimeError("injected")
        return draw(row, req)

    monkeypatch.setattr(sampler, "_draw", faulty)
    honest = [Request(f"h{i}", p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
              for i, p in enumerate(prompts(4))]
    bad = Request("bad", prompts(1, seed=3)[0], SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True))
    failures = run(parts, [*honest, bad])
    assert list(failures) == ["bad"] and "injected" in failures["bad"].message
    for req in honest:
        assert req.output_token_ids == hf_greedy(tiny_model_dir, req.prompt_token_ids, 4)


def test_token_ids_outside_the_vocabulary_are_refused_at_admission(parts):
    """An out-of-vocabulary id reached the embedding lookup and failed the step for every bystander."""
    s = parts.scheduler
    failure = s.add_request(Request("oov", [5, 49152], SamplingParams(max_tokens=3)))
    assert failure.kind == ErrorKind.INVALID_REQUEST and "49152" in failure.message
    remote = Request("r", [5, 6, 7], SamplingParams(max_tokens=3), remote_kv=True)
    assert s.add_request(remote) is None and s.reserve()
    failure = s.kv_arrived("r", 10 ** 6)
    assert failure.kind == ErrorKind.INVALID_REQUEST and s.num_requests() == 0
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


@pytest.mark.parametrize("bad", [dict(temperature=float("nan")), dict(temperature=float("inf")), dict(top_p=0.0),
                                 dict(max_tokens=0), dict(min_tokens=9), dict(logprobs=21)])
def test_worker_side_sampling_validation(bad):
    with pytest.raises(EngineError) as e:
        SamplingParams(**{"max_tokens": 4, **bad})
    assert e.value.kind == ErrorKind.INVALID_REQUEST


def test_a_faulting_step_fails_its_batch_reports_once_and_the_engine_serves_on(parts, monkeypatch):
    execute = parts.runner.execute
    fault = {"armed": True}

    def flaky(out):
        if fault["armed"]:
            fault["armed"] = False
            raise RuntimeError("injected device fault")
        return execute(out)

    monkeypatch.setattr(parts.runner, "execute", flaky)

    async def main():
        faults = []
        engine = AsyncEngine(lambda emit, on_fault: EngineCore(parts.scheduler, parts.runner, emit, on_fault))
        engine.add_fault_listener(faults.append)
        engine.start()
        try:
            with engine.request(Request("victim", [5, 6, 7], SamplingParams(max_tokens=3))) as stream:
                with pytest.raises(EngineError) as e:
                    await stream.next()
                assert e.value.kind == ErrorKind.INTERNAL
            with engine.request(Request("after", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0))) as stream:
                events = []
                while not events or events[-1].finish_reason is None:
                    events += await stream.next_batch()
            assert len(events) == 3
            await asyncio.sleep(0.05)
            assert len(faults) == 1 and "injected device fault" in faults[0]
        finally:
            engine.stop()

    asyncio.run(main())
