"""End-to-end: real coordinator + prefill + decode processes on ports chosen at run time, driven through the SDK."""
import asyncio
import random
import re
from pathlib import Path

import grpc
import pytest

from conftest import hf_greedy
from helpers import (assert_idle, complete_all, generate_with_random_cancels, greedy, scrape, total, wait_for,
                     worker_stats)
from pdserve import AsyncClient, Client, SamplingParams

pytestmark = pytest.mark.e2e

WORKER_ARGS = ["--dtype", "float32", "--kv-tokens", "4096", "--max-model-len", "1024", "--log-level", "INFO"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors:", "Water boils at",
           "Once upon a time", "import numpy as np\n", "The quick brown fox", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def cluster(real_model_dir, launch_module):
    return launch_module(real_model_dir, "SmolLM2-135M-Instruct", worker_args=WORKER_ARGS)


def test_model_info(cluster):
    with Client(cluster.address) as c:
        info = c.model_info()
    assert info.model == "SmolLM2-135M-Instruct" and info.topology == "disaggregated"
    assert info.vocab_size == 49152 and info.kv_connector in ("ucx", "tcp")


def test_coordinator_process_never_loads_torch(cluster):
    """The running coordinator (started by the CLI, tokenizer loaded, requests served) maps no torch or triton."""
    with Client(cluster.address) as c:
        c.complete([{"role": "user", "content": "Hi"}], greedy(2))
    maps = Path(f"/proc/{cluster.processes['coordinator'].pid}/maps").read_text()
    assert "libtorch" not in maps and "triton" not in maps
    worker_maps = Path(f"/proc/{cluster.processes['decode-0'].pid}/maps").read_text()
    assert "libtorch" in worker_maps  # the check can see it where it is


def test_greedy_matches_hf_on_real_model(cluster, tokenizer, real_model_dir):
    with Client(cluster.address) as c:
        for prompt in PROMPTS[:3]:
            out = c.complete(prompt, greedy(24, ignore_eos=True))
            ids = tokenizer(prompt)["input_ids"]
            assert out.token_ids == hf_greedy(real_model_dir, ids, 24), prompt
            assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
            assert out.finish_reason == "length" and out.prompt_tokens == len(ids)
            assert out.timings["transfer_ms"] > 0 and out.timings["ttft_ms"] > 0
    assert_idle(cluster)


def test_concurrent_requests_match_hf(cluster, tokenizer, real_model_dir):
    lengths = [5, 30, 12, 40, 8, 20, 3, 16]

    outs = complete_all(cluster.address, [(p, greedy(n, ignore_eos=True)) for p, n in zip(PROMPTS, lengths)])
    for p, n, out in zip(PROMPTS, lengths, outs):
        assert out.token_ids == hf_greedy(real_model_dir, tokenizer(p)["input_ids"], n), p
    assert_idle(cluster)


def test_short_request_overtakes_long_one(cluster):
    """Continuous batching: a short request arriving while a long one decodes joins the running batch and
    finishes first; the decode worker's step log shows both joining and the short one leaving."""

    async def main():
        async with AsyncClient(cluster.address) as c:
            finished = []

            async def run(rid, n):
                out = await c.complete("Tell me a long story about a dragon.", greedy(n, ignore_eos=True),
                                       request_id=rid)
                finished.append(rid)
                return out

            long_task = asyncio.create_task(run("long-1", 150))
            async for chunk in c.generate("Hi", greedy(150, ignore_eos=True), request_id="warm"):
                break  # make sure decoding is under way before the short request arrives
            await asyncio.sleep(0.5)
            await run("short-1", 5)
            await long_task
            return finished

    assert asyncio.run(main()) == ["short-1", "long-1"]
    log = open(cluster.log_files["decode-0"]).read()
    joined = re.findall(r"step (\d+): batch=(\d+) tokens=\d+ joined=\[([^\]]*)\] left=\[([^\]]*)\]", log)
    # Workers know a request by its id scoped to the caller ("peer:.../long-1", `coordinator.flow.scoped_id`).
    join_step = {rid: int(s) for s, _, j, _ in joined for rid in re.findall(r"'[^']*/([^'/]+)'", j)}
    leave_step = {rid: int(s) for s, _, _, lft in joined for rid in re.findall(r"'[^']*/([^'/]+)'", lft)}
    assert join_step["long-1"] < join_step["short-1"] < leave_step["short-1"] < leave_step["long-1"]
    assert any(int(b) >= 2 and "short-1" in j for _, b, j, _ in joined)
    assert_idle(cluster)


def test_parallel_sampling_forks_one_prefill_into_n_samples(cluster, tokenizer, real_model_dir):
    """n=4 through the disaggregated cluster (the samples fork where they decode): greedy samples all equal HF's
    greedy output; seeded samples at temperature 1 differ, and each sample's final message counts its own tokens."""
    prompt = PROMPTS[0]
    expected = hf_greedy(real_model_dir, tokenizer(prompt)["input_ids"], 16)
    with Client(cluster.address) as c:
        outs = c.complete_samples(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, n=4))
        assert [o.index for o in outs] == [0, 1, 2, 3]
        assert all(o.token_ids == expected and o.completion_tokens == 16 for o in outs)
        sampled = c.complete_samples(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=7, n=4,
                                                            ignore_eos=True))
        assert len({tuple(o.token_ids) for o in sampled}) > 1
        with pytest.raises(ValueError, match="complete_samples"):
            c.complete(prompt, SamplingParams(max_tokens=4, n=2))
    assert_idle(cluster)


