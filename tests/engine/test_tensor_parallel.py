"""Tensor parallelism inside a worker (`engine.parallel.tensor_parallel`, `engine.core.ranks`): two gloo ranks of
one thread each give the same greedy tokens as one rank, for a dense model and a mixture-of-experts model; the weights
are cut as `engine.models.sharding` says; a rank's death ends its engine process at once, leaving no rank behind."""
import asyncio
import os
import signal
import time

import pytest
import torch

from pdserve_server.engine.args import EngineArgs
from pdserve_server.engine.models.config import ModelConfig
from pdserve_server.engine.errors import EngineError, ErrorKind
from pdserve_server.engine.models.sharding import shard, vocab_per_rank
from pdserve_server.engine.parallel.tensor_parallel import TensorParallel
from pdserve_server.engine.core.process_engine import ProcessEngine
from helpers import children_of, gone
from test_engine_process import PROMPTS, generate, greedy

pytestmark = pytest.mark.e2e  # starts real rank processes


def engine_args(model_dir, tp: int, **kw) -> EngineArgs:
    return EngineArgs(dtype="float32", model_dir=str(model_dir), block_size=8, kv_tokens=2048, max_model_len=512,
                      max_num_batched_tokens=32, burst_prefill_tokens=0, tensor_parallel_size=tp, **kw)


def run_engine(args: EngineArgs, scenario):
    async def main():
        engine = ProcessEngine(args, threads=2)
        await engine.start()
        try:
            return await scenario(engine)
        finally:
            engine.stop()
    return asyncio.run(main())


def greedy_outputs(args: EngineArgs, prompts, n: int) -> list[list[int]]:
    async def scenario(engine):
        return await asyncio.gather(*(generate(engine, greedy(f"r{i}", p, n)) for i, p in enumerate(prompts)))
    return run_engine(args, scenario)


def test_tp2_greedy_equals_tp1_dense(tiny_model_dir):
    """64 greedy tokens for four prompts batched together (chunked prefill under a 32-token budget, then decode)."""
    one = greedy_outputs(engine_args(tiny_model_dir, 1), PROMPTS, 64)
    two = greedy_outputs(engine_args(tiny_model_dir, 2), PROMPTS, 64)
    assert all(len(o) == 64 for o in one)
    assert two == one


def test_each_rank_shares_its_own_kv_shard_with_the_worker(tiny_model_dir):
    """Under TP 2 the worker maps two shards, one allocated by each rank (rank 1's passes through rank 0 as bytes,
    unopened there): a prefill writes the request's blocks in both, and each holds only its own heads' K/V (the
    two shards differ)."""
    from pdserve_server.engine.request import FinishReason, Request, SamplingParams

    async def scenario(engine):
        assert len(engine.kv.shards) == 2 and all(s.is_shared() for s in engine.kv.shards)
        assert engine.kv.shards[0].data_ptr() != engine.kv.shards[1].data_ptr()
        req = Request("held", PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0), prefill_only=True)
        with engine.request(req) as stream:
            ev = await stream.next()
            assert ev.finish_reason == FinishReason.PREFILL_DONE and ev.block_ids
            first = [s[ev.block_ids[0]].clone() for s in engine.kv.shards]
            unused = [s[engine.cache_config.num_blocks - 1].abs().sum().item() for s in engine.kv.shards]
        return first, unused
    first, unused = run_engine(engine_args(tiny_model_dir, 2), scenario)
    assert all(block.abs().sum().item() > 0 for block in first) and unused == [0, 0]
    assert not torch.equal(first[0], first[1])


def test_ranks_get_one_gpu_each_and_too_few_gpus_are_refused(monkeypatch):
    """Rank r of a worker on cuda:k runs on cuda:k+r; CPU ranks share the CPU; a group needing more GPUs than
    there are is refused before anything starts, naming the GPUs asked for and those present."""
    from pdserve_server.engine.parallel.tensor_parallel import check_devices, rank_device

    assert [rank_device("cuda", r) for r in range(2)] == ["cuda:0", "cuda:1"]
    assert [rank_device("cuda:2", r) for r in range(3)] == ["cuda:2", "cuda:3", "cuda:4"]
    assert rank_device("cpu", 3) == "cpu"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    check_devices("cuda:2", 2)
    check_devices("cuda:7", 1)  # no tensor parallelism: the device is the user's to name
    with pytest.raises(ValueError, match=r"GPUs cuda:2 \.\. cuda:4; this machine has 4 GPU"):
        check_devices("cuda:2", 3)
    with pytest.raises(ValueError, match="runs on cpu or cuda"):
        check_devices("meta", 2)


