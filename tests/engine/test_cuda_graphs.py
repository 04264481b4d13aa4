"""The padded static-buffer decode step of `engine.execution.cuda_graphs`, checked on CPU with `capture=False` (the same
buffers and padding, no graph; the capture itself needs CUDA and was checked on an H100 with bench/gpu_check.py)."""
import random

import torch

from pdserve_server.engine.args import EngineArgs
from pdserve_server.engine.builder import build_engine
from pdserve_server.engine.execution.cuda_graphs import DecodeGraphs, capture_sizes
from pdserve_server.engine.request import Request, SamplingParams


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(1000)[-1] == 256


def _run(model_dir, prompts, sizes):
    """Greedy outputs with requests arriving one per step (so the decode batch grows through 1..n and needs
    padding), and how many steps ran through the graph path."""
    parts = build_engine(EngineArgs(dtype="float32", model_dir=str(model_dir), kv_tokens=4096, max_model_len=512,
                                    block_size=8))
    runner, sched = parts.runner, parts.scheduler
    used = []
    if sizes:
        graphs = DecodeGraphs(runner.model, runner.kv_cache.layers, sizes, 512 // 8, runner.kv_cache.scratch_slot,
                              runner.device, capture=False)
        run = graphs.run

        def counted(size, *a):
            used.append((size, len(a[0])))
            return run(size, *a)
        graphs.run = counted
        runner.decode_graphs = graphs
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(prompts)]
    pending = list(reqs)
    while pending or sched.has_work():
        if pending:
            sched.add_request(pending.pop(0))
        out = sched.schedule()
        sched.update(out, runner.execute(out))
    return [r.output_token_ids for r in reqs], used, runner.kv_cache


def test_padded_decode_steps_match_eager(tiny_model_dir):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 17, 9, 30, 3)]
    eager, _, _ = _run(tiny_model_dir, prompts, None)
    padded, used, kv = _run(tiny_model_dir, prompts, [1, 2, 4, 8])
    assert padded == eager
    assert used and any(size > n for size, n in used), "no padded step ran"
    assert all(size in (1, 2, 4, 8) and n <= size for size, n in used)
    scratch_block = kv.scratch_slot // kv.block_size
    assert kv.kv[scratch_block].abs().sum() > 0, "padded rows should have written the scratch block"


def test_more_decodes_than_the_largest_size_run_eagerly(tiny_model_dir):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (4, 4, 4, 4, 4)]
    eager, _, _ = _run(tiny_model_dir, prompts, None)
    padded, used, _ = _run(tiny_model_dir, prompts, [1, 2, 4])
    assert padded == eager
    assert used and all(n <= 4 for _, n in used)


def test_a_table_wider_than_captured_runs_eagerly(tiny_model_dir):
    parts = build_engine(EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), kv_tokens=1024, max_model_len=512,
                                    block_size=8))
    r = parts.runner
    graphs = DecodeGraphs(r.model, r.kv_cache.layers, [1, 2], 4, r.kv_cache.scratch_slot, r.device, capture=False)
    assert graphs.size_for(2, 4) == 2 and graphs.size_for(1, 5) is None and graphs.size_for(3, 1) is None
    logits = graphs.run(2, [7], [0], [3 * 8], [[3]], [1])
    assert logits.shape == (1, parts.model_config.vocab_size) and torch.isfinite(logits).all()
