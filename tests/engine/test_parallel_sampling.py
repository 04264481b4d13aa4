"""Parallel sampling (n > 1) in the engine: the prompt is computed once (all but its last token),
the request forks into n samples that share its full KV blocks, each with a copy of the partial last block
(copy-on-write), and every sample computes the last prompt token and decodes on its own."""
import pytest

from conftest import hf_greedy
from pdserve_server.engine.args import EngineArgs
from pdserve_server.engine.builder import build_engine
from pdserve_server.engine.config import SchedulerConfig
from pdserve_server.engine.errors import ErrorKind
from pdserve_server.engine.scheduling.kv_cache_manager import KVCacheManager
from pdserve_server.engine.offline import run_until_idle
from pdserve_server.engine.outputs import RequestFailed, RunnerOutput, SampledToken, TokenOutput
from pdserve_server.engine.request import Request, SamplingParams
from pdserve_server.engine.scheduling.scheduler import Scheduler

BLOCK = 8


def sampled(rid, prompt, n, max_tokens=12, **kw) -> Request:
    kw.setdefault("temperature", 0.0)
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n, **kw), eos_token_ids=(2,))


def by_sample(events) -> dict[tuple[str, int], list[int]]:
    """Tokens per (request id, sample index), in order; fails on any RequestFailed."""
    out: dict[tuple[str, int], list[int]] = {}
    for e in events:
        assert not isinstance(e, RequestFailed), e
        out.setdefault((e.request_id, e.index), []).append(e.token.token_id)
    return out


@pytest.fixture(scope="module")
def engine_args(tiny_model_dir):
    return EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), block_size=BLOCK, kv_tokens=64 * BLOCK,
                      max_model_len=256)


@pytest.mark.parametrize("prompt_len", [21, 17, 1])  # a partial last block, a full one before the last token, one
def test_greedy_samples_are_equal_to_each_other_and_to_hf(tiny_model_dir, engine_args, prompt_len):
    parts = build_engine(engine_args)
    prompt = [(13 * j) % 3000 + 3 for j in range(prompt_len)]
    outputs = by_sample(run_until_idle(parts, [sampled("r", prompt, n=4)]))
    assert sorted(outputs) == [("r", i) for i in range(4)]
    expected = hf_greedy(tiny_model_dir, prompt, 12)
    assert all(tokens == expected for tokens in outputs.values())
    pool = parts.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and not pool.integrity_errors()
    assert parts.scheduler.families.children == {} and parts.scheduler.requests == {}


def test_seeded_samples_differ_and_each_equals_a_single_request_with_its_seed(engine_args):
    """Sample i of seed s draws with seed s + i (vLLM's rule): it must equal a lone request with that seed, which
    holds only if its forked KV (shared blocks and the copied partial block) is exactly the prompt's."""
    prompt = [(7 * j) % 3000 + 3 for j in range(21)]
    parts = build_engine(engine_args)
    outputs = by_sample(run_until_idle(parts, [sampled("r", prompt, n=4, temperature=1.0, seed=1234)]))
    assert len({tuple(t) for t in outputs.values()}) > 1, "temperature 1 samples should differ"
    for i in range(4):
        alone = sampled(f"alone{i}", prompt, n=1, temperature=1.0, seed=1234 + i)
        run_until_idle(build_engine(engine_args), [alone])
        assert outputs[("r", i)] == alone.output_token_ids, i


