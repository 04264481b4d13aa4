"""The scheduler as pure policy: no model, no thread. Each test feeds requests and fake step
results (`RunnerOutput` with a made-up token for every request the step samples) and checks the batches, the
preemptions and the block accounting the scheduler decides."""
import pytest

from pdserve_server.engine.config import SchedulerConfig
from pdserve_server.engine.scheduling.kv_cache_manager import KVCacheManager
from pdserve_server.engine.outputs import RunnerOutput, SampledToken, SchedulerOutput
from pdserve_server.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from pdserve_server.engine.scheduling.scheduler import Scheduler
from pdserve_server.engine.speculative import SpeculativeConfig
from pdserve_server.engine.scheduling.step_cost import StepCost

BLOCK = 4


def scheduler(num_blocks=32, budget=16, max_seqs=8, prefix_caching=True, itl_target_ms=0.0, burst=0) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=256,
                             enable_prefix_caching=prefix_caching, vocab_size=1000, itl_target_ms=itl_target_ms,
                             burst_prefill_tokens=burst)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK, prefix_caching))


def request(rid, prompt_len, max_tokens=4, first=10, **kw) -> Request:
    return Request(rid, list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens,
                                                                               temperature=0.0, ignore_eos=True), **kw)


def step(s: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list]:
    """One engine iteration with a fake runner: every request whose chunk reaches its last token samples `token`."""
    s.reserve()
    out = s.schedule()
    result = RunnerOutput(sampled={x.request.request_id: SampledToken(token)
                                   for x in out.decodes + out.prefills if x.sample})
    return out, s.update(out, result)


def shape(out: SchedulerOutput) -> tuple[list, list]:
    """(decode ids, [(prefill id, tokens)]) of a step."""
    return ([x.request.request_id for x in out.decodes],
            [(x.request.request_id, x.num_new_tokens) for x in out.prefills])


def blocks_in_use(s: Scheduler) -> int:
    return sum(len(s.kv.get_block_table(rid)) for rid in s.requests)


def assert_accounting(s: Scheduler) -> None:
    """Every block is either free or in exactly one live request's table (prefix-shared blocks excepted: none here
    unless a test shares prompts), and the pool agrees with itself."""
    assert not s.kv.pool.integrity_errors()
    assert s.kv.pool.num_free_blocks + blocks_in_use(s) == s.kv.pool.num_blocks


def test_chunked_prefill_splits_a_long_prompt_under_the_token_budget():
    s = scheduler(budget=16)
    s.add_request(request("long", 40))
    shapes = [shape(step(s)[0]) for _ in range(3)]
    assert shapes == [([], [("long", 16)]), ([], [("long", 16)]), ([], [("long", 8)])]
    out, events = step(s)
    assert shape(out) == (["long"], []) and [e.token.token_id for e in events] == [7]
    assert_accounting(s)


def test_decodes_go_first_and_a_new_prompt_takes_what_budget_is_left():
    s = scheduler(budget=16)
    s.add_request(request("a", 8, max_tokens=10))
    step(s)  # a's prefill, first token
    s.add_request(request("b", 30, first=100))
    out, _ = step(s)
    assert shape(out) == (["a"], [("b", 15)])  # one budget token went to a's decode
    out, _ = step(s)
    assert shape(out) == (["a"], [("b", 15)])
    assert_accounting(s)


def test_max_num_seqs_caps_the_running_batch():
    s = scheduler(budget=64, max_seqs=2)
    for i in range(3):
        s.add_request(request(f"r{i}", 4, first=100 * i))
    out, _ = step(s)
    assert [rid for rid, _ in shape(out)[1]] == ["r0", "r1"] and len(s.waiting) == 1


def test_finished_requests_free_their_blocks():
    s = scheduler()
    s.add_request(request("a", 6, max_tokens=3))
    events = []
    while s.has_work():
        events += step(s)[1]
    assert [e.finish_reason for e in events] == [None, None, FinishReason.LENGTH]
    assert s.requests == {} and s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


