"""Engine-level tests on a tiny random-weight Llama: greedy equals HF transformers, chunked prefill, prefix cache,
preemption by recompute, remote-KV reservations, and seeded sampling."""
import os
import random

import pytest
import torch

from conftest import hf_greedy
from pdserve_server.engine.args import EngineArgs
from pdserve_server.engine.builder import build_engine
from pdserve_server.engine.errors import ErrorKind
from pdserve_server.engine.offline import run_until_idle
from pdserve_server.engine.outputs import TokenOutput
from pdserve_server.engine.request import Request, RequestStatus, SamplingParams
from pdserve_server.engine.execution.sampler import greedy_argmax


def run_to_completion(parts, requests, max_steps=10_000):
    """Steps taken to finish `requests` (engine.offline.run_until_idle), with the block pool intact after."""
    steps = []
    run_until_idle(parts, requests, on_step=steps.append, max_steps=max_steps)
    assert parts.scheduler.kv.pool.integrity_errors() == []
    return len(steps)


def greedy(rid, prompt, n, **kw):
    return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw),
                   eos_token_ids=(2,))


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 5, 16, 17, 40, 63, 100, 7, 33)]


@pytest.mark.parametrize("budget,num_blocks,backend", [
    (512, 256, "torch"), (24, 256, "torch"), (512, 20, "torch"), (24, 256, "cpu"), (512, 20, "cpu"),
    pytest.param(24, 256, "triton", marks=pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1")),
])
def test_concurrent_greedy_matches_hf(tiny_model_dir, prompts, budget, num_blocks, backend):
    """Mixed lengths in one batch; a small budget forces chunked prefill (so chunks attend over cached blocks);
    a small pool forces preemption. The Triton row runs the whole model through the kernels."""
    parts = build_engine(EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), block_size=8,
                                    kv_tokens=num_blocks * 8,
                                    max_num_batched_tokens=budget, burst_prefill_tokens=0, max_model_len=512,
                                    attention_backend=backend))
    assert parts.runner.attention_ops.name == backend
    reqs = [greedy(f"r{i}", p, 4 + 3 * i) for i, p in enumerate(prompts)]
    run_to_completion(parts, reqs)
    for req, p in zip(reqs, prompts):
        assert req.output_token_ids == hf_greedy(tiny_model_dir, p, req.sampling.max_tokens), req.request_id
    pool = parts.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_prefix_cache_hit_gives_same_tokens(tiny_model_dir, prompts):
    parts = build_engine(EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), block_size=8, kv_tokens=2048,
                                    max_model_len=512))
    first = greedy("a", prompts[6], 6)
    run_to_completion(parts, [first])
    again = greedy("b", prompts[6][:96] + [5, 6, 7], 6)
    run_to_completion(parts, [again])
    assert again.num_cached_tokens == 96
    assert again.output_token_ids == hf_greedy(tiny_model_dir, again.prompt_token_ids, 6)


def test_remote_kv_request_reserves_then_decodes(tiny_model_dir, prompts):
    """Decode-side path: reserve blocks, fill them (here by a prefill-only engine), join the batch."""
    args = EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), block_size=8, kv_tokens=1024, max_model_len=512)
    prefill, decode = build_engine(args), build_engine(args)
    prompt = prompts[4]
    p_req = Request("x", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), prefill_only=True)
    d_req = Request("x", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), remote_kv=True)
    assert prefill.scheduler.add_request(p_req) is None
    events = []
    while prefill.scheduler.has_work():
        out = prefill.scheduler.schedule()
        events += prefill.scheduler.update(out, prefill.runner.execute(out))
    held = events[-1]
    assert held.finish_reason.value == "prefill_done" and held.block_ids

    assert decode.scheduler.add_request(d_req) is None
    (reserved,) = decode.scheduler.reserve()
    assert len(reserved.block_ids) == len(held.block_ids)
    for src, dst in zip(held.block_ids, reserved.block_ids):  # what the connector does, minus the wire
        decode.runner.kv_cache.kv[dst] = prefill.runner.kv_cache.kv[src]
    assert decode.scheduler.kv_arrived("x", held.token.token_id) is None
    while decode.scheduler.has_work():
        out = decode.scheduler.schedule()
        assert not out.prefills  # nothing recomputed: the prompt's KV came from the prefill engine
        decode.scheduler.update(out, decode.runner.execute(out))
    assert d_req.output_token_ids == hf_greedy(tiny_model_dir, prompt, 8)
    prefill.scheduler.abort("x")  # what the prefill worker does once the KV is sent
    for e in (prefill, decode):
        assert e.scheduler.kv.pool.num_free_blocks == e.scheduler.kv.pool.num_blocks


