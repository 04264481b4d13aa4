"""The scheduling policy (priorities, fairness between tenants, deadlines), driven without a model.

A fake step stands in for the model: each request that samples gets `fake_token(context)`, a deterministic function
of its tokens so far, as greedy decoding is of the context. A request preempted and recomputed must therefore emit the
very tokens an undisturbed run emits. Bounds are counted in steps, never in seconds.
"""
import dataclasses
import math
import time

import pytest

from pdserve_server.engine.config import SchedulerConfig
from pdserve_server.engine.errors import ErrorKind
from pdserve_server.engine.scheduling.kv_cache_manager import KVCacheManager
from pdserve_server.engine.outputs import RequestFailed, RunnerOutput, SampledToken, SchedulerOutput
from pdserve_server.engine.scheduling.policy import RequestQueue, SchedulingPolicy
from pdserve_server.engine.request import Request, RequestStatus, SamplingParams, SchedulingParams
from pdserve_server.engine.scheduling.scheduler import Scheduler

BLOCK = 4


def scheduler(num_blocks=256, budget=16, max_seqs=4) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=512,
                             enable_prefix_caching=False, vocab_size=1000)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK, False))


def request(rid, prompt_len, max_tokens=8, first=10, **scheduling) -> Request:
    prompt = [(first + 7 * i) % 997 + 3 for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                   scheduling=SchedulingParams(**scheduling))


def fake_token(context: list[int]) -> int:
    """A stand-in for greedy decoding: the next token is a function of the whole context."""
    return (sum(t * (i + 1) for i, t in enumerate(context[-16:])) + len(context)) % 997 + 3


def step(s: Scheduler) -> tuple[SchedulerOutput, list]:
    s.reserve()
    out = s.schedule()
    result = RunnerOutput(sampled={x.request.request_id: SampledToken(fake_token(x.request.all_token_ids))
                                   for x in out.decodes + out.prefills if x.sample})
    return out, out.failed + s.update(out, result)


def run(s: Scheduler, max_steps=100_000, on_step=None) -> dict[str, list[int]]:
    """Step until idle; the tokens each request emitted, by id."""
    tokens: dict[str, list[int]] = {}
    for i in range(max_steps):
        if not s.has_work():
            return tokens
        out, events = step(s)
        for e in events:
            if not isinstance(e, RequestFailed):
                tokens.setdefault(e.request_id, []).append(e.token.token_id)
        if on_step is not None:
            on_step(i, out, events)
        assert not s.kv.pool.integrity_errors()
    raise AssertionError("work left after max_steps")


def tenant_tokens(out: SchedulerOutput) -> dict[str, int]:
    """Tokens a step computes per tenant."""
    counts: dict[str, int] = {}
    for x in out.decodes + out.prefills:
        counts[x.request.scheduling.tenant] = counts.get(x.request.scheduling.tenant, 0) + x.num_new_tokens
    return counts


# ---- priority ----------------------------------------------------------------------------------------------------
def test_a_high_priority_request_gets_a_slot_at_once_and_its_first_token_within_a_bounded_number_of_steps():
    """The batch is full of a low-priority tenant's long requests (and more are queued). A priority-0 request of
    P prompt tokens preempts one of them for its slot at the next step, and its first token comes within
    ceil(P / (budget - (max_num_seqs - 1))) steps: the budget left beside the other slots' decodes."""
    budget, max_seqs, prompt = 16, 4, 30
    s = scheduler(budget=budget, max_seqs=max_seqs)
    for i in range(12):
        s.add_request(request(f"low{i}", 8, max_tokens=40, first=100 * i, priority=5, tenant="batch"))
    for _ in range(6):
        step(s)
    assert len(s.running) == max_seqs and all(r.request_id.startswith("low") for r in s.running)
    s.add_request(request("urgent", prompt, max_tokens=4, first=7, priority=0, tenant="chat"))
    bound = math.ceil(prompt / (budget - (max_seqs - 1)))
    for n in range(1, bound + 1):
        out, events = step(s)
        if n == 1:
            assert "urgent" in [x.request.request_id for x in out.prefills]
            assert len(out.preempted_ids) == 1 and out.preempted_ids[0].startswith("low")
        if any(e.request_id == "urgent" for e in events):
            break
    else:
        pytest.fail(f"no first token for the urgent request within {bound} steps")


def test_preempted_low_priority_requests_finish_with_the_tokens_of_an_undisturbed_run():
    def lows(s):
        for i in range(6):
            s.add_request(request(f"low{i}", 10, max_tokens=24, first=50 * i, priority=3))

    alone = scheduler(num_blocks=40, max_seqs=4)
    lows(alone)
    undisturbed = run(alone)

    s = scheduler(num_blocks=40, max_seqs=4)
    lows(s)
    preempted: set[str] = set()
    arrivals = {5: 0, 12: 1, 20: 2}  # high-priority requests arriving mid-run

    def on_step(i, out, events):
        preempted.update(out.preempted_ids)
        if i in arrivals:
            s.add_request(request(f"high{arrivals[i]}", 24, max_tokens=12, first=900 + i, priority=0))

    tokens = run(s, on_step=on_step)
    assert preempted & set(undisturbed), "the scenario must preempt low-priority requests"
    for rid, out in undisturbed.items():
        assert tokens[rid] == out, rid
    assert s.requests == {} and s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


