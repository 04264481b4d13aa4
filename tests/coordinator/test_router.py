"""Routing decisions, on handles without servers: per-role rotation, KV headroom, queue depth, leases."""
import grpc
import pytest

from pdserve_server.coordinator.errors import RequestError
from pdserve_server.coordinator.membership import Cluster
from pdserve_server.coordinator.prefix_index import block_hashes
from pdserve_server.coordinator.router import LocalPrefillPolicy, Router, WorkerHandle
from pdserve.v1 import worker_pb2


def handle(name: str, role: str, num_blocks: int = 100, block_size: int = 16) -> WorkerHandle:
    info = worker_pb2.WorkerInfo(role=role, num_blocks=num_blocks, block_size=block_size)
    return WorkerHandle(name, None, None, None, None, info=info, live=True)


def two_by_two() -> Router:
    return Router([handle("p0", "prefill"), handle("p1", "prefill")],
                  [handle("d0", "decode"), handle("d1", "decode")])


def stats(free: int, running: int = 0, waiting: int = 0) -> worker_pb2.WorkerStats:
    return worker_pb2.WorkerStats(num_total_blocks=100, num_free_blocks=free, num_running=running,
                                  num_waiting=waiting)


def route(router: Router, num_tokens: int = 32) -> tuple[str, str]:
    return router.pick_prefill([1] * 8).address, router.pick_decode(num_tokens).address


def test_one_request_at_a_time_uses_every_worker_of_each_role():
    """Each role rotates on its own: with one shared counter every request went to the same pair."""
    router = two_by_two()
    pairs = []
    for _ in range(4):
        pairs.append(route(router))
        for w in router.workers:  # as after a stats poll: the request finished and its blocks are free again
            w.stats, w.blocks_routed = stats(100), 0
    assert {p for p, _ in pairs} == {"p0", "p1"} and {d for _, d in pairs} == {"d0", "d1"}


def test_concurrent_requests_spread_by_in_flight_count():
    router = two_by_two()
    with router.lease(router.pick_decode(32)) as first, router.lease(router.pick_decode(32)) as second:
        assert first is not second
        with router.lease(router.pick_prefill([1])) as p0, router.lease(router.pick_prefill([1])) as p1:
            assert p0 is not p1
    assert all(w.in_flight == 0 for w in router.workers)


def test_decode_prefers_kv_headroom_and_avoids_a_worker_that_cannot_hold_the_request():
    router = two_by_two()
    d0, d1 = router.decode
    d0.stats, d1.stats = stats(free=90), stats(free=10)
    assert router.pick_decode(16).address == "d0"  # more free blocks at equal load
    d0.in_flight = 5
    assert router.pick_decode(16).address == "d1"  # running batch first, while the request fits
    assert router.pick_decode(16 * 20).address == "d0"  # 20 blocks: only d0 can hold it


def test_blocks_routed_between_polls_count_against_headroom():
    router = two_by_two()
    d0, d1 = router.decode
    d0.stats, d1.stats = stats(free=50), stats(free=45)
    assert router.pick_decode(16 * 10).address == "d0"  # 50 -> 40 estimated
    assert router.pick_decode(16 * 10).address == "d1"  # 45 > 40


def test_prefill_prefers_the_least_queued_work():
    router = two_by_two()
    p0, p1 = router.prefill
    with router.lease(p0, num_tokens=64):  # 4 blocks queued on p0
        assert router.pick_prefill([1] * 16).address == "p1"
    router.prefixes.forget("p1")
    p1.stats = stats(free=100, waiting=3)
    assert router.pick_prefill(list(range(500, 516))).address == "p0"  # equal work: the shorter reported queue


def test_prefill_goes_where_the_prefix_is_cached_unless_that_worker_is_swamped():
    """Dynamo's cost: blocks to compute (prompt minus cached prefix) plus blocks queued."""
    router = two_by_two()
    system = list(range(100, 100 + 32 * 16))  # a 32-block shared system prompt
    first = router.pick_prefill(system + [1, 2, 3])
    for i in range(4):  # the same prefix follows the worker that has it, whatever the rotation says
        assert router.pick_prefill(system + [7 + i]).address == first.address
    other = next(w for w in router.prefill if w is not first)
    assert router.pick_prefill(list(range(5000, 5016))).address in {first.address, other.address}
    with router.lease(first, num_tokens=40 * 16):  # 40 blocks queued there: recomputing 32 elsewhere is cheaper
        assert router.pick_prefill(system + [99]).address == other.address


