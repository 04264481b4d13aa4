"""n-gram speculative decoding: the proposer and the acceptance rule alone, then the engine with drafts on, whose
greedy output must equal HF transformers' (and the engine's own without drafts) under concurrency, at stops and
at max_tokens, with drafts actually proposed and accepted."""
import pytest

from conftest import hf_greedy
from pdserve_server.engine.args import EngineArgs
from pdserve_server.engine.builder import build_engine
from pdserve_server.engine.request import Request, SamplingParams
from pdserve_server.engine.speculative import SpeculativeConfig, accept_greedy, propose_ngram
from test_engine import run_to_completion


def test_propose_takes_the_latest_match_of_the_longest_ngram():
    #        0  1  2  3  4  5  6  7  8  9 10 11
    seq = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 1, 2, 3]
    # the suffix [1, 2, 3] occurs at 0 and at 5: the later one is followed by 4, 5, 1
    assert propose_ngram(seq, 3, 2, 4) == [4, 5, 1]
    assert propose_ngram(seq, 1, 2, 4) == [4]
    # the longest n-gram wins over a later, shorter one: [7, 8] matches at 0 (followed by 5), [8] alone at 4
    assert propose_ngram([7, 8, 5, 6, 8, 0, 7, 8], 2, 1, 2) == [5, 6]
    assert propose_ngram([7, 8, 5, 6, 8, 0, 7, 8], 2, 1, 1) == [0, 7]


def test_propose_returns_nothing_without_a_match_or_room():
    assert propose_ngram([1, 2, 3, 4, 5], 3, 2, 4) == []
    assert propose_ngram([1, 2, 1, 2], 0, 2, 4) == []
    assert propose_ngram([1], 3, 1, 4) == []
    # a match right before the suffix proposes only what follows it (the suffix itself)
    assert propose_ngram([5, 5, 5], 4, 1, 1) == [5]