def test_under_kv_pressure_the_lowest_priority_gives_way_first_even_when_it_is_older():
    s = scheduler(num_blocks=7, budget=64, max_seqs=4)
    s.add_request(request("old_low", 8, max_tokens=12, priority=2))
    s.add_request(request("new_high", 8, max_tokens=12, first=500, priority=1))
    victims = []
    run(s, on_step=lambda i, out, events: victims.extend(out.preempted_ids))
    assert victims and set(victims) == {"old_low"}


def test_a_waiting_high_priority_request_takes_the_budget_of_a_lower_priority_prefill():
    s = scheduler(budget=16, max_seqs=4)
    s.add_request(request("long_low", 100, priority=1))
    step(s)  # its first chunk
    s.add_request(request("short_high", 12, first=700, priority=0))
    out, _ = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.prefills] == [("short_high", 12)]
    out, _ = step(s)  # the low prefill resumes once nothing more important waits
    assert ("long_low", 15) in [(x.request.request_id, x.num_new_tokens) for x in out.prefills]


# ---- fairness ----------------------------------------------------------------------------------------------------
def _share_while_all_busy(loads: dict[str, tuple[int, float]], max_steps=20_000) -> dict[str, int]:
    """Tokens computed per tenant over the steps in which every tenant still has requests in the scheduler.
    loads: tenant -> (number of requests, weight); every request has the same size and all arrive at once."""
    s = scheduler(num_blocks=1024, budget=32, max_seqs=4)
    for tenant, (num, weight) in loads.items():
        for i in range(num):
            s.add_request(request(f"{tenant}{i}", 6, max_tokens=10, first=hash(tenant) % 300 + i, tenant=tenant,
                                  weight=weight))
    totals = dict.fromkeys(loads, 0)
    for _ in range(max_steps):
        busy = {r.scheduling.tenant for r in s.requests.values()}
        if busy != set(loads):
            return totals
        out, _ = step(s)
        for tenant, n in tenant_tokens(out).items():
            totals[tenant] += n
    raise AssertionError("a tenant never ran out of work")


def test_two_tenants_of_equal_weight_and_unequal_load_get_equal_throughput():
    totals = _share_while_all_busy({"heavy": (150, 1.0), "light": (50, 1.0)})
    assert min(totals.values()) > 0
    assert abs(totals["heavy"] - totals["light"]) <= 0.1 * max(totals.values()), totals


def test_a_tenant_of_weight_two_gets_twice_the_tokens():
    totals = _share_while_all_busy({"a": (120, 1.0), "b": (120, 1.0), "c": (160, 2.0)})
    assert abs(totals["a"] - totals["b"]) <= 0.1 * max(totals["a"], totals["b"]), totals
    ratio = totals["c"] / ((totals["a"] + totals["b"]) / 2)
    assert 1.8 <= ratio <= 2.2, totals


def test_a_tenant_that_was_idle_does_not_bank_credit():
    """VTC's lift: a tenant arriving after others have been served starts at the least counter among tenants with
    work, not at zero, so it shares from then on instead of taking every slot until it has caught up."""
    policy = SchedulingPolicy()
    early = request("early", 4, tenant="early")
    policy.admit(early)
    policy.charge(early, 1000)
    late = request("late", 4, tenant="late")
    policy.admit(late)
    assert policy.served["late"] == policy.served["early"] == 1000
    policy.release(late)
    assert "late" not in policy.served  # forgotten with its last request: memory stays bounded


def test_queue_order_is_priority_then_least_served_tenant_then_arrival():
    policy = SchedulingPolicy()
    queue = RequestQueue(policy)
    reqs = [request("a1", 4, tenant="a"), request("a2", 4, tenant="a"), request("b1", 4, tenant="b"),
            request("urgent", 4, tenant="a", priority=-1)]
    for r in reqs:
        policy.admit(r)
        queue.push(r)
    policy.charge(reqs[0], 10)  # tenant a has been served more
    order = [queue.pop().request_id for _ in range(len(reqs))]
    assert order == ["urgent", "b1", "a1", "a2"]
    assert not queue and queue.peek() is None
    with pytest.raises(IndexError):
        queue.pop()


def test_a_weight_that_is_not_positive_is_refused():
    from pdserve_server.engine.errors import EngineError
    for weight in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(EngineError, match="weight"):
            SchedulingParams(weight=weight)


