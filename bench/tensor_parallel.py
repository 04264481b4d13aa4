"""Tensor parallelism and mixture-of-experts on this machine's cores: one engine (the engine process and, with TP,
its rank processes; no gRPC) per configuration, the same workloads, the baseline (dense, TP 1) in the same run.

Configurations (random weights from a config, so nothing is downloaded; generation lengths are fixed with
ignore_eos, so the weights' values do not matter for timing):
  - dense TP 1:  a Llama of SmolLM2-135M's size (24 layers, hidden 512, 8 query / 4 KV heads, MLP 1536, vocabulary
    49152), all threads in one process;
  - dense TP 2:  the same model split over 2 ranks, the same threads split between them;
  - MoE TP 1:    a Qwen3-MoE of the same attention and the same active MLP size (8 experts of 768, top 2 = 1536
    active features per token, as the dense MLP), so per-token FLOPs match and 4x the MLP weights exist.
Workloads: decode at batch 1 (32-token prompt, 128 out: TPOT), decode at batch 16 (16 x 64 out: output tokens/s),
prefill (4 x 512-token prompts, 1 out: prompt tokens/s). Also the latency of one all-reduce of a decode step's
hidden state between two processes, gloo's and the shared-memory one TP uses (`engine.parallel.shm_collectives`; TP pays
two per layer).

    .venv/bin/python bench/tensor_parallel.py          # about 4 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hostinfo import commit, machine  # noqa: E402

DENSE = dict(vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=24, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True,
             bos_token_id=1, eos_token_id=2)


def write_models(root: Path, tokenizer_dir: Path) -> dict[str, Path]:
    """config.json + tokenizer of each model (random weights at load: `EngineArgs.random_weights`)."""
    from transformers import LlamaConfig, Qwen3MoeConfig

    dirs = {"dense": root / "dense", "moe": root / "moe"}
    LlamaConfig(**DENSE).save_pretrained(dirs["dense"])
    Qwen3MoeConfig(**DENSE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768,
                   norm_topk_prob=True).save_pretrained(dirs["moe"])
    for d in dirs.values():
        for f in tokenizer_dir.glob("tokenizer*"):
            shutil.copy(f, d)
    return dirs


def _allreduce_rank(rank: int, init: str, rounds: int, shm_buffers, out) -> None:
    import torch
    import torch.distributed as dist

    from pdserve_server.engine.parallel.shm_collectives import ShmCollectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    shm = ShmCollectives(*shm_buffers, rank)
    x = torch.ones(1, DENSE["hidden_size"])
    times = {}
    for kind, reduce in (("gloo", dist.all_reduce), ("shm", shm.all_reduce)):
        for _ in range(50):
            reduce(x)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(rounds):
            reduce(x)
        times[kind] = (time.perf_counter() - start) / rounds * 1e6
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def allreduce_us(rounds: int = 2000) -> dict[str, float]:
    """Mean microseconds of one all-reduce of [1, hidden] fp32 between two single-thread processes: gloo's and
    `engine.parallel.shm_collectives`'s."""
    import multiprocessing

    from pdserve_server.engine.parallel.shm_collectives import ShmCollectives

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    buffers = ShmCollectives.allocate(2, DENSE["hidden_size"] * 4)
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_allreduce_rank, args=(r, f"file://{d}/store", rounds, buffers, out))
                 for r in (0, 1)]
        for p in procs:
            p.start()
        result = out.get(timeout=300)
        for p in procs:
            p.join(60)
    return result


async def _one(engine, rid: str, prompt: list[int], n: int) -> tuple[float, float, int]:
    """(time of the first token, of the last, tokens) for one greedy request, monotonic seconds."""
    from pdserve_server.engine.request import Request, SamplingParams

    first = last = 0.0
    count = 0
    with engine.request(Request(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))) as s:
        while True:
            ev = await s.next()
            last = time.monotonic()
            first = first or last
            count += 1
            if ev.finish_reason is not None:
                return first, last, count


async def measure(model_dir: Path, tp: int, threads: int) -> dict[str, float]:
    from pdserve_server.engine.args import EngineArgs
    from pdserve_server.engine.core.process_engine import ProcessEngine

    args = EngineArgs(model_dir=str(model_dir), random_weights=True, kv_tokens=16384, max_num_seqs=16,
                      max_num_batched_tokens=512, tensor_parallel_size=tp, enable_prefix_caching=False)
    engine = ProcessEngine(args, threads=threads)
    await engine.start()
    try:
        await _one(engine, "warm", list(range(100, 164)), 8)
        first, last, n = await _one(engine, "b1", list(range(200, 232)), 128)
        tpot_ms = (last - first) / (n - 1) * 1e3
        start = time.monotonic()
        runs = await asyncio.gather(*(_one(engine, f"b16-{i}", list(range(300 + 40 * i, 332 + 40 * i)), 64)
                                      for i in range(16)))
        batch_tps = sum(r[2] for r in runs) / (max(r[1] for r in runs) - start)
        start = time.monotonic()
        await asyncio.gather(*(_one(engine, f"p{i}", [(7 * i + j) % 40000 + 3 for j in range(512)], 1)
                               for i in range(4)))
        prefill_tps = 4 * 512 / (time.monotonic() - start)
    finally:
        engine.stop()
    return {"tpot_ms_batch1": tpot_ms, "output_tok_s_batch16": batch_tps, "prefill_tok_s": prefill_tps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads per engine (split among ranks)")
    parser.add_argument("--json", help="write the results here")
    opts = parser.parse_args()
    from pdserve_server.cli.models import resolve_model

    root = Path(tempfile.mkdtemp(prefix="pdserve-bench-tp-"))
    try:
        dirs = write_models(root, resolve_model(None))
        configs = {"dense TP 1": (dirs["dense"], 1), "dense TP 2": (dirs["dense"], 2), "MoE TP 1": (dirs["moe"], 1)}
        results = {name: asyncio.run(measure(d, tp, opts.threads)) for name, (d, tp) in configs.items()}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    reduce_us = allreduce_us()
    base = results["dense TP 1"]
    print(f"machine: {machine()}  commit: {commit()}  threads per engine: {opts.threads}")
    print(f"{'configuration':<12} {'TPOT b1 ms':>11} {'ratio':>6} {'out tok/s b16':>14} {'ratio':>6} "
          f"{'prefill tok/s':>14} {'ratio':>6}")
    for name, r in results.items():
        print(f"{name:<12} {r['tpot_ms_batch1']:>11.1f} {base['tpot_ms_batch1'] / r['tpot_ms_batch1']:>6.2f} "
              f"{r['output_tok_s_batch16']:>14.1f} {r['output_tok_s_batch16'] / base['output_tok_s_batch16']:>6.2f} "
              f"{r['prefill_tok_s']:>14.1f} {r['prefill_tok_s'] / base['prefill_tok_s']:>6.2f}")
    print("ratios: speed relative to dense TP 1 (> 1 = faster)")
    layers = DENSE["num_hidden_layers"]
    print(f"all-reduce of one token's hidden state ({DENSE['hidden_size']} fp32), 2 processes: gloo "
          f"{reduce_us['gloo']:.0f} us, shared memory {reduce_us['shm']:.1f} us; a TP 2 decode step makes "
          f"{2 * layers + 1} of them (plus the step broadcast and the logits all-gather, also through shared memory)")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"machine": machine(), "commit": commit(), "threads": opts.threads,
                                               "allreduce_us": reduce_us, "results": results}, indent=2))


if __name__ == "__main__":
    main()
