"""KV cache events in the engine (`EngineArgs.kv_events`): every full block that enters the prefix cache is
reported once with its chained hash, its parent's and its tokens; every cached block whose content is evicted is
reported removed; with the flag off nothing is recorded."""
import random

from pdserve_server.engine.args import EngineArgs
from pdserve_server.engine.builder import build_engine
from pdserve_server.engine.offline import run_until_idle
from pdserve_server.engine.outputs import KvBlockRemoved, KvBlockStored
from pdserve_server.engine.request import Request, SamplingParams
from pdserve_server.engine.scheduling.block_pool import hash_block_tokens


def greedy(rid, prompt, n):
    return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), eos_token_ids=(2,))


def test_stored_and_removed_events_follow_the_prefix_cache(tiny_model_dir):
    parts = build_engine(EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), block_size=8, kv_tokens=64,
                                    max_model_len=64, kv_events=True))
    pool = parts.scheduler.kv.pool
    assert pool.num_blocks == 8
    rng = random.Random(0)
    first = [rng.randrange(3, 49152) for _ in range(20)]
    run_until_idle(parts, [greedy("a", first, 4)])
    stored = pool.take_kv_events()
    # 23 tokens computed (20 prompt + 3 of the 4 outputs: the last is sampled, never computed): 2 full blocks.
    assert [type(e) for e in stored] == [KvBlockStored, KvBlockStored]
    h0 = hash_block_tokens(None, first[:8])
    assert (stored[0].block_hash, stored[0].parent_hash, stored[0].token_ids) == (h0, None, first[:8])
    assert (stored[1].block_hash, stored[1].parent_hash, stored[1].token_ids) == (
        hash_block_tokens(h0, first[8:16]), h0, first[8:16])
    assert pool.take_kv_events() == []  # taken once

    run_until_idle(parts, [greedy("b", first[:16] + [5, 6, 7], 2)])  # a prefix-cache hit stores nothing again
    assert all(e.block_hash not in {s.block_hash for s in stored} for e in pool.take_kv_events())

    other = [rng.randrange(3, 49152) for _ in range(60)]  # needs all 8 blocks: both cached ones are evicted
    run_until_idle(parts, [greedy("c", other, 1)])
    events = pool.take_kv_events()
    removed = {e.block_hash for e in events if isinstance(e, KvBlockRemoved)}
    assert removed >= {s.block_hash for s in stored}
    assert pool.integrity_errors() == []


def test_no_events_are_recorded_without_the_flag(tiny_model_dir):
    parts = build_engine(EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), block_size=8, kv_tokens=64,
                                    max_model_len=64))
    run_until_idle(parts, [greedy("a", list(range(3, 40)), 2)])
    assert parts.scheduler.kv.pool.kv_events is None and parts.scheduler.kv.pool.take_kv_events() == []