@pytest.mark.parametrize("offload_blocks", [0, 1000])
def test_the_inferred_prefix_index_counts_a_workers_offload_tiers(offload_blocks):
    """A worker whose tiers keep what its 100-block pool evicts (`WorkerInfo.kv_offload_blocks`) still holds a
    conversation after 200 blocks of other prompts went through it, in the routing's index as in the worker;
    without tiers the index forgets it, as the worker did."""
    worker = handle("p0", "prefill")
    worker.info.kv_offload_blocks = offload_blocks
    router = Router([worker], [handle("d0", "decode")])
    conversation = list(range(100, 100 + 20 * 16))
    router.pick_prefill(conversation)
    for i in range(10):
        router.pick_prefill(list(range(10_000 + 320 * i, 10_320 + 320 * i)))
    held = router.prefixes.overlap("p0", block_hashes(conversation + [1], 16))
    assert held == (20 if offload_blocks else 0)


def test_colocated_choice_is_prefix_aware_too():
    router = Router([], [handle("c0", "colocated"), handle("c1", "colocated")])
    prompt = list(range(300, 300 + 8 * 16))
    first = router.pick_decode(len(prompt) + 16, prompt)
    for w in router.decode:
        w.stats, w.blocks_routed = stats(100), 0
    assert router.pick_decode(len(prompt) + 16, prompt + [5]).address == first.address


def test_lease_is_given_back_on_error():
    router = two_by_two()
    worker = router.decode[0]
    with pytest.raises(RuntimeError):
        with router.lease(worker):
            assert worker.in_flight == 1
            raise RuntimeError("boom")
    assert worker.in_flight == 0


def test_no_worker_of_a_role_is_unavailable():
    with pytest.raises(RequestError) as e:
        Router([], [handle("d0", "decode")]).pick_prefill([1])
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_local_prefill_for_short_uncached_prompts_and_when_no_prefill_worker_is_live():
    router = two_by_two()
    short = LocalPrefillPolicy(max_uncached_tokens=8)
    prompt = list(range(40))  # 2 full blocks of 16 + 8 tokens
    assert router.local_prefill(prompt, short) is None  # 40 uncached > 8
    assert router.local_prefill(prompt[:8], short) == "short"
    router.record_prefix(router.decode[1], prompt)  # d1 received the prompt's KV: 32 tokens cached there
    assert router.local_prefill(prompt, short) == "short"  # the best decode worker has 8 to compute
    assert router.local_prefill(prompt + [1], short) is None  # 9
    assert router.local_prefill(prompt, LocalPrefillPolicy()) is None  # 0: never for length
    router.record_prefix(router.prefill[0], list(range(100, 140)))  # a prefill worker's cache does not count
    assert router.local_prefill(list(range(100, 140)), short) is None

    router.decode[0].info.kv_sliding_window = 16  # its window gives back the leading blocks of KV it receives:
    router.record_prefix(router.decode[0], list(range(200, 240)), received=True)  # nothing it could hit
    assert router.local_prefill(list(range(200, 240)), short) is None
    router.record_prefix(router.decode[0], list(range(200, 240)))  # computed there: every full block is cached
    assert router.local_prefill(list(range(200, 240)), short) == "short"

    for w in router.prefill:
        w.live = False
    assert router.local_prefill(prompt + [1], LocalPrefillPolicy()) == "no_prefill_worker"
    assert router.local_prefill(prompt + [1], LocalPrefillPolicy(fallback=False)) is None  # pick_prefill: UNAVAILABLE
    assert router.local_prefill(prompt[:8], LocalPrefillPolicy(8, fallback=False)) == "short"  # still served
    for w in router.decode:
        w.live = False
    assert router.local_prefill(prompt, short) is None  # pick_decode names the missing role


def test_readiness_without_a_prefill_worker_follows_the_fallback():
    router = two_by_two()
    for w in router.prefill:
        w.live = False
    assert Cluster(router, colocated=False, local_prefill=LocalPrefillPolicy(fallback=True)).ready
    assert not Cluster(router, colocated=False, local_prefill=LocalPrefillPolicy(fallback=False)).ready
    assert not Cluster(router, colocated=False, local_prefill=LocalPrefillPolicy(fallback=True)).complete  # start waits
    for w in router.decode:
        w.live = False
    assert not Cluster(router, colocated=False, local_prefill=LocalPrefillPolicy(fallback=True)).ready


