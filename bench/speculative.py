"""What n-gram speculative decoding buys: output tok/s of the real engine with drafts off and on, same run.

The engine (`engine.builder.build_engine`, one torch thread as in a worker) generates greedily for a batch of
requests that all arrive at once, with --speculative-ngram-tokens 0 (the baseline) and each K in --k. Workloads:

- `chat`: seed 004's shape: one chat prompt ("Explain how transformers work"), --chat-tokens output tokens;
- `rewrite`: a chat request to rewrite a ~200-token passage of real text, which the model largely copies (the
  case prompt lookup is made for: editing, summarizing, code changes);
- `docs`: the sweep's load, raw continuation of a 128-token window of real text, 32 tokens.

First, what a draft costs: the time of one decode step of one request (context 300 tokens) computing 1 + k
tokens, for k in 0, 1, 2, 4, 8 (a verification step is one chunk of k + 1 tokens).

Every request runs to its max_tokens (ignore_eos). Reported per (workload, batch, K): wall time from submission
to the last token, output tok/s, its ratio to K = 0 in the same run, the acceptance rate (accepted / draft
tokens), tokens per step, and whether the output equals K = 0's token for token (it must).

Usage: python bench/speculative.py [--batches 1,4] [--k 2,4] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

def workloads(tok, chat_tokens: int) -> dict[str, tuple[list[list[int]], int]]:
    """name -> (prompts, one per request slot, cycled; output tokens)."""
    from prompts import SEED_CHAT_PROMPT, chat_prompt_ids, corpus_text, make_requests

    def chat(text: str) -> list[int]:
        return chat_prompt_ids(tok, text)

    corpus = tok(corpus_text())["input_ids"]
    passages = [tok.decode(corpus[i * 997:i * 997 + 200]) for i in range(8)]
    return {
        "chat": ([chat(SEED_CHAT_PROMPT)], chat_tokens),
        "rewrite": ([chat(f"Rewrite the following text, keeping its wording:\n\n{p}") for p in passages], 96),
        "docs": ([r.prompt_ids for r in make_requests(tok, 8, 128, 32, seed=3)], 32),
    }


def run(model_dir: str, prompts: list[list[int]], batch: int, max_tokens: int, k: int, extra: dict) -> dict:
    """One batch to completion on a fresh engine; timings in seconds."""
    from pdserve_server.engine.args import EngineArgs
    from pdserve_server.engine.builder import build_engine
    from pdserve_server.engine.offline import run_until_idle
    from pdserve_server.engine.request import Request, SamplingParams

    parts = build_engine(EngineArgs(model_dir=model_dir, kv_tokens=16384, max_model_len=2048,
                                    speculative_ngram_tokens=k, speculative_disable_batch_size=max(batch, 1),
                                    **extra))
    # one short request first: allocator and kernel first-call costs stay out of the numbers
    run_until_idle(parts, [Request("warm", prompts[0], SamplingParams(max_tokens=2, temperature=0.0))])
    reqs = [Request(f"r{i}", prompts[i % len(prompts)], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                       ignore_eos=True)) for i in range(batch)]
    t0 = time.perf_counter()
    scheduled = []
    run_until_idle(parts, reqs, on_step=scheduled.append)
    wall, steps = time.perf_counter() - t0, len(scheduled)
    tokens = sum(len(q.output_token_ids) for q in reqs)
    draft, accepted = sum(q.num_draft_tokens for q in reqs), sum(q.num_accepted_tokens for q in reqs)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "steps": steps,
            "acceptance": accepted / draft if draft else 0.0, "draft": draft, "accepted": accepted,
            "outputs": [q.output_token_ids for q in reqs]}


def step_costs(model_dir: str, extra: dict, ks=(0, 1, 2, 4, 8), context: int = 300, repeats: int = 10) -> dict:
    """ms of one step of one request at `context` tokens, computing its last token and k drafts (k = 0: a plain
    decode step), mean of `repeats` after one warm-up."""
    from pdserve_server.engine.args import EngineArgs
    from pdserve_server.engine.builder import build_engine
    from pdserve_server.engine.outputs import ScheduledRequest, SchedulerOutput
    from pdserve_server.engine.request import Request, SamplingParams

    parts = build_engine(EngineArgs(model_dir=model_dir, kv_tokens=4096, max_model_len=2048, **extra))
    s, r = parts.scheduler, parts.runner
    req = Request("a", list(range(1000, 1000 + context)), SamplingParams(max_tokens=100, temperature=0.0))
    s.add_request(req)
    out = s.schedule()
    s.update(out, r.execute(out))
    s.kv.allocate_slots("a", context + 1 + max(ks))
    table = s.kv.get_block_table("a")
    costs = {}
    for k in ks:
        sched = ScheduledRequest(req, 1 + k, table, True, spec_token_ids=[5] * k)
        step = SchedulerOutput(decodes=[sched]) if k == 0 else SchedulerOutput(prefills=[sched])
        r.execute(step)
        t0 = time.perf_counter()
        for _ in range(repeats):
            r.execute(step)
        costs[k] = (time.perf_counter() - t0) / repeats * 1e3
    return costs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--k", default="2,4", help="draft tokens per step to compare with 0")
    ap.add_argument("--workloads", default="chat,rewrite,docs")
    ap.add_argument("--chat-tokens", type=int, default=75)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import torch
    from transformers import AutoTokenizer

    from pdserve_server.cli.models import resolve_model
    from pdserve_server.engine.hardware import cpu_flags
    from hostinfo import FLAGS_SHOWN, commit, machine

    torch.set_num_threads(1)
    model_dir = args.model_dir or str(resolve_model(None))
    tok = AutoTokenizer.from_pretrained(model_dir)
    loads = workloads(tok, args.chat_tokens)
    extra = {"dtype": args.dtype, "quantization": args.quantization}
    costs = step_costs(model_dir, extra)
    print("step ms with k drafts (batch 1, context 300): " + ", ".join(f"k={k}: {ms:.1f}" for k, ms in costs.items()),
          flush=True)
    rows = []
    for name in filter(None, args.workloads.split(",")):  # --workloads "": the step costs alone
        prompts, max_tokens = loads[name]
        for batch in (int(b) for b in args.batches.split(",")):
            base = run(model_dir, prompts, batch, max_tokens, 0, extra)
            for k in [0] + [int(x) for x in args.k.split(",")]:
                res = base if k == 0 else run(model_dir, prompts, batch, max_tokens, k, extra)
                row = {"workload": name, "batch": batch, "k": k, "ratio": res["tok_s"] / base["tok_s"],
                       "same_output": res["outputs"] == base["outputs"],
                       **{key: v for key, v in res.items() if key != "outputs"}}
                rows.append(row)
                print(f"{name:>8} batch {batch:>2} k {k}: {row['tok_s']:6.1f} tok/s ({row['ratio']:.2f}x k=0), "
                      f"{row['tokens'] / row['steps'] / batch:.2f} tok/step/request, acceptance "
                      f"{row['acceptance']:.2f} ({row['accepted']}/{row['draft']}), same output: "
                      f"{row['same_output']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"commit": commit(), "date": time.strftime("%Y-%m-%d"),
                                              "machine": machine(), "cpu_flags": sorted(cpu_flags() & FLAGS_SHOWN),
                                              "dtype": args.dtype, "quantization": args.quantization,
                                              "step_ms_by_k": costs, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