def test_the_prompt_blocks_are_held_once_and_shared_by_every_sample(engine_args):
    """n=4 on a 21-token prompt, 8-token blocks: the prompt's first 20 tokens are computed once; after the fork the
    two full blocks are in all four tables (ref count 4) and each sample has its own third block, three of them
    copies (copy-on-write) of the parent's."""
    parts = build_engine(engine_args)
    sched = parts.scheduler
    prompt = [(11 * j) % 3000 + 3 for j in range(21)]
    assert sched.add_request(sampled("r", prompt, n=4)) is None
    computed_prompt_tokens = 0
    copies = []
    while not sched.families.children:
        out = sched.schedule()
        computed_prompt_tokens += sum(s.num_new_tokens for s in out.prefills + out.decodes)
        copies += out.block_copies
        sched.update(out, parts.runner.execute(out))
    assert computed_prompt_tokens == 20  # all but the last token, once
    tables = [sched.kv.get_block_table(rid) for rid in ["r", *sched.families.children["r"]]]
    shared = tables[0][:2]
    assert all(t[:2] == shared for t in tables)
    assert [sched.kv.pool.ref_counts[b] for b in shared] == [4, 4]
    own = [t[2] for t in tables]
    assert len(set(own)) == 4 and all(sched.kv.pool.ref_counts[b] == 1 for b in own)
    out = sched.schedule()  # the copies go with the next step, before its forward
    assert sorted(out.block_copies) == sorted((tables[0][2], b) for b in own[1:])
    sched.update(out, parts.runner.execute(out))
    assert 4 * 1 == sum(s.num_new_tokens for s in out.decodes + out.prefills)  # the last prompt token, per sample
    events = run_until_idle(parts)
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks and events


def test_speculative_decoding_leaves_the_samples_unchanged(tiny_model_dir, engine_args):
    """With n-gram drafts on, the step before the fork (one token left of the shared part) is no decode: it must
    not get drafts; the samples' own decodes may."""
    import dataclasses
    parts = build_engine(dataclasses.replace(engine_args, speculative_ngram_tokens=3, max_num_batched_tokens=19,
                                                     burst_prefill_tokens=0))
    prompt = [5, 6, 7, 8] * 5 + [5]  # repetitive: drafts are proposed; budget 19: the 20th token is a step alone
    outputs = by_sample(run_until_idle(parts, [sampled("r", prompt, n=2, max_tokens=16)]))
    expected = hf_greedy(tiny_model_dir, prompt, 16)
    assert outputs == {("r", 0): expected, ("r", 1): expected}


def test_a_prefix_cache_hit_up_to_the_last_token_forks_without_computing(engine_args):
    parts = build_engine(engine_args)
    prompt = [(5 * j) % 3000 + 3 for j in range(17)]  # 16 cacheable tokens: two full blocks
    first = by_sample(run_until_idle(parts, [sampled("a", prompt, n=1)]))
    again = by_sample(run_until_idle(parts, [sampled("b", prompt, n=3)]))
    assert all(t == first[("a", 0)] for t in again.values()) and len(again) == 3
    assert parts.scheduler.kv.prefix_hit_tokens >= 16


def test_aborting_the_request_drops_every_sample(engine_args):
    parts = build_engine(engine_args)
    sched = parts.scheduler
    sched.add_request(sampled("r", list(range(3, 40)), n=3, max_tokens=50))
    for _ in range(4):
        out = sched.schedule()
        sched.update(out, parts.runner.execute(out))
    assert len(sched.requests) == 3
    assert sched.abort("r")
    assert sched.requests == {} and sched.families.children == {}
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks


@pytest.mark.parametrize("kw,why", [({"prefill_only": True}, "prefill-only"),
                                     ({"remote_kv": True}, "prefill worker"),
                                     ({"output_token_ids": [5]}, "resumed")])
def test_parallel_sampling_is_refused_where_it_cannot_fork(kw, why):
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256,
                                  enable_prefix_caching=True, vocab_size=1000), KVCacheManager(64, BLOCK, True))
    failure = s.add_request(Request("r", [5, 6, 7], SamplingParams(max_tokens=4, n=2), **kw))
    assert failure is not None and failure.kind == ErrorKind.INVALID_REQUEST and why in failure.message


def test_n_is_bounded():
    from pdserve_server.engine.errors import EngineError
    with pytest.raises(EngineError, match="sampling.n"):
        SamplingParams(max_tokens=4, n=0)
    with pytest.raises(EngineError, match="sampling.n"):
        SamplingParams(max_tokens=4, n=65)