def test_kv_pressure_preempts_the_newest_and_it_resumes_with_its_tokens():
    """Two requests grow until the pool is short: the newest running one is preempted (its blocks freed, back at
    the head of the queue), the older finishes, then the preempted one recomputes prompt + output and finishes with
    every token it had."""
    s = scheduler(num_blocks=6, budget=64, prefix_caching=False)
    s.add_request(request("old", 8, max_tokens=8))
    s.add_request(request("new", 8, max_tokens=8, first=500))
    tokens: dict[str, list[int]] = {"old": [], "new": []}
    preempted_at = None
    for i in range(40):
        out, events = step(s, token=20 + i)
        for e in events:
            tokens[e.request_id].append(e.token.token_id)
        assert_accounting(s)
        if out.preempted_ids and preempted_at is None:
            preempted_at = i
            assert out.preempted_ids == ["new"]
            victim = s.requests["new"]
            assert victim.status == RequestStatus.PREEMPTED and s.waiting.peek() is victim
            assert s.kv.get_block_table("new") == [] and victim.num_computed_tokens == 0
        if not s.has_work():
            break
    assert preempted_at is not None and s.num_preemptions >= 1
    assert len(tokens["old"]) == 8 and len(tokens["new"]) == 8
    assert s.requests == {} and s.kv.pool.num_free_blocks == 6


def test_prefix_cache_hit_skips_the_cached_blocks():
    s = scheduler(budget=64)
    s.add_request(request("first", 12, max_tokens=1))
    while s.has_work():
        step(s)
    s.add_request(request("second", 14, max_tokens=1))  # shares the first 12 tokens: 3 full blocks
    out, events = step(s)
    assert shape(out) == ([], [("second", 2)])
    assert events[0].num_cached_tokens == 12
    assert s.kv.prefix_hit_tokens == 12


def test_remote_kv_reserves_blocks_then_joins_the_batch_as_a_decode():
    s = scheduler()
    s.add_request(request("remote", 10, remote_kv=True))
    (reserved,) = s.reserve()
    assert reserved.request_id == "remote" and len(reserved.block_ids) == 3  # ceil(10 / 4)
    assert s.schedule().is_empty  # nothing runs before the KV arrives
    assert s.kv_arrived("remote", 42) is None
    out, events = step(s)
    assert shape(out) == (["remote"], []) and s.requests["remote"].output_token_ids == [42, 7]
    assert_accounting(s)


def test_reserved_blocks_behind_the_window_are_given_back_unsent_and_unhashed():
    """Sliding window 6 (every layer), blocks of 4, a 20-token prompt: position 20 sees keys 15..20, so blocks 0-2
    go back as the reservation is made, the prefill worker is told to skip them (it gives back the same ones), and
    they never enter the prefix cache: a later request with the same prompt gets no hit on contents that never
    arrived. Then a request whose first two blocks are this worker's prefix-cache hits: the skip is the larger of
    the two counts."""
    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8, max_model_len=256,
                             enable_prefix_caching=True, vocab_size=1000)
    s = Scheduler(config, KVCacheManager(32, BLOCK, True, sliding_window=6))
    s.add_request(request("remote", 20, remote_kv=True))
    (reserved,) = s.reserve()
    null = s.kv.null_block
    assert reserved.block_ids[:3] == [null] * 3 and null not in reserved.block_ids[3:]
    assert reserved.num_cached_blocks == 3 and len(reserved.block_ids) == 5
    assert s.kv.pool.num_free_blocks == s.kv.num_usable_blocks - 2
    assert s.kv_arrived("remote", 42) is None
    step(s)
    assert s.kv.get_computed_blocks(request("same", 20)) == []  # the chain starts with a block given back
    assert not s.kv.pool.integrity_errors()

    # A local request computes a 40-token prompt and registers its blocks. A remote request of its first 12
    # tokens hits 2 blocks (the last token is always computed) with 1 behind its window: 2 skipped. One of 20
    # tokens sharing the first 8 hits the same 2 with 3 behind its window ((20 - 6 + 1) // 4): 3 skipped.
    s.add_request(request("local", 40, max_tokens=1, first=500))
    while "local" in s.requests:
        step(s)
    s.add_request(request("hits", 12, first=500, remote_kv=True))
    s.add_request(Request("window", list(range(500, 508)) + [9] * 12, SamplingParams(max_tokens=4), remote_kv=True))
    hits, window = s.reserve()
    assert (hits.num_cached_blocks, window.num_cached_blocks) == (2, 3)
    assert hits.block_ids[0] == null and window.block_ids[:3] == [null] * 3
    assert not s.kv.pool.integrity_errors()


