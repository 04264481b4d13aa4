"""KV blocks given back behind a sliding window (`KVCacheManager.release_out_of_window`): how many long requests a
fixed KV budget runs at once, preemptions, and output tok/s, against the same engine keeping every block.

    .venv/bin/python bench/sliding_window.py [--requests 16] [--prompt 768] [--out-tokens 128] [--kv-tokens 4096]

The model is a random-weight Mistral (every layer slides over `--window` keys; 4 layers, hidden 256, fp32) built from
a config on the spot, so nothing is downloaded. Both runs use one engine (`engine.builder.build_engine`: scheduler and
runner, no gRPC) with the same prompts, budget and threads; the baseline swaps in a `KVCacheManager` without the
window, which keeps every block of a request to its end (what the engine did before); a short untimed run goes
first. Greedy output must be the same in both runs (the blocks given back are never read). Prints one JSON line
per run and the ratios.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from pdserve_server.engine.args import EngineArgs  # noqa: E402
from pdserve_server.engine.builder import build_engine  # noqa: E402
from pdserve_server.engine.scheduling.kv_cache_manager import KVCacheManager  # noqa: E402
from pdserve_server.engine.offline import run_until_idle  # noqa: E402
from pdserve_server.engine.request import Request, SamplingParams  # noqa: E402
from hostinfo import commit, machine  # noqa: E402

VOCAB = 4096


def make_model(out: Path, window: int) -> None:
    """Random-weight Mistral with `window` on every layer, saved as HF safetensors in `out` (seed 0)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                        rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=window)
    MistralForCausalLM(cfg).save_pretrained(str(out))


def run(model_dir: Path, args, keep_every_block: bool) -> tuple[dict, list[list[int]]]:
    """One engine run over every request; returns (figures, outputs in request order)."""
    parts = build_engine(EngineArgs(model_dir=str(model_dir), dtype="float32", block_size=16,
                                    kv_tokens=args.kv_tokens, max_model_len=args.prompt + args.out_tokens,
                                    max_num_batched_tokens=512, max_num_seqs=args.requests,
                                    enable_prefix_caching=False, threads=args.threads))
    sched = parts.scheduler
    if keep_every_block:
        kv = sched.kv
        sched.kv = KVCacheManager(kv.pool.num_blocks, kv.block_size, kv.enable_prefix_caching)
    rng = random.Random(0)
    reqs = [Request(f"r{i}", [rng.randrange(3, VOCAB) for _ in range(args.prompt)],
                    SamplingParams(max_tokens=args.out_tokens, temperature=0.0, ignore_eos=True))
            for i in range(args.requests)]
    running, held, steps = [], [], [0]

    def watch(out):
        steps[0] += 1
        running.append(len(out.decodes) + len(out.prefills))
        held.append(sched.kv.num_usable_blocks - sched.kv.pool.num_free_blocks)

    start = time.perf_counter()
    run_until_idle(parts, reqs, on_step=watch)
    wall = time.perf_counter() - start
    out_tokens = sum(len(r.output_token_ids) for r in reqs)
    return dict(keep_every_block=keep_every_block, kv_blocks=sched.kv.num_usable_blocks, steps=steps[0],
                seconds=round(wall, 2), output_tok_s=round(out_tokens / wall, 1),
                mean_batch=round(sum(running) / len(running), 2), max_batch=max(running),
                max_blocks_held=max(held), preemptions=sched.num_preemptions), [r.output_token_ids for r in reqs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=768, help="prompt tokens per request")
    p.add_argument("--out-tokens", type=int, default=128)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--kv-tokens", type=int, default=4096, help="KV budget in tokens, both runs")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    print(f"# {machine()} · commit {commit()} · {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp), args.window)
        # Untimed: the process's first engine pays one-time costs (thread pools, allocator) that would count
        # against whichever run went first.
        run(Path(tmp), argparse.Namespace(**{**vars(args), "requests": 2, "out_tokens": 2}), keep_every_block=True)
        base, base_out = run(Path(tmp), args, keep_every_block=True)
        print(json.dumps(base), flush=True)
        rel, rel_out = run(Path(tmp), args, keep_every_block=False)
        print(json.dumps(rel), flush=True)
    print(json.dumps(dict(same_output=base_out == rel_out,
                          tok_s_ratio=round(rel["output_tok_s"] / base["output_tok_s"], 2),
                          mean_batch_ratio=round(rel["mean_batch"] / base["mean_batch"], 2))))


if __name__ == "__main__":
    main()