@pytest.mark.parametrize("prompt,sampling,needle", [
    ("", greedy(4), "prompt is empty"),
    ([], greedy(4), "prompt is empty"),
    ("x " * 1100, greedy(4), "context window"),
    ("hi", SamplingParams(max_tokens=0), "max_tokens must be >= 1"),
    ("hi", SamplingParams(max_tokens=5000), "exceeds the context window"),
    ("hi", SamplingParams(max_tokens=4, temperature=-1.0), "temperature"),
    ("hi", SamplingParams(max_tokens=4, top_p=0.0), "top_p"),
    ("hi", SamplingParams(max_tokens=4, top_p=1.5), "top_p"),
    ([1, 2, 10 ** 6], greedy(4), "outside the vocabulary"),
    ([{"role": "wizard", "content": "hi"}], greedy(4), "role"),
    ("hi", SamplingParams(max_tokens=4, n=65), "sampling.n must be in [1, 64]"),
])
def test_bad_input_is_invalid_argument(cluster, prompt, sampling, needle):
    with Client(cluster.address) as c:
        with pytest.raises(grpc.RpcError) as e:
            list(c.generate(prompt, sampling))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in e.value.details()


def test_unknown_model_is_invalid_argument(cluster):
    with Client(cluster.address) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.complete("hi", greedy(2), model="gpt-9")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown model" in e.value.details()


def test_chat_and_stop_string(cluster):
    with Client(cluster.address) as c:
        full = c.complete([{"role": "user", "content": "Count from 1 to 10."}], greedy(40))
        stop = full.text.strip()[3:6]  # a stop string taken from inside the real output
        cut = c.complete([{"role": "user", "content": "Count from 1 to 10."}], greedy(40, stop=[stop]))
    assert cut.finish_reason == "stop" and cut.matched_stop == stop
    assert cut.text == full.text[:full.text.index(stop)]
    assert_idle(cluster)


def test_cancel_and_abort_free_every_block(cluster):
    with Client(cluster.address) as c:
        stream = c.generate("Write a poem.", greedy(200, ignore_eos=True), request_id="to-cancel")
        next(stream)
        next(stream)
        stream.close()  # client cancellation mid-stream
        assert_idle(cluster)

        stream = c.generate("Write a poem.", greedy(200, ignore_eos=True), request_id="to-abort")
        next(stream)
        assert c.abort("to-abort")
        chunks = list(stream)
        assert chunks[-1].final.finish_reason == "abort"
        assert not c.abort("to-abort")
    assert_idle(cluster)


def test_random_cancellations_do_not_leak(cluster):
    generate_with_random_cancels(cluster.address, [PROMPTS[i % len(PROMPTS)] for i in range(100)], random.Random(7),
                                 max_tokens=(2, 12), cancel_after=[None, 0, 1, 3], concurrency=16,
                                 total_timeout_s=600, id_prefix="rc")
    assert_idle(cluster)