def test_reservations_that_fill_the_pool_cannot_deadlock_the_decode_worker(tiny_model_dir):
    """Reservations used to take every free block: once their KV arrived, each request needed one more block for
    its next token, none could get it, nothing ran to free one, and the worker stalled until the leases lapsed
    (the chaos run's DEADLINE_EXCEEDED under 256-stream bursts). Now reservations leave the blocks the queued
    requests need, and when nothing runs, a waiting request is preempted (recomputed later) to let the head in."""
    parts = build_engine(EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), block_size=8, kv_tokens=8 * 12,
                                    max_model_len=64))
    s = parts.scheduler
    reqs = [Request(f"d{i}", [5 + i] * 16, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                    remote_kv=True) for i in range(8)]
    for r in reqs:
        assert s.add_request(r) is None
    reserved = []
    steps = 0
    while s.has_work() or s.reservations or reserved:
        for ev in s.reserve():
            reserved.append(ev.request_id)
        for rid in reserved:  # every reserved request's KV "arrives" at once (content irrelevant here)
            assert s.kv_arrived(rid, 7) is None
        reserved.clear()
        out = s.schedule()
        assert not out.is_empty, "decode worker stalled with KV-ready requests and a full pool"
        s.update(out, parts.runner.execute(out))
        steps += 1
        assert steps < 500
    assert all(len(r.output_token_ids) == 6 for r in reqs)
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks and s.kv.pool.integrity_errors() == []


def test_seeded_sampling_reproducible_and_split_invariant(tiny_model_dir, prompts):
    """Same seed -> same tokens, whether one engine samples everything or the first token comes from another."""
    args = EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), block_size=8, kv_tokens=1024, max_model_len=512)
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    a, b = Request("a", prompts[3], sp), Request("b", prompts[3], sp)
    run_to_completion(build_engine(args), [a])
    run_to_completion(build_engine(args), [b])
    assert a.output_token_ids == b.output_token_ids
    c = Request("c", prompts[3], SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True))
    run_to_completion(build_engine(args), [c])
    assert c.output_token_ids != a.output_token_ids


def test_stop_token_and_min_tokens(tiny_model_dir, prompts):
    args = EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), block_size=8, kv_tokens=1024, max_model_len=512)
    ref = hf_greedy(tiny_model_dir, prompts[2], 6)
    stop = Request("s", prompts[2], SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=(ref[2],)))
    run_to_completion(build_engine(args), [stop])
    assert stop.output_token_ids == ref[:ref.index(ref[2]) + 1] and stop.finish_reason.value == "stop"
    held_back = Request("m", prompts[2], SamplingParams(temperature=0.0, max_tokens=6, min_tokens=4,
                                                        stop_token_ids=(ref[0],)))
    run_to_completion(build_engine(args), [held_back])
    assert ref[0] not in held_back.output_token_ids[:4]


def test_request_that_can_never_fit_is_rejected(tiny_model_dir):
    parts = build_engine(EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), block_size=8, kv_tokens=64,
                                    max_model_len=512))
    failure = parts.scheduler.add_request(greedy("big", [5] * 60, 20))
    assert failure is not None and failure.kind == ErrorKind.CAPACITY


def test_a_request_resumed_with_its_outputs_continues_the_same_stream(tiny_model_dir, prompts):
    """Migration resumes a request on another worker with the tokens already sent as its first outputs: seeded
    sampling, penalties and max_tokens go on as if nothing happened."""
    args = EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), block_size=8, kv_tokens=1024, max_model_len=512)
    sp = SamplingParams(temperature=1.0, top_k=40, seed=7, max_tokens=12, frequency_penalty=0.5, ignore_eos=True)
    whole = Request("w", prompts[4], sp)
    run_to_completion(build_engine(args), [whole])
    resumed = Request("r", prompts[4], sp, output_token_ids=whole.output_token_ids[:5])
    run_to_completion(build_engine(args), [resumed])
    assert resumed.output_token_ids == whole.output_token_ids


class RecordingProgress:
    """Stands in for `KvLayerProgress` on the engine thread: snapshots the request's cache at every layer signal."""

    def __init__(self, kv):
        self.kv, self.block_ids, self.snapshots = kv, None, []

    def begin(self, block_ids, num_tokens):
        self.block_ids, self.num_tokens = list(block_ids), num_tokens

    def layer_written(self, layer, device):
        self.snapshots.append((layer, self.kv[self.block_ids].clone()))


def test_layer_signals_come_as_each_layer_of_the_last_chunk_is_written(tiny_model_dir, prompts):
    """Layer-wise streaming's engine half: only the last chunk signals; at layer l's signal that layer's K/V is
    final for every block of the request (earlier chunks included) and layer l+1's is not yet written."""
    parts = build_engine(EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), block_size=8, kv_tokens=64 * 8,
                                    max_num_batched_tokens=24, burst_prefill_tokens=0, max_model_len=512))
    kv = parts.runner.kv_cache.kv  # [blocks, layers, 2, block_size, kv_heads, head_dim]
    prompt = prompts[6][:60]  # 60 tokens in chunks of 24: the signals come in the third step only
    req = Request("s", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), prefill_only=True)
    req.kv_layers = progress = RecordingProgress(kv)
    s, r = parts.scheduler, parts.runner
    assert s.add_request(req) is None
    steps_with_signals = []
    for _ in range(3):
        out = s.schedule()
        before = len(progress.snapshots)
        s.update(out, r.execute(out))
        steps_with_signals.append(len(progress.snapshots) - before)
    num_layers = kv.shape[1]
    assert steps_with_signals == [0, 0, num_layers] and req.status == RequestStatus.HELD
    assert progress.num_tokens == 60 and progress.block_ids == s.kv.get_block_table("s")[:8]
    final = kv[progress.block_ids]
    for layer, snap in progress.snapshots:
        assert torch.equal(snap[:, layer], final[:, layer])
        if layer + 1 < num_layers:  # the last chunk's tokens of the next layer are not written yet
            assert not torch.equal(snap[:, layer + 1], final[:, layer + 1])
    assert [layer for layer, _ in progress.snapshots] == list(range(num_layers))


def test_a_one_token_last_chunk_streams_its_layers_too(tiny_model_dir, prompts):
    """A prefix-cache hit up to the last token leaves a last chunk of one token, which the scheduler files under
    decodes: it must signal every layer all the same (it did not, and its KV sender waited forever)."""
    parts = build_engine(EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), block_size=8, kv_tokens=64 * 8,
                                    max_model_len=512))
    kv = parts.runner.kv_cache.kv
    prompt = prompts[6][:25]  # 3 full blocks of 8 + 1 token
    first = Request("a", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), prefill_only=True)
    s, r = parts.scheduler, parts.runner
    assert s.add_request(first) is None
    out = s.schedule()
    s.update(out, r.execute(out))
    s.abort("a")  # its full blocks stay in the prefix cache
    second = Request("b", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), prefill_only=True)
    second.kv_layers = progress = RecordingProgress(kv)
    assert s.add_request(second) is None
    out = s.schedule()
    assert len(out.decodes) == 1 and not out.prefills and second.num_cached_tokens == 24
    s.update(out, r.execute(out))
    assert [layer for layer, _ in progress.snapshots] == list(range(kv.shape[1]))
    assert progress.num_tokens == 25 and second.status == RequestStatus.HELD


@pytest.mark.parametrize("vocab", [100, 3000, 32000, 49152, 151936])
def test_greedy_argmax_equals_torch_argmax(vocab):
    """The sampler's two-pass argmax (engine.execution.sampler.greedy_argmax) gives torch's answer, first index on ties
    and NaN as the maximum included, for vocabularies with and without a partial last chunk, fp32 and bf16: the cases
    of 5 rows or more through the two passes, those of 1 and 4 rows (below TWO_PASS_ROWS) through torch's argmax."""
    g = torch.Generator().manual_seed(vocab)
    cases = [torch.randn(9, vocab, generator=g), torch.zeros(5, vocab), torch.randn(5, vocab, generator=g).bfloat16(),
             torch.randn(1, vocab, generator=g), torch.randn(4, vocab, generator=g)]
    edges = torch.randn(5, vocab, generator=g)
    edges[0, -1] = edges[1, 0] = edges[2, vocab // 2] = 1e9  # the maximum in the last, first and middle columns
    edges[3, [7, vocab - 3]] = 50.0  # a tie: the first index wins
    edges[4, vocab - 2] = float("nan")
    cases += [edges, torch.full((5, vocab), float("-inf"))]
    for logits in cases:
        assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))


def test_sampler_reads_bf16_logits_as_their_fp32_widening():
    """compute_logits hands the sampler the model's own dtype; greedy rows take the argmax of bf16 as it is and the
    other rows (seeded draws, penalties, logprobs) are widened to fp32 first, so every token and logprob equals what
    the same logits widened to fp32 give."""
    from pdserve_server.engine.execution.sampler import Sampler

    logits = (torch.randn(4, 3000, generator=torch.Generator().manual_seed(0)) * 4).bfloat16()
    logits[0, [11, 2500]] = 40.0  # a tie for the greedy row: the first index wins in both dtypes
    params = [SamplingParams(max_tokens=4, temperature=0.0),
              SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=7, logprobs=3),
              SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.3, logprobs=2),
              SamplingParams(max_tokens=4, temperature=1.0, top_k=50, seed=3)]

    def sample(x):
        reqs = [Request(f"r{i}", [5, 11, 2500], sp) for i, sp in enumerate(params)]
        return Sampler(3000, seed=0)(x, reqs).sampled

    ours, widened = sample(logits), sample(logits.float())
    assert ours == widened and ours["r0"].token_id == 11
    assert ours["r1"].logprob is not None and len(ours["r1"].top_logprobs) == 3


def test_run_until_idle_raises_on_a_refused_request_and_on_a_stalled_scheduler():
    """engine.offline.run_until_idle reports instead of spinning: a refused admission is a ValueError naming the
    request, and a scheduler that schedules nothing while it still has work is a RuntimeError."""
    from types import SimpleNamespace

    from pdserve_server.engine.outputs import RequestFailed, SchedulerOutput

    class Stuck:
        def __init__(self, refuse):
            self.refuse = refuse

        def add_request(self, req):
            return RequestFailed(req.request_id, ErrorKind.CAPACITY, "too big") if self.refuse else None

        def has_work(self):
            return True

        def schedule(self):
            return SchedulerOutput()

    req = Request("r0", [1, 2, 3], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="r0 refused: CAPACITY: too big"):
        run_until_idle(SimpleNamespace(scheduler=Stuck(refuse=True), runner=None), [req])
    with pytest.raises(RuntimeError, match="stalled"):
        run_until_idle(SimpleNamespace(scheduler=Stuck(refuse=False), runner=None), [req])


def test_grammar_setup_is_paid_at_build_and_an_unreadable_tokenizer_only_warns(tiny_model_dir, tmp_path, caplog):
    """The grammar engine's tokenizer loads when the engine is built (a first constrained request used to pay it);
    a tokenizer.json llguidance cannot read is a warning then, and the engine still builds and serves."""
    import shutil

    parts = build_engine(EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), kv_tokens=1024, max_model_len=256))
    assert parts.scheduler.grammars._tokenizer is not None
    broken = tmp_path / "model"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "tokenizer.json").write_text("{not json")
    with caplog.at_level("WARNING", logger="pdserve_server.engine.builder"):
        parts = build_engine(EngineArgs(dtype="float32", model_dir=str(broken), kv_tokens=1024, max_model_len=256))
    assert "structured outputs will be refused" in caplog.text
    request = Request("r", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    outputs = run_until_idle(parts, [request])
    assert sum(isinstance(o, TokenOutput) and o.request_id == "r" for o in outputs) == 3