@pytest.mark.parametrize("second", ["exit", "hang"])
def test_rank_that_never_sends_its_shard_fails_the_build_with_its_name(second):
    """Rank 0 gathers the ranks' KV shards with bounded waits: rank 2 exiting before it sends, or hanging, is a
    build error that names it (with its exit code), not a wait without end; rank 1's shard came first."""
    import multiprocessing

    from pdserve_server.engine.core.ranks import receive_shards
    from stub_ranks import shard_rank

    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=shard_rank, args=(send, how), daemon=True)
             for (_, send), how in zip(pipes, ["send", second])]
    for p in procs:
        p.start()
    for _, send in pipes:
        send.close()
    try:
        assert pipes[0][0].poll(120)  # rank 1 has sent (its start-up is not what the deadline bounds here)
        timeout = 3.0 if second == "hang" else 120.0  # "exit" must end at the death, long before
        with pytest.raises(RuntimeError) as e:
            receive_shards([receive for receive, _ in pipes], procs, timeout_s=timeout)
        assert f"rank 2 (pid {procs[1].pid})" in str(e.value)
        assert ("exited with code 3 before sending" if second == "exit" else "did not send its KV shard within 3 s") \
            in str(e.value)
        assert all(receive.closed for receive, _ in pipes)
    finally:
        for p in procs:
            p.kill()
            p.join(10)


def test_tp2_greedy_equals_tp1_moe(tmp_path):
    """A tiny Qwen3-MoE (8 experts, top-2; layers 0-1 sparse, layer 2 dense): each rank runs every expert on half
    its intermediate features, and the dense layer's MLP on half of its own."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        mlp_only_layers=[2], initializer_range=0.1))
    with torch.no_grad():  # decisive routing and sharp logits: greedy choices far from ties
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(str(tmp_path))
    model_dir = tmp_path
    prompts = [[t % 1000 + 3 for t in p] for p in PROMPTS]
    one = greedy_outputs(engine_args(model_dir, 1, attention_backend="torch"), prompts, 64)
    two = greedy_outputs(engine_args(model_dir, 2, attention_backend="torch"), prompts, 64)
    assert two == one


def _cfg(**kw) -> ModelConfig:
    base = dict(name="m", path="", architecture="llama", vocab_size=10, hidden_size=4, intermediate_size=6,
                num_layers=1, num_heads=4, num_kv_heads=2, head_dim=2, rms_norm_eps=1e-5, rope_theta=1e4,
                max_position_embeddings=64, tie_word_embeddings=False, eos_token_ids=())
    return ModelConfig(**{**base, **kw})


def test_sharding_table():
    """q, k and v segments split separately (rank 1 gets q heads 2-3 and kv head 1); gate and up likewise; o_proj
    and down_proj by input columns; o_proj's bias on rank 0 only; the vocabulary padded to 2 x 5 rows; kv heads that
    do not split padded with zero heads (`tests/engine/test_tp_heads.py` covers the placements)."""
    cfg = _cfg()
    r0, r1 = TensorParallel(0, 2), TensorParallel(1, 2)
    qkv = torch.arange(16.0)[:, None].expand(16, 4)  # rows: q 0-7 (4 heads x 2), k 8-11, v 12-15
    assert shard("layers.0.self_attn.qkv_proj.weight", qkv, cfg, r1)[:, 0].tolist() == [4, 5, 6, 7, 10, 11, 14, 15]
    gate_up = torch.arange(12.0)[:, None].expand(12, 4)
    assert shard("layers.0.mlp.gate_up_proj.weight", gate_up, cfg, r0)[:, 0].tolist() == [0, 1, 2, 6, 7, 8]
    down = torch.arange(6.0)[None, :].expand(4, 6)
    assert shard("layers.0.mlp.down_proj.weight", down, cfg, r1)[0].tolist() == [3, 4, 5]
    bias = torch.ones(4)
    assert shard("layers.0.self_attn.o_proj.bias", bias, cfg, r0).tolist() == [1] * 4
    assert shard("layers.0.self_attn.o_proj.bias", bias, cfg, r1).tolist() == [0] * 4
    experts = torch.arange(12.0)[None, :, None].expand(3, 12, 4)  # [E, 2I, hidden]
    assert shard("layers.0.mlp.experts.gate_up_proj", experts, cfg, r1)[0, :, 0].tolist() == [3, 4, 5, 9, 10, 11]
    vocab = torch.arange(9.0)[:, None].expand(9, 4)  # 9 rows over 2 ranks: 5 each, rank 1's last one padding
    assert vocab_per_rank(9, 2) == 5
    assert shard("lm_head.weight", vocab, cfg, r1)[:, 0].tolist() == [5, 6, 7, 8, 0]
    norm = torch.ones(4)
    assert shard("layers.0.input_layernorm.weight", norm, cfg, r1) is norm  # replicated
    # 6 query / 3 kv heads on 2 ranks: rank 1 holds kv head 2 and a padding head, q heads 4-5 and two padding heads
    qkv = torch.arange(1.0, 25.0)[:, None].expand(24, 4)  # rows: q 1-12 (6 heads x 2), k 13-18, v 19-24
    assert shard("layers.0.self_attn.qkv_proj.weight", qkv, _cfg(num_heads=6, num_kv_heads=3), r1)[:, 0].tolist() == [
        9, 10, 11, 12, 0, 0, 0, 0, 17, 18, 0, 0, 23, 24, 0, 0]
    o_proj = torch.arange(1.0, 13.0)[None, :].expand(4, 12)  # columns: q heads 0-5
    assert shard("layers.0.self_attn.o_proj.weight", o_proj, _cfg(num_heads=6, num_kv_heads=3), r1)[0].tolist() == [
        9, 10, 11, 12, 0, 0, 0, 0]


def _shm_data(i: int, r: int) -> torch.Tensor:
    """Round i's tensor of rank r in `test_shm_collectives_match_on_every_rank` (shape and dtype vary)."""
    shape, dtype = [(1, 64), (7, 33), (16, 64), (2, 5)][i % 4], (torch.float32, torch.bfloat16)[i % 2]
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * i + r)).to(dtype)