def test_reservations_never_take_the_blocks_a_waiting_request_needs():
    """A request whose KV arrived waits for its first step needing one block more than it holds; a later
    reservation must leave that block (else a burst of reservations stalled the worker until leases lapsed)."""
    s = scheduler(num_blocks=4, budget=64, prefix_caching=False)
    s.add_request(request("arrived", 12, remote_kv=True))
    assert [r.request_id for r in s.reserve()] == ["arrived"]  # 3 blocks
    s.kv_arrived("arrived", 42)  # 13 tokens now: its first step needs a 4th block
    s.add_request(request("next", 4, remote_kv=True, first=300))
    assert s.reserve() == []
    step(s)  # "arrived" runs and takes the block
    while "arrived" in s.requests:
        step(s)
    assert [r.request_id for r in s.reserve()] == ["next"]


@pytest.mark.parametrize("bad", [[-1], [1000]])
def test_out_of_vocabulary_tokens_are_refused_at_admission(bad):
    s = scheduler()
    failure = s.add_request(Request("x", bad, SamplingParams(max_tokens=2)))
    assert failure is not None and "outside the vocabulary" in failure.message and s.requests == {}


def test_abort_frees_a_request_in_any_state():
    s = scheduler(budget=8)
    s.add_request(request("running", 20))
    s.add_request(request("waiting", 4, first=200))
    s.add_request(request("reserving", 4, remote_kv=True, first=300))
    step(s)
    for rid in ("running", "waiting", "reserving"):
        assert s.abort(rid)
    assert not s.abort("running")  # idempotent
    assert s.requests == {} and s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


# ---- stall-free batching: the prefill cap from an ITL target and measured step costs ------------------------------
def timed_step(s: Scheduler, decode_ms: float = 20.0, ms_per_prefill_token: float = 1.0):
    """`step`, then report a made-up duration: decode_ms for the decodes plus ms_per_prefill_token per prefill
    token (what a real forward's cost looks like to `StepCost`)."""
    out, events = step(s)
    s.observe_step(out, (decode_ms if out.decodes else 0.0) + ms_per_prefill_token * out.num_prefill_tokens)
    return out, events


def test_step_cost_learns_the_decode_step_and_the_prefill_token():
    cost = StepCost()
    assert cost.prefill_budget(100.0, floor=4) is None  # nothing measured: no cap
    cost.observe(num_decode_tokens=3, num_prefill_tokens=0, step_ms=20.0)
    cost.observe(num_decode_tokens=0, num_prefill_tokens=10, step_ms=500.0)  # too few tokens to learn from
    assert cost.ms_per_prefill_token is None
    cost.observe(num_decode_tokens=3, num_prefill_tokens=64, step_ms=20.0 + 64 * 1.5)
    assert cost.decode_ms == 20.0 and cost.ms_per_prefill_token == pytest.approx(1.5)
    assert cost.prefill_budget(80.0, floor=4) == 40  # (80 - 20) / 1.5
    assert cost.prefill_budget(10.0, floor=4) == 4  # the decodes alone are over the target: a block still goes
    for _ in range(30):  # the costs drift (a longer context): the means follow
        cost.observe(num_decode_tokens=3, num_prefill_tokens=0, step_ms=40.0)
    assert cost.decode_ms == pytest.approx(40.0, abs=0.1)


