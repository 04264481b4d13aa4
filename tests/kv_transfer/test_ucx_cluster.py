"""A cluster on the ucx connector under mass and random cancellation: before KvSender stopped
tearing channels down mid-operation, the prefill worker segfaulted inside ucxx when 64 in-flight requests were
cancelled at once, and requests stalled to their deadline under random cancellations."""
import asyncio
import random

import pytest

from conftest import hf_greedy
from pdserve import AsyncClient
from helpers import assert_idle, generate_with_random_cancels, greedy

pytestmark = pytest.mark.e2e

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def ucx_cluster(tiny_model_dir, launch_module):
    return launch_module(tiny_model_dir, worker_args=["--connector", "ucx", "--dtype", "float32", "--kv-tokens",
                                                      "8192", "--max-model-len", "256"])


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(4, 120))] for _ in range(n)]


def _alive(cluster) -> None:
    dead = {name: p.returncode for name, p in cluster.processes.items() if p.poll() is not None}
    assert not dead, f"processes died: {dead}"


def test_cancel_64_in_flight_at_once(ucx_cluster, tiny_model_dir):
    prompts = _prompts(64, 1)

    async def main():
        first_tokens = 0
        half = asyncio.Event()

        async def one(c, p, i):
            nonlocal first_tokens
            async for _ in c.generate(p, greedy(MAX_TOKENS, ignore_eos=True), request_id=f"mass-{i}"):
                first_tokens += 1
                if first_tokens >= len(prompts) // 2:
                    half.set()

        async with AsyncClient(ucx_cluster.address) as c:
            tasks = [asyncio.create_task(one(c, p, i)) for i, p in enumerate(prompts)]
            await asyncio.wait_for(half.wait(), 120)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    assert_idle(ucx_cluster)
    _alive(ucx_cluster)
    check = _prompts(1, 2)[0]

    async def after():
        async with AsyncClient(ucx_cluster.address) as c:
            return await c.complete(check, greedy(8, ignore_eos=True))
    assert asyncio.run(after()).token_ids == hf_greedy(tiny_model_dir, check, 8)


def test_random_cancellations_none_stall(ucx_cluster):
    """200 requests, about two thirds cancelled at a random point: every stream ends promptly (none waits for a
    deadline), and the pools return to idle."""
    # One timeout for the whole run, far below 200 x a request's 60 s deadline: a stall fails it.
    generate_with_random_cancels(ucx_cluster.address, _prompts(200, 3), random.Random(3), max_tokens=(2, MAX_TOKENS),
                                 cancel_after=[None, 0, 0, 1, 2, 5], concurrency=32, total_timeout_s=240,
                                 id_prefix="rand", call_timeout_s=60)
    assert_idle(ucx_cluster)
    _alive(ucx_cluster)