def _shm_op(i: int) -> str:
    return ("all_reduce", "all_gather_last", "bytes")[i % 3]


def _shm_rank(rank: int, buffers, flags, rounds: int, results) -> None:
    """One rank: round i all-reduces, all-gathers or broadcasts (rank 0's bytes) round i's data; reports each
    result as bytes (a tensor crosses a queue as a shared-memory handle, gone once this process exits), None where
    the op refused it."""
    from pdserve_server.engine.parallel.shm_collectives import ShmCollectives

    torch.set_num_threads(1)
    shm = ShmCollectives(buffers, flags, rank)
    out = []
    for i in range(rounds):
        x = _shm_data(i, rank)
        raw = lambda t: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()  # noqa: E731
        if _shm_op(i) == "all_reduce":
            out.append(raw(x) if shm.all_reduce(x) else None)
        elif _shm_op(i) == "all_gather_last":
            got = shm.all_gather_last(x)
            out.append(None if got is None else raw(got))
        elif rank == 0:
            out.append(raw(x) if shm.send_bytes(raw(x)) else None)
        else:
            out.append(shm.recv_bytes())
    results.put((rank, out))


def test_shm_collectives_match_on_every_rank():
    """Three processes, 300 rounds of all-reduce, all-gather and broadcast of bytes, interleaved, of varying shapes
    and dtypes through both alternating buffers: every rank gets the same bits (sums to the dtype's rounding,
    every rank's tensor in rank order, rank 0's bytes), and what does not fit the buffer (16 x 64 fp32 = 4 KiB >
    3 KiB) is refused on every rank alike (the caller then uses gloo)."""
    import multiprocessing

    from pdserve_server.engine.parallel.shm_collectives import ShmCollectives

    rounds = 300
    ctx = multiprocessing.get_context("spawn")
    buffers, flags = ShmCollectives.allocate(3, 3 * 1024)
    results = ctx.Queue()
    procs = [ctx.Process(target=_shm_rank, args=(r, buffers, flags, rounds, results)) for r in range(3)]
    for p in procs:
        p.start()
    outs = dict(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(30)
    for i in range(rounds):
        like = _shm_data(i, 0)
        fits = like.nbytes + (8 if _shm_op(i) == "bytes" else 0) <= 3 * 1024
        if not fits:
            assert all(outs[r][i] is None for r in range(3)), i
            continue
        assert outs[0][i] is not None and outs[1][i] == outs[0][i] and outs[2][i] == outs[0][i], i
        if _shm_op(i) == "bytes":
            assert outs[1][i] == like.view(-1).view(torch.uint8).numpy().tobytes(), i
            continue
        parts = [_shm_data(i, r) for r in range(3)]
        if _shm_op(i) == "all_gather_last":
            expected = torch.cat(parts, dim=-1)
            shape = (*like.shape[:-1], 3 * like.shape[-1])
        else:
            expected, shape = sum(p.float() for p in parts), like.shape
        first = torch.frombuffer(bytearray(outs[0][i]), dtype=like.dtype).view(shape)
        tol = 1e-2 if first.dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(first.float(), expected.float(), rtol=tol, atol=tol)


def test_indivisible_heads_refused_at_start(tiny_model_dir):
    """The tiny Llama's 2 kv heads cannot be replicated evenly over 3 ranks: the engine refuses to start and says
    why."""
    from pdserve_server.engine.core.process_engine import EngineBuildError

    with pytest.raises(EngineBuildError, match=r"--tensor-parallel-size 3 is larger than num_key_value_heads \(2\)"):
        run_engine(engine_args(tiny_model_dir, 3), lambda engine: asyncio.sleep(0))


def test_clean_stop_exits_zero_and_leaves_no_rank(tiny_model_dir):
    """Stopping a TP 2 engine: rank 1 leaves its loop when told, and the engine process exits 0 (its rank watcher
    must not take that exit for a death)."""

    async def scenario(engine):
        await generate(engine, greedy("s", PROMPTS[0], 4))
        (rank,) = children_of(engine.pid)
        return engine, rank
    engine, rank = run_engine(engine_args(tiny_model_dir, 2), scenario)
    assert engine._process.exitcode == 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not gone(rank):
        time.sleep(0.1)
    assert gone(rank)


def test_killing_a_rank_fails_requests_and_leaves_no_process(tiny_model_dir):
    """kill -9 of rank 1 under 4 streams: every stream fails with ENGINE_DIED (UNAVAILABLE at the worker), and the
    engine process and every rank are gone (no hang in a collective, no orphan)."""

    async def scenario(engine):
        tasks = [asyncio.ensure_future(generate(engine, greedy(f"k{i}", p, 400))) for i, p in enumerate(PROMPTS)]
        while engine.stats.num_steps < 3:  # decoding
            await asyncio.sleep(0.05)
        ranks = sorted(children_of(engine.pid))
        assert len(ranks) == 1  # rank 1 (rank 0 is the engine process)
        os.kill(ranks[0], signal.SIGKILL)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return results, engine.pid, ranks[0]
    results, engine_pid, rank_pid = run_engine(engine_args(tiny_model_dir, 2), scenario)
    assert all(isinstance(r, EngineError) and r.kind == ErrorKind.ENGINE_DIED for r in results), results
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (gone(engine_pid) and gone(rank_pid)):
        time.sleep(0.1)
    assert gone(engine_pid) and gone(rank_pid)


def _cluster_outputs(launch, model_dir, name: str, tp: int, prompts: list[str], n: int,
                     layerwise: bool = False) -> tuple[list, list, float]:
    """Greedy completions from a disaggregated cluster (one prefill, one decode worker) whose workers run `tp`
    ranks each, the workers' GetInfo answers, and the KV bytes the prefill worker sent layer by layer (with
    `layerwise`: --kv-layerwise; else 0). Every prompt goes through the prefill worker and the transfer: the
    coordinator's --local-prefill-queue rule prefilled one on the decode worker on a loaded CI machine (its measured
    queue looked slower), and the test that counted on a transfer failed. The cluster is stopped before this returns."""
    from pdserve import SamplingParams
    from pdserve.v1 import worker_pb2, worker_pb2_grpc
    from helpers import complete_all, scrape, total
    import grpc

    cluster = launch(model_dir, name, worker_args=["--dtype", "float32", "--kv-tokens", "2048", "--max-model-len",
                                                   "512", "--tensor-parallel-size", str(tp),
                                                   *(["--kv-layerwise", "--metrics-port", "0"] if layerwise else [])],
                     coordinator_args=["--no-local-prefill-queue"])

    outs = complete_all(cluster.address,
                        [(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)) for p in prompts])
    infos = []
    for address in cluster.worker_addresses.values():
        with grpc.insecure_channel(address) as ch:
            infos.append(worker_pb2_grpc.WorkerStub(ch).GetInfo(worker_pb2.WorkerInfoRequest(), timeout=10,
                                                                 metadata=cluster.worker_metadata))
    layer_bytes = (total(scrape(cluster.metrics_urls["prefill-0"]), "pdserve:kv_transfer_bytes_sum",
                         mode="layers") if layerwise else 0.0)
    cluster.stop()
    return outs, infos, layer_bytes