# ---- deadlines ---------------------------------------------------------------------------------------------------
def test_a_request_that_cannot_start_before_its_deadline_is_refused_before_any_prefill():
    s = scheduler(max_seqs=2)
    for i in range(2):
        s.add_request(request(f"busy{i}", 8, max_tokens=30, first=100 * i))
    step(s)
    s.add_request(request("late", 8, first=500, deadline=time.time() - 1))
    s.add_request(request("patient", 8, first=600, deadline=time.time() + 3600))
    out, events = step(s)
    (failure,) = [e for e in events if isinstance(e, RequestFailed)]
    assert failure.request_id == "late" and failure.kind == ErrorKind.DEADLINE and "deadline" in failure.message
    assert "late" not in s.requests and s.kv.get_block_table("late") == []
    tokens = run(s)
    assert len(tokens["patient"]) == 8 and "late" not in tokens


def test_a_request_already_started_is_not_refused_when_its_deadline_passes():
    s = scheduler()
    s.add_request(request("started", 40, max_tokens=4, deadline=time.time() + 3600))
    step(s)  # its first chunk: it has started
    req = s.requests["started"]
    assert req.status == RequestStatus.RUNNING
    req.scheduling = dataclasses.replace(req.scheduling, deadline=time.time() - 1)
    tokens = run(s)
    assert len(tokens["started"]) == 4


# ---- slow readers ------------------------------------------------------------------------------------------------
def test_a_paused_request_frees_its_batch_slot_keeps_its_blocks_and_resumes_with_its_tokens():
    alone = scheduler(max_seqs=2)
    alone.add_request(request("reader", 8, max_tokens=12))
    expected = run(alone)["reader"]

    s = scheduler(max_seqs=2)
    s.add_request(request("reader", 8, max_tokens=12))
    s.add_request(request("busy", 8, max_tokens=40, first=300))
    s.add_request(request("queued", 8, max_tokens=4, first=600))
    tokens = {"reader": [e.token.token_id for e in step(s)[1] if e.request_id == "reader"]}
    blocks = list(s.kv.get_block_table("reader"))
    assert s.pause("reader") and s.requests["reader"].status == RequestStatus.PAUSED
    out, _ = step(s)
    assert "queued" in [x.request.request_id for x in out.prefills]  # the slot went to the queue at once
    assert s.kv.get_block_table("reader") == blocks and s.make_stats(0).num_paused == 1
    assert not s.pause("reader") and not s.pause("unknown")
    assert s.resume("reader") and not s.resume("reader")
    tokens["reader"] += run(s)["reader"]
    assert tokens["reader"] == expected
    assert s.num_preemptions == 0  # its KV was kept: nothing recomputed


def test_under_kv_pressure_a_paused_request_gives_up_its_blocks_before_any_running_request():
    alone = scheduler()
    alone.add_request(request("reader", 8, max_tokens=12))
    expected = run(alone)["reader"]

    s = scheduler(num_blocks=8, budget=64, max_seqs=4)
    s.add_request(request("reader", 8, max_tokens=12))
    first = [e.token.token_id for e in step(s)[1]]
    assert s.pause("reader")
    s.add_request(request("grower", 8, max_tokens=20, first=300))  # needs more than the 6 blocks left
    victims = []
    rest = run(s, on_step=lambda i, out, events: victims.extend(out.preempted_ids))
    assert victims == [] and s.num_preemptions == 1  # the paused request was preempted, no running one was
    assert s.kv.get_block_table("reader") == [] and s.requests["reader"].num_computed_tokens == 0
    assert len(rest["grower"]) == 20
    assert s.resume("reader")
    assert first + run(s)["reader"] == expected  # recomputed: no token lost


def test_aborting_a_paused_request_frees_its_blocks():
    s = scheduler()
    s.add_request(request("reader", 8))
    step(s)
    s.pause("reader")
    assert s.abort("reader") and s.paused == {} and s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


# ---- with a model ------------------------------------------------------------------------------------------------
def test_with_a_model_preempted_low_priority_requests_match_an_undisturbed_greedy_run(tiny_model_dir):
    """The same as above on a tiny random-weight model (fp32, greedy): recompute after preemption loses nothing."""
    from pdserve_server.engine.args import EngineArgs
    from pdserve_server.engine.builder import build_engine
    from pdserve_server.engine.offline import run_until_idle

    def build():
        return build_engine(EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), block_size=8, kv_tokens=20 * 8,
                                       max_num_batched_tokens=32, max_num_seqs=4, max_model_len=256))

    def lows():
        return [Request(f"low{i}", [(37 * i + 11 * j) % 4000 + 3 for j in range(20)],
                        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                        scheduling=SchedulingParams(priority=3, tenant="batch")) for i in range(4)]

    alone = lows()
    run_until_idle(build(), alone)

    parts = build()
    disturbed = lows()
    sched, runner = parts.scheduler, parts.runner
    for r in disturbed:
        assert sched.add_request(r) is None
    steps = 0
    while sched.has_work():
        if steps in (4, 9):
            assert sched.add_request(Request(f"high{steps}", [(5 * steps + j) % 4000 + 3 for j in range(40)],
                                             SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                                             scheduling=SchedulingParams(priority=0, tenant="chat"))) is None
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        steps += 1
        assert steps < 1000
    assert sched.num_preemptions > 0, "the scenario must preempt"
    assert [r.output_token_ids for r in disturbed] == [r.output_token_ids for r in alone]
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks
