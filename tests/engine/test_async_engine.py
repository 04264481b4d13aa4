"""One owner per request: leaving `engine.request(...)` frees what the engine holds, on every exit path."""
import asyncio

import pytest

from pdserve_server.engine.args import EngineArgs
from pdserve_server.engine.core.async_engine import AsyncEngine
from pdserve_server.engine.builder import build_engine
from pdserve_server.engine.core.engine_core import EngineCore
from pdserve_server.engine.errors import EngineError, ErrorKind
from pdserve_server.engine.outputs import TokenOutput
from pdserve_server.engine.request import FinishReason, Request, SamplingParams


def greedy(rid, n=50, **kw):
    return Request(rid, list(range(5, 45)), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), **kw)


async def idle(engine: AsyncEngine) -> tuple[int, int, list]:
    """(requests the engine knows, blocks in use, integrity errors), once commands queued so far are applied."""
    return await engine.call(lambda s: (s.num_requests(), s.kv.pool.num_blocks - s.kv.pool.num_free_blocks,
                                        s.kv.pool.integrity_errors()))


@pytest.fixture
def run(tiny_model_dir):
    parts = build_engine(EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), block_size=8, kv_tokens=1024,
                                    max_model_len=512))

    def go(scenario, max_unread_tokens=0):
        async def main():
            engine = AsyncEngine(lambda emit, on_fault: EngineCore(parts.scheduler, parts.runner, emit, on_fault),
                                 max_unread_tokens=max_unread_tokens)
            engine.start()
            try:
                await scenario(engine)
                assert await idle(engine) == (0, 0, [])
            finally:
                engine.stop()
        asyncio.run(main())
    return go


def test_leaving_early_frees_the_request(run):
    async def scenario(engine):
        with engine.request(greedy("a")) as stream:
            ev = await stream.next()
            assert isinstance(ev, TokenOutput) and ev.finish_reason is None
    run(scenario)


def test_error_inside_the_block_frees_the_request(run):
    async def scenario(engine):
        with pytest.raises(RuntimeError):
            with engine.request(greedy("a")) as stream:
                await stream.next()
                raise RuntimeError("the handler failed")
    run(scenario)


def test_cancelled_task_frees_the_request(run):
    async def scenario(engine):
        started = asyncio.Event()

        async def reader():
            with engine.request(greedy("a", n=400)) as stream:
                await stream.next()
                started.set()
                while True:
                    await stream.next_batch()

        task = asyncio.create_task(reader())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    run(scenario)


def test_finished_request_is_not_aborted_twice_and_prefill_blocks_are_released(run):
    async def scenario(engine):
        with engine.request(greedy("done", n=3)) as stream:
            batch = []
            while not batch or batch[-1].finish_reason is None:
                batch = await stream.next_batch()
            assert batch[-1].finish_reason == FinishReason.LENGTH and stream.dropped
        with engine.request(greedy("p", prefill_only=True)) as stream:
            ev = await stream.next()
            assert ev.finish_reason == FinishReason.PREFILL_DONE and ev.block_ids
            assert (await idle(engine))[1] == len(ev.block_ids)  # HELD until the owner leaves
    run(scenario)


def test_external_abort_ends_the_stream_with_aborted(run):
    async def scenario(engine):
        with engine.request(greedy("a", n=400)) as stream:
            await stream.next()
            engine.abort("a")
            with pytest.raises(EngineError) as e:
                while True:
                    await stream.next_batch()
            assert e.value.kind == ErrorKind.ABORTED
    run(scenario)


def test_external_abort_leaves_blocks_under_a_kv_send_alone(run):
    """A prefill-done request's blocks are read by its KV transfer until its owner leaves: Worker.Abort used to
    free them under the send (another request could then overwrite KV in flight) and say found."""
    async def scenario(engine):
        with engine.request(greedy("p", prefill_only=True)) as stream:
            ev = await stream.next()
            assert ev.finish_reason == FinishReason.PREFILL_DONE
            assert await engine.abortable("p") is False  # what Worker.Abort answers as `found`
            engine.abort("p")
            assert await idle(engine) == (1, len(ev.block_ids), [])  # still held, intact
        assert (await idle(engine))[:2] == (0, 0)  # the owner freed them on leaving
    run(scenario)


def test_hand_over_moves_the_free_to_the_new_owner(run):
    async def scenario(engine):
        with engine.request(greedy("r", remote_kv=True)) as stream:
            reserved = await stream.next()
            free = stream.hand_over()
        assert (await idle(engine))[1] == len(reserved.block_ids)  # still reserved: the receiver owns it now
        free()
    run(scenario)


def test_duplicate_id_while_owned_is_refused(run):
    async def scenario(engine):
        with engine.request(greedy("a")) as stream:
            with pytest.raises(EngineError) as e:
                with engine.request(greedy("a")):
                    pass
            assert e.value.kind == ErrorKind.DUPLICATE_REQUEST
            await stream.next()
    run(scenario)


def test_the_engine_thread_runs_torch_on_its_own_thread_count(tiny_model_dir):
    """Under OpenMP torch's thread count is per thread: the worker's intra-op threads must be set on the engine
    thread, where the steps run, whatever the thread that built the engine uses (`engine.hardware.set_threads`)."""
    import torch

    parts = build_engine(EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), block_size=8, kv_tokens=1024,
                                    max_model_len=512))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        async def main():
            engine = AsyncEngine(lambda emit, on_fault: EngineCore(parts.scheduler, parts.runner, emit, on_fault,
                                                                   threads=2))
            engine.start()
            try:
                return await engine.call(lambda s: torch.get_num_threads())
            finally:
                engine.stop()
        assert asyncio.run(main()) == 2
        assert torch.get_num_threads() == 1  # this thread's own count is left alone
    finally:
        torch.set_num_threads(before)


def test_a_stream_left_unread_pauses_its_request_and_resumes_with_every_token(run):
    """Back-pressure: a reader that stops taking tokens gets its request paused once 8 wait
    unread: it decodes no more while another request runs 40 steps, and, read again, it resumes and finishes with
    the tokens of an undisturbed run."""
    async def undisturbed(engine):
        with engine.request(greedy("ref", n=40)) as stream:
            return [ev.token.token_id for ev in await read_all(stream)]

    async def read_all(stream):
        events = []
        while not events or events[-1].finish_reason is None:
            events += await stream.next_batch()
        return events

    async def scenario(engine):
        expected = await undisturbed(engine)
        with engine.request(greedy("slow", n=40)) as slow:
            await slow.next()  # running
            for _ in range(200):  # bounded: until the pause is applied
                if await engine.call(lambda s: "slow" in s.paused):
                    break
                await asyncio.sleep(0.01)
            else:
                pytest.fail("the unread request was never paused")
            unread = slow._unread
            assert 7 <= unread < 40
            with engine.request(greedy("other", n=40)) as other:
                assert len(await read_all(other)) == 40
            assert slow._unread == unread and await engine.call(lambda s: s.make_stats(0).num_paused) == 1
            tokens = [expected[0]] + [ev.token.token_id for ev in await read_all(slow)]
        assert tokens == expected
    run(scenario, max_unread_tokens=8)