def test_step_cost_separates_a_prefill_tokens_marginal_cost_from_the_steps_fixed_part():
    """A GPU's eager prefill step: 24 ms of launches whatever its size plus 0.0167 ms a token (Llama-3.1-8B on an
    H200: 64 tokens 25 ms, 904 tokens 39 ms). The mean ratio blames the fixed part on the tokens; the slope does
    not, once the chunk sizes differ; while they do not, the slope is the ratio."""
    cost = StepCost()
    assert cost.marginal_ms_per_prefill_token is None
    cost.observe(num_decode_tokens=0, num_prefill_tokens=64, step_ms=24.0 + 64 / 60)
    assert cost.marginal_ms_per_prefill_token == cost.ms_per_prefill_token == pytest.approx((24 + 64 / 60) / 64)
    for n in (904, 96, 768, 128, 904, 64):
        cost.observe(num_decode_tokens=0, num_prefill_tokens=n, step_ms=24.0 + n / 60)
    assert cost.marginal_ms_per_prefill_token == pytest.approx(1 / 60, rel=1e-6)
    assert cost.ms_per_prefill_token > 5 / 60  # the ratio: the fixed 24 ms spread over the tokens
    flat = StepCost()  # a CPU: no fixed part, so slope and ratio agree
    for n in (64, 904, 96, 768):
        flat.observe(num_decode_tokens=0, num_prefill_tokens=n, step_ms=0.4 * n)
    assert flat.marginal_ms_per_prefill_token == pytest.approx(0.4, rel=1e-6)


def test_an_itl_target_caps_the_prefill_chunk_while_requests_decode():
    s = scheduler(num_blocks=128, budget=128, itl_target_ms=60.0)
    s.add_request(request("a", 40, max_tokens=30))
    out, _ = timed_step(s)
    assert shape(out) == ([], [("a", 40)])  # nobody decodes yet: the whole budget, and a first prefill sample
    timed_step(s)  # a decodes alone: the decode step's cost
    s.add_request(request("long", 200, first=300))
    # 20 ms of decode leaves 40 ms: 40 prefill tokens a step at 1 ms each, instead of the 127 the budget allows
    shapes = [shape(timed_step(s)[0]) for _ in range(6)]
    assert shapes == [(["a"], [("long", 40)])] * 5 + [(["a", "long"], [])]
    assert_accounting(s)


def test_without_decodes_or_target_the_budget_alone_decides():
    s = scheduler(num_blocks=128, budget=128, itl_target_ms=60.0)
    s.add_request(request("a", 40, max_tokens=30))
    timed_step(s)
    timed_step(s)
    s.add_request(request("b", 200, first=300))
    out, _ = timed_step(s)
    assert shape(out) == (["a"], [("b", 40)])  # a decodes: b's chunk is capped
    s.abort("a")
    out, _ = timed_step(s)
    assert shape(out) == ([], [("b", 128)])  # nobody decodes: nobody waits between tokens
    off = scheduler(num_blocks=128, budget=128)
    off.add_request(request("a", 40, max_tokens=30))
    timed_step(off)
    timed_step(off)
    off.add_request(request("b", 200, first=300))
    assert shape(timed_step(off)[0]) == (["a"], [("b", 127)])


def test_the_cap_never_stops_a_prompt_from_progressing():
    # The decodes alone take 20 ms: over the 10 ms target already.
    s = scheduler(num_blocks=128, budget=128, itl_target_ms=10.0)
    s.add_request(request("a", 40, max_tokens=60))
    timed_step(s)
    timed_step(s)
    s.add_request(request("b", 30, first=300, max_tokens=2))
    s.add_request(request("c", 30, first=500, max_tokens=2))
    out, _ = timed_step(s)
    assert shape(out) == (["a"], [("b", BLOCK)])  # one block a step, shared by the prompts in policy order
    steps = 1
    while "c" in s.requests and steps < 100:
        timed_step(s)
        steps += 1
    assert "c" not in s.requests and steps < 100  # both prompts prefilled and finished, a block a step
    assert_accounting(s)


@pytest.mark.parametrize("num_blocks, burst, chunks", [(8, 0, [16, 16, 16, 12]), (5, 0, [8] * 7 + [4]),
                                                       (8, 64, [20, 16, 16, 8]), (5, 64, [8] * 7 + [4])])
