"""Engine step times by step shape: the measurements a mock engine's performance model is fitted on and checked
against (`engine/mock/`, `bench/fit_step_model.py`).

Runs pdserve's own engine (the real scheduler and model runner, CUDA graphs on a GPU) on random weights drawn from
a model's config.json, drives it with synthetic requests, and records every step: how many prefill tokens and
chunks it held, its prefill attention work, its decode batch and their context lengths, and its wall time (ms, from
the scheduler's output to the sampled tokens on the host). Two kinds of workload, kept apart in the output:

- fit: B requests of P random prompt tokens each, admitted at once, over a grid of B and P, each decoding O steps
  after the batch's prefill is done
  (chunked prefill under the token budget, then mixed and decode-only steps at batch B);
- holdout: a trace of staggered arrivals (seeded; prompt lengths log-normal, outputs uniform) whose steps mix
  prefill chunks and decodes of every context length; a model fitted on `fit` is judged on these.

Run from the repository root (GPU machines here cannot download: the configs are files):

    python bench/step_times.py --model NAME=CONFIG_DIR [--model ...] --device cuda --out steps.json

`--model llama-3.1-8b=builtin` writes Llama-3.1-8B's published config.json (Meta's model card, the
architecture values only) to a temporary directory; any other value is a directory holding a config.json.
Writes one JSON document: the machine, the arguments and, per model, the step records.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from pdserve_server.engine.args import EngineArgs  # noqa: E402
from pdserve_server.engine.builder import build_engine  # noqa: E402
from pdserve_server.engine.mock.step_model import StepShape  # noqa: E402
from pdserve_server.engine.request import Request, SamplingParams  # noqa: E402

# Llama-3.1-8B's config.json, the fields the engine reads (meta-llama/Llama-3.1-8B-Instruct, config.json).
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128009,
    "torch_dtype": "bfloat16",
}
BUILTIN = {"llama-3.1-8b": LLAMA_31_8B}


def step_record(out, ms: float) -> dict:
    """One step's shape (`engine.mock.step_model.StepShape`'s fields, and the chunks and contexts they sum) and its
    time, ms."""
    prefills = [s for s in out.prefills if not s.spec_token_ids]
    chunks = [[s.num_new_tokens, s.request.num_computed_tokens] for s in prefills]
    decode_lens = [s.request.num_computed_tokens + 1 for s in out.decodes]
    return dict(asdict(StepShape.of_step(chunks, decode_lens)), prefill_seqs=len(prefills), prefill_chunks=chunks,
                decode_lens=decode_lens, ms=round(ms, 4))


class Driver:
    """The engine's loop (schedule -> execute -> update, as `engine.offline.run_until_idle`) with each step timed and
    requests admitted at chosen steps."""

    def __init__(self, parts, device: str, vocab: int, seed: int):
        self.parts, self.device, self.vocab = parts, device, vocab
        self.rng = random.Random(seed)
        self.n = 0

    def request(self, prompt_len: int, max_tokens: int) -> Request:
        self.n += 1
        prompt = [self.rng.randrange(10, self.vocab) for _ in range(prompt_len)]
        return Request(f"s{self.n}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

    def run(self, arrivals: dict[int, list[Request]], deadline: float) -> list[dict]:
        """Run until every request is done (or `deadline`, time.monotonic(), passes); arrivals[k] are admitted
        before step k. Returns the step records."""
        sched, runner = self.parts.scheduler, self.parts.runner
        records, step = [], 0
        pending = dict(arrivals)
        while (sched.has_work() or pending) and time.monotonic() < deadline:
            for req in pending.pop(step, []):
                refused = sched.add_request(req)
                if refused is not None:
                    raise ValueError(f"request refused: {refused.kind.name}: {refused.message}")
            out = sched.schedule()
            step += 1
            if out.is_empty:
                continue
            start = time.perf_counter()
            result = runner.execute(out)
            if self.device.startswith("cuda"):
                torch.cuda.synchronize()
            ms = (time.perf_counter() - start) * 1e3
            sched.update(out, result)
            records.append(step_record(out, ms))
        return records


def fit_workloads(batches: list[int], prompts: list[int], output: int, kv_tokens: int,
                  step_tokens: int) -> list[tuple[int, int, int]]:
    """(B, P, max_tokens) of the grid whose KV fits the pool. max_tokens: every request still decodes `output`
    steps after the batch's last prefill chunk (`step_tokens` a step), so there are steps at batch B and context P
    however long the prefill takes (a run on 2026-11-27 without this had no long-context wide batches)."""
    grid = [(b, p, output + -(-b * p // step_tokens)) for p in prompts for b in batches]
    return [(b, p, n) for b, p, n in grid if b * (p + n + 16) <= kv_tokens]


def holdout_arrivals(driver: Driver, steps: int, rate: float, median_prompt: int, max_prompt: int,
                     outputs: tuple[int, int], seed: int) -> dict[int, list[Request]]:
    """Poisson arrivals (`rate` requests a step) over `steps` steps; prompt lengths log-normal around
    `median_prompt` (sigma 1, clipped to [16, max_prompt]), outputs uniform in `outputs`."""
    rng = random.Random(seed)
    arrivals: dict[int, list[Request]] = {}
    for k in range(steps):
        # Knuth's Poisson sampler: small rates only
        n, p, limit = 0, rng.random(), math.exp(-rate)
        while p > limit:
            n += 1
            p *= rng.random()
        for _ in range(n):
            plen = int(min(max_prompt, max(16, rng.lognormvariate(math.log(median_prompt), 1.0))))
            arrivals.setdefault(k, []).append(driver.request(plen, rng.randint(*outputs)))
    return arrivals


def measure(name: str, model_dir: Path, a) -> dict:
    args = EngineArgs(model_dir=str(model_dir), dtype=a.dtype, device=a.device, random_weights=True,
                      kv_tokens=a.kv_tokens, max_num_seqs=a.max_num_seqs,
                      max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
                      enable_prefix_caching=False)
    start = time.perf_counter()
    parts = build_engine(args)
    built_s = time.perf_counter() - start
    mc = parts.model_config
    print(f"{name}: built in {built_s:.1f} s ({mc.num_layers} layers, dtype {mc.dtype})", flush=True)
    driver = Driver(parts, a.device, mc.vocab_size, a.seed)
    deadline = time.monotonic() + a.budget_s
    # warm-up (Triton compiles, allocator): one small batch, not recorded
    driver.run({0: [driver.request(64, 4) for _ in range(2)]}, deadline)
    fit = []
    for b, p, n in fit_workloads(a.batches, a.prompts, a.output, a.kv_tokens, a.max_num_batched_tokens):
        recs = driver.run({0: [driver.request(p, n) for _ in range(b)]}, deadline)
        for r in recs:
            r["workload"] = f"B{b}-P{p}"
        fit += recs
        print(f"{name}: fit B={b} P={p}: {len(recs)} steps, median {_median([r['ms'] for r in recs]):.2f} ms",
              flush=True)
    arrivals = holdout_arrivals(driver, a.holdout_steps, a.holdout_rate, a.holdout_median_prompt,
                                min(parts.scheduler_config.max_model_len // 2, 8192), (16, 200), a.seed + 1)
    holdout = driver.run(arrivals, deadline)
    print(f"{name}: holdout: {len(holdout)} steps, {sum(len(v) for v in arrivals.values())} requests, "
          f"{sum(r['ms'] for r in holdout) / 1e3:.1f} s", flush=True)
    out_of_time = time.monotonic() >= deadline
    del parts
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return dict(config=json.loads((model_dir / "config.json").read_text()), built_s=built_s,
                out_of_time=out_of_time, fit=fit, holdout=holdout)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def machine(device: str) -> dict:
    info = dict(python=platform.python_version(), torch=torch.__version__, host=platform.machine())
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
        try:
            import triton
            info["triton"] = triton.__version__
        except ImportError:
            pass
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", required=True, metavar="NAME=DIR",
                   help="a model: NAME=builtin for " + ", ".join(BUILTIN) + ", or NAME=DIR with a config.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-tokens", type=int, default=400_000)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--prompts", type=int, nargs="+", default=[128, 1024, 4096])
    p.add_argument("--output", type=int, default=24, help="output tokens of each fit request")
    p.add_argument("--holdout-steps", type=int, default=600, help="steps over which holdout requests arrive")
    p.add_argument("--holdout-rate", type=float, default=0.6, help="holdout arrivals per step (Poisson)")
    p.add_argument("--holdout-median-prompt", type=int, default=600)
    p.add_argument("--budget-s", type=float, default=150.0, help="wall-time bound per model, s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    doc = dict(machine=machine(a.device), args={k: str(v) for k, v in vars(a).items()}, models={})
    for spec in a.model:
        name, _, where = spec.partition("=")
        with tempfile.TemporaryDirectory() as tmp:
            if where == "builtin":
                model_dir = Path(tmp)
                (model_dir / "config.json").write_text(json.dumps(BUILTIN[name]))
            else:
                model_dir = Path(where)
            try:
                doc["models"][name] = measure(name, model_dir, a)
            except Exception as e:  # one model's failure still leaves the others' figures
                doc["models"][name] = dict(error=f"{type(e).__name__}: {e}")
                print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
        a.out.write_text(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