CLUSTER_PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors:", "Once upon a time"]


def test_disaggregated_tp2_cluster_equals_tp1(tiny_model_dir, launch):
    """TP 2 prefill worker -> KV of both ranks' shards over the connector -> TP 2 decode worker: 64 greedy tokens per
    prompt, four at once, identical to a TP 1 cluster's."""
    two, infos, _ = _cluster_outputs(launch, tiny_model_dir, "tiny", 2, CLUSTER_PROMPTS, 64)
    assert sorted(i.role for i in infos) == ["decode", "prefill"] and {i.tensor_parallel_size for i in infos} == {2}
    one, _, _ = _cluster_outputs(launch, tiny_model_dir, "tiny", 1, CLUSTER_PROMPTS, 64)
    assert all(o.timings["transfer_ms"] > 0 for o in two)  # the KV crossed between the workers
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    assert all(len(o.token_ids) == 64 for o in two)


def test_packaged_model_tp2_cluster_matches_hf(real_model_dir, tokenizer, launch):
    """SmolLM2-135M's 9 query / 3 KV heads on 2 ranks: rank 1 holds one KV group of zero padding heads
    (`engine.parallel.tensor_parallel.head_split`), and the padded KV shards cross between the workers layer by layer
    (--kv-layerwise: each layer's slice of both ranks' shards). A disaggregated TP 2 cluster's greedy tokens equal
    HF transformers' (which TP 1's do, test_e2e)."""
    from conftest import hf_greedy

    outs, infos, layer_bytes = _cluster_outputs(launch, real_model_dir, "SmolLM2-135M-Instruct", 2,
                                                CLUSTER_PROMPTS[:2], 24, layerwise=True)
    assert {i.tensor_parallel_size for i in infos} == {2}
    assert layer_bytes > 0
    for prompt, out in zip(CLUSTER_PROMPTS[:2], outs):
        assert out.token_ids == hf_greedy(real_model_dir, tokenizer(prompt)["input_ids"], 24), prompt


def test_membership_refuses_a_worker_of_another_tp_size():
    """The first worker sets the cluster's reference; one with another TP size is kept out, the message saying why
    (a TP 1 decode worker cannot read a TP 2 prefill worker's blocks)."""
    from types import SimpleNamespace

    from pdserve_server.coordinator.membership import Membership
    from pdserve.v1 import worker_pb2

    cluster = SimpleNamespace(colocated=False, reference=None)
    this = SimpleNamespace(cluster=cluster)

    def worker(role, tp):
        return SimpleNamespace(info=worker_pb2.WorkerInfo(role=role, compat_hash="h", tensor_parallel_size=tp))
    assert Membership._incompatibility(this, worker("prefill", 2), "prefill") is None
    why = Membership._incompatibility(this, worker("decode", 1), "decode")
    assert why is not None and "--tensor-parallel-size 1, the cluster uses 2" in why
    assert Membership._incompatibility(this, worker("decode", 2), "decode") is None