def test_a_windowed_request_longer_than_the_pool_runs_within_its_window(num_blocks, burst, chunks):
    """Window 6, blocks of 4, a 60-token prompt and 20 outputs (20 blocks) on a pool of 7 or 4 usable blocks:
    refused without the window; with it admitted, prefilled in chunks small enough that the window and a chunk fit
    (16 = the budget on 7 blocks; 8 on 4), decoded to the end without a preemption, never holding more blocks than
    the pool, and every block back after. A remote-KV request of the same size reserves only its window's blocks.
    With a burst budget the lone request's first step is a burst step, its chunk still capped by the window (20
    tokens on 7 blocks, 8 on 4)."""
    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8, max_model_len=256,
                             enable_prefix_caching=True, vocab_size=1000, burst_prefill_tokens=burst)
    plain = Scheduler(config, KVCacheManager(num_blocks, BLOCK, True))
    failure = plain.add_request(request("long", 60, max_tokens=20))
    assert failure is not None and "KV blocks" in failure.message

    s = Scheduler(config, KVCacheManager(num_blocks, BLOCK, True, sliding_window=6))
    assert s.add_request(request("long", 60, max_tokens=20)) is None
    prefills, outputs, peak = [], 0, 0
    for _ in range(100):  # 8 prefill steps and 19 decodes at most; a request that never fits would loop here
        if "long" not in s.requests:
            break
        out, events = step(s)
        prefills += [n for _, n in shape(out)[1]]
        outputs += len(events)
        peak = max(peak, s.kv.num_usable_blocks - s.kv.pool.num_free_blocks)
    assert "long" not in s.requests and prefills == chunks and outputs == 20 and s.num_preemptions == 0
    assert peak <= s.kv.num_usable_blocks
    assert s.kv.pool.num_free_blocks == s.kv.num_usable_blocks and not s.kv.pool.integrity_errors()

    assert s.add_request(request("remote", 60, max_tokens=20, remote_kv=True)) is None
    (reserved,) = s.reserve()
    held = [b for b in reserved.block_ids if b != s.kv.null_block]
    assert len(reserved.block_ids) == 15 and len(held) == 2 and reserved.num_cached_blocks == 13
    assert s.kv_arrived("remote", 42) is None
    for _ in range(100):
        if "remote" not in s.requests:
            break
        step(s)
    assert "remote" not in s.requests and s.kv.pool.num_free_blocks == s.kv.num_usable_blocks and not s.kv.pool.integrity_errors()


def test_only_requests_longer_than_the_pool_have_their_chunks_capped():
    """Window 6 on 7 usable blocks of 4 (the cap: 20 tokens): a 24-token prompt that fits whole is prefilled in one
    step of the 32-token budget; with window 16 not even the window and a token fit 4 usable blocks (no cap, and
    requests longer than the pool are refused), and a 12-token prompt is still one step, not 12."""
    config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=256,
                             enable_prefix_caching=True, vocab_size=1000)
    s = Scheduler(config, KVCacheManager(8, BLOCK, True, sliding_window=6))
    assert s.kv.max_chunk == 20
    s.add_request(request("fits", 24, max_tokens=4))
    assert shape(step(s)[0]) == ([], [("fits", 24)])

    s = Scheduler(config, KVCacheManager(5, BLOCK, True, sliding_window=16))
    assert s.kv.max_chunk is None
    assert s.add_request(request("long", 60, max_tokens=4)) is not None
    s.add_request(request("short", 12, max_tokens=4))
    assert shape(step(s)[0]) == ([], [("short", 12)])