def test_prefill_queue_measures_its_rate_and_predicts_the_wait():
    from pdserve_server.coordinator.prefill_queue import PrefillQueue

    now = [0.0]
    q = PrefillQueue()
    assert q.predicted_wait_s(100) is None and q.predicted_wait_s(100, prior_tokens_per_s=50.0) == 2.0
    with q.track(300, clock=lambda: now[0]) as first:
        with q.track(100, clock=lambda: now[0]) as second:  # queued behind the first
            assert q.pending_tokens == 400
            now[0] = 3.0
            first()  # 300 tokens in 3 s
            assert q.pending_tokens == 100 and q.tokens_per_s == 100.0
            now[0] = 5.0
            second()  # 300 ahead + 100 own in 5 s: 80 tok/s, smoothed
            first()  # once only
    assert q.pending_tokens == 0 and q.tokens_per_s == 0.3 * 80.0 + 0.7 * 100.0
    with pytest.raises(RuntimeError), q.track(50, clock=lambda: now[0]):
        raise RuntimeError("the call failed before its first token")
    assert q.pending_tokens == 0 and q.tokens_per_s == 94.0  # tokens given back, no sample
    q.pending_tokens = 188
    assert q.predicted_wait_s(94) == 3.0


def test_local_prefill_while_the_prefill_queue_is_slower_and_back_once_it_drains():
    """Conditional disaggregation on live queue state: with prompts queued on the prefill worker, a
    decode worker that would give the first token sooner prefills locally; once the prefill queue drains (or the
    decode worker's own local backlog makes it the slower one) requests are disaggregated again."""
    router = Router([handle("p0", "prefill")], [handle("d0", "decode")])
    p0, d0 = router.prefill[0], router.decode[0]
    policy = LocalPrefillPolicy()
    prompt = list(range(1000))
    assert router.local_prefill(prompt, policy) is None  # nothing measured yet
    p0.prefill_queue.tokens_per_s = 1000.0
    assert router.local_prefill(prompt, policy) is None  # no queue: disaggregate
    p0.prefill_queue.pending_tokens = 3000  # three long prompts queued: 4 s for this one there
    assert router.local_prefill(prompt, policy) == "queue"  # d0, unmeasured, taken as fast: 1 s
    d0.prefill_queue.tokens_per_s = 300.0  # measured: prefilling beside its decode batch, d0 is slower
    assert router.local_prefill(prompt, policy) == "queue"  # 3.3 s < 4 s
    d0.prefill_queue.pending_tokens = 1000  # one local prefill under way: 6.7 s there
    assert router.local_prefill(prompt, policy) is None
    d0.prefill_queue.pending_tokens = 0
    assert router.local_prefill(prompt, LocalPrefillPolicy(queue=False)) is None  # the rule can be turned off
    p0.prefill_queue.pending_tokens = 0  # the queue drained
    assert router.local_prefill(prompt, policy) is None


def test_limits_before_any_worker_was_seen_are_unavailable():
    """GetModelInfo under load answered UNKNOWN ("no worker has been seen yet"): it is UNAVAILABLE, retryable."""
    cluster = Cluster(two_by_two(), colocated=False)
    for w in cluster.router.workers:
        w.live = False
    with pytest.raises(RequestError) as e:
        cluster.limits
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_windowed_workers_requests_count_only_their_windows_blocks_against_headroom():
    """A decode worker whose blocks go back behind a sliding window advertises the most blocks a request holds at
    once (WorkerInfo.max_request_blocks): a 2000-token request counts 10 blocks there, not 125, so it neither looks
    too big for the worker nor uses up its headroom until the next poll."""
    router = two_by_two()
    d0, d1 = router.decode
    d0.info.max_request_blocks = 10
    d0.stats, d1.stats = stats(free=50), stats(free=40)
    assert router.pick_decode(2000).address == "d0"
    assert d0.blocks_routed == 10
    assert router.pick_decode(2000).address == "d0"  # 40 left estimated: still room for 10, d1 has none for 125