@pytest.mark.parametrize("mode", ["ucx", "tcp", "nccl", "colocated", "tcp+layerwise", "nccl+layerwise"])
def test_tiny_model_cluster_matches_hf(tiny_model_dir, mode, launch):
    """A random-weight Llama built from a config, through each topology / connector (whole blocks after the first
    token, or layer-wise streaming during the last prefill chunk), equals HF greedy. A budget of 32 tokens (bursts
    off) makes the 40- and 64-token prompts chunked, so layer-wise streaming sends earlier chunks' blocks too; the last
    request (max_tokens 1) finishes at its first token, which ends a layer-wise stream without decoding. The
    49-token prompt comes again at the end: the prefill worker's prefix cache then holds all but its last token,
    a one-token last chunk (its layer-wise stream once waited forever for a signal that never came)."""
    connector, _, layerwise = mode.partition("+")
    args = ["--dtype", "float32", "--kv-tokens", "2048", "--max-model-len", "512", "--max-num-batched-tokens", "32",
            "--burst-prefill-tokens", "0", "--connector", "tcp" if mode == "colocated" else connector,
            *(["--kv-layerwise"] if layerwise else [])]
    c = launch(tiny_model_dir, colocated=mode == "colocated", worker_args=args)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (3, 17, 40, 64, 20)]
    lengths = [6, 7, 8, 9, 1]

    outs = complete_all(c.address, [(p, greedy(n, ignore_eos=True)) for p, n in zip(prompts, lengths)])
    for p, n, out in zip(prompts, lengths, outs):
        assert out.token_ids == hf_greedy(tiny_model_dir, p, n)
    again = prompts[3][:49]
    with Client(c.address) as client:
        client.complete(again, greedy(3, ignore_eos=True))
        repeat = client.complete(again, greedy(3, ignore_eos=True), timeout=60)
        info = client.model_info()
    assert repeat.cached_prompt_tokens == 48 and repeat.token_ids == hf_greedy(tiny_model_dir, again, 3)
    assert info.topology == ("colocated" if mode == "colocated" else "disaggregated")
    assert info.kv_connector == ("" if mode == "colocated" else connector)
    assert_idle(c)


def test_a_bf16_kv_cache_travels_between_fp32_workers(tiny_model_dir, launch):
    """--kv-cache-dtype bfloat16 on both workers: the prefill worker writes bf16 K/V, the blocks travel at half the
    bytes, and the decode worker continues from them; every stream equals the in-process engine's with the same
    flags (the same kernels over the same bf16 cache), one request at a time."""
    from pdserve_server.engine.args import EngineArgs
    from pdserve_server.engine.builder import build_engine
    from pdserve_server.engine.offline import generate
    from pdserve_server.engine.request import SamplingParams as EngineSampling

    args = ["--dtype", "float32", "--kv-cache-dtype", "bfloat16", "--kv-tokens", "2048", "--max-model-len", "512",
            "--max-num-batched-tokens", "32", "--connector", "tcp"]
    c = launch(tiny_model_dir, worker_args=args)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 40)]
    with Client(c.address) as client:
        outs = [client.complete(p, greedy(8, ignore_eos=True), timeout=120).token_ids for p in prompts]
    parts = build_engine(EngineArgs(model_dir=str(tiny_model_dir), dtype="float32", kv_cache_dtype="bfloat16",
                                    kv_tokens=2048, max_model_len=512, max_num_batched_tokens=32))
    assert str(parts.runner.kv_cache.kv.dtype) == "torch.bfloat16"
    assert outs == generate(parts, [[p] for p in prompts], EngineSampling(max_tokens=8, temperature=0.0,
                                                                          ignore_eos=True))
    assert_idle(c)


def test_two_prefill_two_decode_workers_all_take_requests(tiny_model_dir, launch):
    """Routing spreads load per role: sequential requests alternate, concurrent ones spread by load."""
    c = launch(tiny_model_dir, worker_args=["--dtype", "float32", "--kv-tokens", "2048", "--max-model-len", "512",
                                            "--connector", "tcp"], num_prefill=2, num_decode=2)

    def steps():
        return {name: worker_stats(c, name).num_steps for name in c.worker_addresses}

    with Client(c.address) as client:
        for i in range(2):
            client.complete([5 + i] * 20, greedy(4, ignore_eos=True))
    after_sequential = steps()
    assert all(n > 0 for n in after_sequential.values()), after_sequential

    complete_all(c.address, [([7 + i] * 30, greedy(6, ignore_eos=True)) for i in range(8)])
    after_burst = steps()
    assert all(after_burst[n] > after_sequential[n] for n in after_burst), (after_sequential, after_burst)
    assert_idle(c)


@pytest.mark.parametrize("kv_events", [False, True], ids=["inferred", "kv-events"])
def test_shared_system_prompt_goes_to_the_prefill_worker_that_holds_it(tiny_model_dir, launch, kv_events):
    """Prefix-aware routing: the second request with the same 256-token system prompt lands on the prefill worker
    that computed it and reports those tokens as cached; plain rotation would have sent it to the other one. The
    coordinator's index comes from its own routing, or from the workers' KV events (`--kv-events`: routing records
    nothing for a followed worker, so only the events can steer the second request)."""
    c = launch(tiny_model_dir, worker_args=["--dtype", "float32", "--kv-tokens", "4096", "--max-model-len", "512",
                                            "--connector", "tcp", *(["--kv-events"] if kv_events else [])],
               num_prefill=2)

    def followed() -> bool:
        log = Path(c.log_files["coordinator"]).read_text()
        return all(f"following the KV events of worker {a}" in log for a in c.worker_addresses.values())

    if kv_events:  # before the first request, so that nothing but the events can fill the index
        wait_for(followed, 60, "the coordinator following every worker's KV events")
    system = list(range(2000, 2256))
    with Client(c.address) as client:
        first = client.complete(system + [7, 8, 9], greedy(4, ignore_eos=True))
        second = client.complete(system + [10, 11], greedy(4, ignore_eos=True))
        third = client.complete(system + [12], greedy(4, ignore_eos=True))
    assert first.cached_prompt_tokens == 0
    assert second.cached_prompt_tokens == 256 and third.cached_prompt_tokens == 256
    queried = [worker_stats(c, name).prefix_cache_query_tokens for name in ("prefill-0", "prefill-1")]
    assert sorted(queried) == [0, 259 + 258 + 257]  # every request went to the one worker
    assert second.token_ids == hf_greedy(tiny_model_dir, system + [10, 11], 4)
    assert followed() == kv_events


@pytest.mark.parametrize("layerwise", [False, True])
def test_decode_workers_cached_prefix_shrinks_the_transfer(tiny_model_dir, layerwise, launch):
    """Only what is missing moves: a second request sharing a 64-token prefix with the first finds those 4 blocks
    (block size 16) in the decode worker's prefix cache, so the prefill worker sends 1 block instead of 5, whole
    or layer by layer; greedy output still equals HF's."""
    c = launch(tiny_model_dir, worker_args=["--dtype", "float32", "--kv-tokens", "2048", "--max-model-len", "512",
                                            "--connector", "tcp", "--metrics-port", "0",
                                            *(["--kv-layerwise"] if layerwise else [])])
    shared = list(range(3000, 3064))

    mode = "layers" if layerwise else "blocks"

    def sent_bytes() -> float:
        return total(scrape(c.metrics_urls["prefill-0"]), "pdserve:kv_transfer_bytes_sum", mode=mode)

    with Client(c.address) as client:
        first = client.complete(shared + [7, 8, 9], greedy(5, ignore_eos=True))
        first_bytes = sent_bytes()
        second = client.complete(shared + [10, 11], greedy(5, ignore_eos=True))
        second_bytes = sent_bytes() - first_bytes
    assert first_bytes > 0 and second_bytes == first_bytes / 5  # 67 tokens = 5 blocks; then 1 of 5
    assert worker_stats(c, "decode-0").prefix_cache_hit_tokens == 64
    assert first.token_ids == hf_greedy(tiny_model_dir, shared + [7, 8, 9], 5)
    assert second.token_ids == hf_greedy(tiny_model_dir, shared + [10, 11], 5)
    assert_idle(c)