def test_drafts_never_ride_on_a_prefill_chunk_capped_to_one_token():
    """n-gram drafts belong to decodes: a prompt whose chunks the window's cap keeps to one token (window 17 on 5
    usable blocks of 4) computes its real tokens, never drafts in their place (they would be written as its KV at
    the prompt's positions and counted as computed)."""
    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8, max_model_len=256,
                             enable_prefix_caching=False, vocab_size=1000,
                             speculative=SpeculativeConfig(num_tokens=1))  # one draft fits the chunk's block
    s = Scheduler(config, KVCacheManager(6, BLOCK, False, sliding_window=17))
    assert s.kv.max_chunk == 1
    req = Request("long", [1, 2, 3, 4] * 8, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert s.add_request(req) is None
    chunks = 0
    for _ in range(200):
        if "long" not in s.requests:
            break
        out, _ = step(s, token=1)
        for x in out.decodes + out.prefills:
            if not x.sample:  # a chunk of the prompt: its real tokens only
                assert not x.spec_token_ids and x.num_new_tokens == 1
                chunks += 1
    assert "long" not in s.requests and chunks == 31


def test_reservations_leave_a_long_windowed_request_the_blocks_its_window_needs():
    """A request longer than the pool (window 6, 60 + 20 tokens on 4 usable blocks) runs while a request whose KV
    comes from a prefill worker arrives every step: the reservations wait for it rather than take blocks its peak
    still needs (it would preempt itself and recompute from its first token, its block 0 long evicted)."""
    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8, max_model_len=256,
                             enable_prefix_caching=True, vocab_size=1000)
    s = Scheduler(config, KVCacheManager(5, BLOCK, True, sliding_window=6))
    assert s.add_request(request("long", 60, max_tokens=20)) is None
    for i in range(100):
        if "long" not in s.requests:
            break
        s.add_request(request(f"remote{i}", 4, max_tokens=2, first=700 + 10 * i, remote_kv=True))
        step(s)
    assert "long" not in s.requests and s.num_preemptions == 0
    assert not s.kv.pool.integrity_errors()


def test_the_step_budget_caps_prefill_chunks_never_decodes():
    from pdserve_server.engine.scheduling.step_budget import StepBudget

    budget = StepBudget(max_tokens=100, prefill=40)
    assert budget.chunk(1, limit=100) == 1  # a decode token
    assert budget.chunk(500, limit=64) == 40  # the prefill cap, below the chunk limit and the tokens left
    budget.take(40)
    assert (budget.tokens, budget.prefill) == (60, 0)
    assert budget.chunk(30, limit=64) is None and budget.chunk(1, limit=64) == 1  # the cap is spent: decodes go on
    budget.take(1, num_drafts=3)
    assert budget.tokens == 56 and budget.prefill == 0
    budget.recount(num_scheduled=10)  # preemption took requests out of the step
    assert budget.tokens == 90 and budget.prefill == 0 and budget
    uncapped = StepBudget(max_tokens=8, prefill=None)
    assert uncapped.chunk(500, limit=64) == 8
    uncapped.take(8)
    assert not uncapped and uncapped.chunk(5, limit=64) == 0


def test_a_burst_that_fits_the_burst_budget_is_prefilled_in_one_step_beside_the_decodes():
    """16 prompts arriving while one request decodes: with a 512-token budget they stall its tokens over four steps;
    with a 2,048-token burst budget they go in one step, and the steady state keeps the 512-token steps."""
    shapes = {}
    for burst in (0, 2048):
        s = scheduler(num_blocks=1024, budget=512, max_seqs=32, burst=burst)
        s.add_request(request("a", 100, max_tokens=40))
        step(s)  # a's prefill, alone: nothing else had arrived
        for i in range(15):
            s.add_request(request(f"r{i}", 100, max_tokens=40, first=100 + 50 * i))  # distinct, in vocab
        shapes[burst] = [shape(step(s)[0]) for _ in range(4)]
        assert_accounting(s)
    assert [sum(n for _, n in prefills) for _, prefills in shapes[0]] == [511, 506, 483, 0]  # a's decode stalls 3x
    assert shapes[2048][0] == (["a"], [(f"r{i}", 100) for i in range(15)])  # all 15 in one step, a decodes
    assert all(not prefills and len(decodes) == 16 for decodes, prefills in shapes[2048][1:])
    # more waiting than the burst budget: steps of the burst budget, whole prompts in order and then a chunk
    s = scheduler(num_blocks=1024, budget=512, max_seqs=32, burst=1024)
    for i in range(12):
        s.add_request(request(f"r{i}", 100, max_tokens=40, first=100 + 50 * i))
    out, _ = step(s)
    assert out.num_tokens == 1024 and [n for _, n in shape(out)[1]] == [100] * 10 + [24]
    # then 10 decode while 2 still prefill: more decode than arrive, the usual budget
    out, _ = step(s)
    assert len(out.decodes) == 10 and out.num_tokens == 10 + 176
    assert_accounting(s)
    # as many arriving as decoding: a burst step again (sixteen arrivals past the budget go in two steps)
    s = scheduler(num_blocks=1024, budget=128, max_seqs=32, burst=800)
    for i in range(16):
        s.add_request(request(f"r{i}", 100, max_tokens=40, first=100 + 50 * i))
    first, _ = step(s)
    assert [n for _, n in shape(first)[1]] == [100] * 8  # 800 tokens: eight whole prompts
    second, _ = step(s)
    assert len(second.decodes) == 8 and [n for _, n in shape(second)[1]] == [100] * 8
    assert_accounting(s)
    # more requests decoding than arriving (a closed loop's steady state): the usual budget too
    s = scheduler(num_blocks=1024, budget=128, max_seqs=32, burst=2048)
    for i in range(12):
        s.add_request(request(f"d{i}", 8, max_tokens=40, first=100 + 50 * i))
    step(s)  # 12 prompts of 8: within the budget, one step
    for i in range(5):
        s.add_request(request(f"r{i}", 100, first=120 + 50 * i))
    out, _ = step(s)
    assert len(out.decodes) == 12 and out.num_tokens == 128
    assert_accounting(s)


def test_the_default_configuration_prefills_a_cohort_of_64_short_prompts_in_one_step(tiny_model_dir):
    """`pdserve serve`'s defaults (`EngineArgs()`): 512-token steps, bursts up to 8,192 tokens. 64 prompts of 100
    tokens arriving together (the sweep's S c=64) go in one step and then decode together; 90 of them, more tokens
    than the burst budget, go 64 (max_num_seqs) in the first step, the rest as slots free."""
    from pdserve_server.engine.args import EngineArgs
    from pdserve_server.engine.builder import resolve_configs

    _, cache, config = resolve_configs(EngineArgs(model_dir=str(tiny_model_dir), dtype="float32"))
    assert (config.max_num_batched_tokens, config.burst_prefill_tokens) == (512, 8192)
    s = Scheduler(config, KVCacheManager(cache.num_blocks, cache.block_size, True))
    for i in range(64):
        s.add_request(request(f"r{i}", 100, max_tokens=5, first=3 + 5 * i))
    out, _ = step(s)
    assert len(out.prefills) == 64 and out.num_tokens == 6400
    assert all(len(step(s)[0].decodes) == 64 for _ in range(3))  # all of them, each step
    assert_accounting(s)
    s = Scheduler(config, KVCacheManager(cache.num_blocks, cache.block_size, True))
    for i in range(90):  # 9,000 prompt tokens: past the burst budget
        s.add_request(request(f"r{i}", 100, max_tokens=5, first=3 + 5 * i))
    assert step(s)[0].num_tokens == 6400  # max_num_seqs (64) of them in the burst step
    out, _ = step(s)
    assert len(out.decodes) == 64 and out.num_tokens == 64  # no slot for the rest until one finishes


def test_a_burst_step_fits_max_step_tokens_and_the_tp_slot_is_sized_for_it():
    """`SchedulerConfig.max_step_tokens` bounds every step, a burst's too; TP's shared-memory slot holds that many
    rows of hidden states (fp32), so a burst step's all-reduce stays off gloo."""
    from types import SimpleNamespace

    from pdserve_server.engine.core.ranks import shm_slot_bytes

    s = scheduler(num_blocks=1024, budget=512, max_seqs=32, burst=2048)
    assert s.config.max_step_tokens == 2048 + 32 and scheduler(budget=512).config.max_step_tokens == 512
    s.add_request(request("a", 100, max_tokens=40))
    step(s)
    for i in range(15):
        s.add_request(request(f"r{i}", 100, max_tokens=40, first=100 + 50 * i))
    out, _ = step(s)
    assert out.num_tokens == 1 + 1500 <= s.config.max_step_tokens
    model = SimpleNamespace(hidden_size=64, vocab_size=1000)
    assert shm_slot_bytes(model, s.config, 2, 4) == (2048 + 32) * 64 * 4
    assert shm_slot_bytes(model, scheduler(budget=512, max_seqs=32).config, 2, 4) == 512 * 64 * 4