def test_accept_greedy_keeps_the_confirmed_prefix_and_one_model_token():
    assert accept_greedy([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert accept_greedy([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert accept_greedy([4, 5, 6], [8, 5, 6, 7]) == [8]
    assert accept_greedy([], [3]) == [3]
    with pytest.raises(ValueError):
        accept_greedy([4, 5], [4, 5])


def test_config_rejects_inconsistent_lookup_lengths():
    with pytest.raises(ValueError):
        SpeculativeConfig(num_tokens=4, lookup_min=3, lookup_max=2)
    with pytest.raises(ValueError):
        SpeculativeConfig(num_tokens=-1)


def _engine(model_dir, spec_tokens, disable_batch_size=8, **kw):
    return build_engine(EngineArgs(dtype="float32", model_dir=str(model_dir), kv_tokens=4096, max_model_len=512,
                                   speculative_ngram_tokens=spec_tokens, speculative_ngram_min=1,
                                   speculative_disable_batch_size=disable_batch_size, **kw))


TEXTS = ("Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday, Tuesday,",
         "Alice said hello to Bob. Bob said hello to Carol. Carol said hello to",
         "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
         "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick")


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Text that repeats itself, so that the packaged model copies from its context and prompt lookup finds drafts
    from the first steps on (as in summarization or code editing). SmolLM2 accepts most of the weekday drafts."""
    return [tokenizer(t).input_ids for t in TEXTS]


def _greedy(rid, prompt, max_tokens, **kw):
    return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw), eos_token_ids=(2,))


def test_drafts_do_not_change_greedy_output_under_concurrency(real_model_dir, prompts):
    """Four requests in one batch (below disable_batch_size), up to 4 drafts each a step: every output equals HF's
    greedy continuation, drafts were proposed and accepted, fewer steps than tokens, and no block leaks."""
    parts = _engine(real_model_dir, 4)
    reqs = [_greedy(f"r{i}", p, 24) for i, p in enumerate(prompts)]
    steps = run_to_completion(parts, reqs)
    for q in reqs:
        assert q.output_token_ids == hf_greedy(real_model_dir, q.prompt_token_ids, 24)
        assert q.num_draft_tokens > 0
    assert reqs[0].num_accepted_tokens >= 12  # the weekdays: the model copies its context
    assert steps < 24  # with the prefill step: some steps emitted more than one token per request
    stats = parts.scheduler.make_stats(steps)
    assert stats.spec_draft_tokens == sum(q.num_draft_tokens for q in reqs)
    assert stats.spec_accepted_tokens == sum(q.num_accepted_tokens for q in reqs) > 0
    assert parts.scheduler.kv.pool.num_free_blocks == parts.scheduler.kv.pool.num_blocks


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7])
def test_max_tokens_and_stop_tokens_cut_accepted_drafts(real_model_dir, prompts, max_tokens):
    """A stop token or max_tokens inside a run of accepted drafts ends the request there, as without drafts."""
    plain = _engine(real_model_dir, 0)
    ref = [_greedy(f"r{i}", p, 16, ignore_eos=True) for i, p in enumerate(prompts[:2])]
    run_to_completion(plain, ref)
    spec = _engine(real_model_dir, 4)
    by_length = _greedy("len", prompts[0], max_tokens, ignore_eos=True)
    stop = ref[0].output_token_ids[max_tokens + 2]
    by_stop = _greedy("stop", prompts[0], 16, ignore_eos=True, stop_token_ids=(stop,))
    other = _greedy("other", prompts[1], max_tokens, ignore_eos=True)
    run_to_completion(spec, [by_length, by_stop, other])
    assert by_length.output_token_ids == ref[0].output_token_ids[:max_tokens]
    assert by_stop.output_token_ids == ref[0].output_token_ids[:ref[0].output_token_ids.index(stop) + 1]
    assert other.output_token_ids == ref[1].output_token_ids[:max_tokens]
    assert by_stop.num_accepted_tokens > 0
    assert spec.scheduler.kv.pool.num_free_blocks == spec.scheduler.kv.pool.num_blocks


def test_no_drafts_above_the_batch_size_limit_or_for_sampled_requests(real_model_dir, prompts):
    parts = _engine(real_model_dir, 3, disable_batch_size=2)
    batch = [_greedy(f"g{i}", p, 8) for i, p in enumerate(prompts[:3])]
    run_to_completion(parts, batch)  # three running > 2: no drafts
    assert all(q.num_draft_tokens == 0 for q in batch)
    sampled = Request("t", prompts[0], SamplingParams(temperature=0.8, seed=1, max_tokens=8), eos_token_ids=(2,))
    penalized = _greedy("p", prompts[0], 8, repetition_penalty=1.3)
    with_logprobs = _greedy("l", prompts[0], 8, logprobs=2)
    for q in (sampled, penalized, with_logprobs):
        run_to_completion(parts, [q])
        assert q.num_draft_tokens == 0
    solo = _greedy("solo", prompts[0], 8)
    run_to_completion(parts, [solo])
    assert solo.num_accepted_tokens > 0 and solo.output_token_ids == batch[0].output_token_ids


def test_drafts_only_take_blocks_no_other_request_could_need(tiny_model_dir):
    """Draft slots beyond a request's blocks come only from spare blocks: one per running request plus the step's
    remaining budget stay free for the others, so speculation never causes a preemption."""
    parts = build_engine(EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), kv_tokens=16 * 6, max_model_len=512,
                                    max_num_batched_tokens=32, burst_prefill_tokens=0, speculative_ngram_tokens=4,
                                    speculative_ngram_min=1))
    s = parts.scheduler
    req = Request("a", list(range(100, 116)), SamplingParams(temperature=0.0, max_tokens=40), eos_token_ids=(2,))
    assert s.add_request(req) is None
    s.update(out := s.schedule(), parts.runner.execute(out))  # prefill: one full block, then the first token
    assert len(s.kv.get_block_table("a")) == 1 and s.kv.pool.num_free_blocks == 5
    # drafts need a second block; the margin is 1 running request + 2 blocks of budget = 3, and 5 - 1 >= 3
    assert s._allocate_drafts(req, 4, budget=32)
    assert len(s.kv.get_block_table("a")) == 2
    s.kv.pool.allocate(2)  # another request takes two: 2 free, 2 - 1 < 3
    req.num_computed_tokens = 32  # as if at the next block boundary
    assert not s._allocate_drafts(req, 4, budget=32)
    assert len(s.kv.get_block_table("a")) == 2 and s.kv.pool.num_free_blocks == 2
    # within the blocks it holds, drafts need nothing spare
    req.num_computed_tokens = 20
    assert s._allocate_drafts(req, 4, budget=32)


@pytest.mark.e2e
@pytest.mark.parametrize("colocated", [False, True])
def test_cluster_with_speculation_matches_hf_and_reports_acceptance(real_model_dir, tokenizer, colocated, launch):
    """Real processes with --speculative-ngram-tokens: three concurrent greedy requests (under the batch limit)
    equal HF, their final usage counts drafts and accepted drafts, and the decode worker's Prometheus counters hold
    the same sums."""
    from pdserve import SamplingParams as Params
    from helpers import complete_all, scrape, total

    c = launch(real_model_dir, "SmolLM2-135M-Instruct", colocated=colocated,
               worker_args=["--dtype", "float32", "--kv-tokens", "4096", "--max-model-len", "512",
                            "--speculative-ngram-tokens", "4", "--metrics-port", "0"])

    outs = complete_all(c.address, [(t, Params(max_tokens=20, temperature=0.0)) for t in TEXTS[:3]])
    for text, out in zip(TEXTS, outs):
        assert out.token_ids == hf_greedy(real_model_dir, tokenizer(text).input_ids, 20), text
    assert outs[0].spec_accepted_tokens >= 8 and outs[0].spec_draft_tokens >= outs[0].spec_accepted_tokens
    decode = scrape(c.metrics_urls["colocated-0" if colocated else "decode-0"])
    assert total(decode, "pdserve:spec_decode_num_draft_tokens_total") == sum(o.spec_draft_tokens for o in outs)
    assert total(decode, "pdserve:spec_decode_num_accepted_tokens_total") == sum(
        o.spec_accepted_tokens for o in outs)
