"""The engine and the whole disaggregated pipeline on a CUDA GPU: greedy parity with HF transformers on the same GPU,
through every KV connector, and throughput against HF's own `generate()` measured in the same run.

Run on a CUDA machine from the repository root:

    python bench/gpu_check.py --model-files DIR [--out gpu_check.json] [--skip throughput]

GPU machines here cannot download, so the model is built on the spot: DIR holds a model's config.json and tokenizer
files (SmolLM2-135M-Instruct's, copied from the packaged model) and HF draws random weights for it (seed 0), with an
untied LM head scaled by 8 so that greedy choices sit far from ties (as tests/conftest.py's tiny model). Both sides
load the same fp32 safetensors.

1. Engine parity: pdserve's engine (`build_engine`: scheduler + ModelRunner, the objects a worker runs) on the GPU,
   every prompt admitted at once (continuous batching, chunked prefill under a 512-token budget, contexts from 1
   token to 1500 across block edges), then a second wave that shares prefixes with the first (prefix cache hits),
   against HF greedy on the same GPU in the same dtype. fp32 must agree token for token (TF32 off on both sides);
   bf16 reports the token agreement (`bench/quality.agreement`). The torch reference attention runs the fp32 case
   too, so a kernel fault shows as Triton differing where the reference agrees.
2. Cluster parity: `start_cluster` with prefill and decode workers on the GPU (`--device cuda`), for each
   connector (tcp, ucx, nccl, each whole-block and layer-wise) and colocated (with `--tensor-parallel-size N`, every
   worker on N ranks, one GPU each: tensor parallelism over NCCL, its KV shards moved per rank); all prompts sent at once through the
   SDK; tokens compared with HF fp32; the workers' pools must return to idle. A connector that cannot start (ucxx
   not installed; NCCL refuses two ranks on one GPU) is reported with its error, and the rest still run.
3. Throughput (bf16): B prompts of 128 random tokens, 64 new tokens each, through the engine with CUDA graphs
   (the default) and eager (`--enforce-eager`), against HF `generate()` on the same batch (a static batch, dynamic
   cache: the naive server's loop); output tok/s and ratios, pdserve's median decode step time, a profile of its
   decode steps (device-busy vs wall time, launches per step) and, eager, what replaying one captured step costs.

Writes one JSON document (--out) and prints a summary.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from pdserve_server.engine.args import EngineArgs  # noqa: E402
from pdserve_server.engine.builder import build_engine  # noqa: E402
from pdserve_server.engine.offline import generate  # noqa: E402
from pdserve_server.engine.request import Request, SamplingParams  # noqa: E402
from quality import PROMPTS, agreement  # noqa: E402

NEW_TOKENS = 32
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_model(files: Path, out: Path) -> None:
    """Random-weight HF model of files/config.json (seed 0, untied LM head x8) saved as fp32 safetensors in out."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(files))
    cfg.tie_word_embeddings = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        if (files / name).exists():
            shutil.copy(files / name, out / name)


def prompts(model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """(first wave, second wave): the 8 text prompts and random-token prompts of ragged lengths; the second wave
    extends a third of the first wave's prompts (prefix-cache hits) and repeats one whole."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = random.Random(0)
    first = [tok.encode(p).ids for p in PROMPTS]
    first += [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 15, 16, 17, 100, 333, 700, 1500)]
    second = [p + [rng.randrange(3, 49152) for _ in range(k)] for p, k in zip(first[10:15], (1, 5, 16, 40, 200))]
    return first, second + [first[12]]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """HF's greedy continuation of ids, n tokens, EOS ignored (as the engine's ignore_eos), KV cache on."""
    device = next(model.parameters()).device
    x, past, out = torch.tensor([ids], device=device), None, []
    with torch.inference_mode():
        for _ in range(n):
            o = model(input_ids=x, past_key_values=past, use_cache=True)
            past = o.past_key_values
            out.append(int(o.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]], device=device)
    return out


def engine_greedy(model_dir: Path, waves: list[list[list[int]]], dtype: str, backend: str,
                  device: str) -> list[list[int]]:
    """Each wave admitted at once and run to completion; outputs of every wave, in order."""
    parts = build_engine(EngineArgs(model_dir=str(model_dir), dtype=dtype, device=device, attention_backend=backend,
                                    kv_tokens=65536, max_model_len=2048))
    return generate(parts, waves, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True), "w")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def mismatches(a: list[list[int]], b: list[list[int]]) -> list[int]:
    return [i for i, (x, y) in enumerate(zip(a, b)) if x != y]


def engine_parity(model_dir: Path, waves, device: str, dtypes: list[str]) -> tuple[dict, list[list[int]]]:
    """pdserve's engine against HF greedy per dtype (and, in fp32, per attention backend); HF fp32 tokens too."""
    from transformers import AutoModelForCausalLM

    flat = [p for w in waves for p in w]
    result, hf32 = {}, None
    backends = ("triton", "torch") if device.startswith("cuda") else ("auto", "torch")
    for dtype in dtypes:
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).to(device).eval()
        ref = [hf_greedy(hf, p, NEW_TOKENS) for p in flat]
        del hf
        if dtype == "float32":
            hf32 = ref
        for backend in backends if dtype == "float32" else backends[:1]:
            start = time.perf_counter()
            got = engine_greedy(model_dir, waves, dtype, backend, device)
            result[f"{dtype}/{backend}"] = dict(agreement=agreement(got, ref), mismatched_prompts=mismatches(got, ref),
                                                seconds=time.perf_counter() - start)
            print(f"engine {dtype}/{backend}: {result[f'{dtype}/{backend}']}", flush=True)
    return result, hf32


MODES = ("colocated", "tcp", "tcp+layerwise", "ucx", "ucx+layerwise", "nccl")


def cluster_parity(model_dir: Path, prompts_: list[list[int]], expected: list[list[int]], log_root: Path,
                   device: str, modes: list[str], tensor_parallel_size: int = 1) -> dict:
    """Each topology / connector on `device`: agreement with HF fp32, prefix-cache tokens, pools idle after. With
    `tensor_parallel_size` N > 1 every worker runs N ranks, rank r on GPU r (as many GPUs as N needed)."""
    from pdserve_server.cli.launcher import ServeConfig, start_cluster
    from pdserve import AsyncClient, SamplingParams as SP

    env = dict(os.environ, UCX_TLS="cuda_ipc,cuda_copy,tcp,self", UCX_NET_DEVICES="lo")
    out = {}
    for mode in modes:
        connector, _, layerwise = mode.partition("+")
        # fp32 named: the workers' default is --dtype auto (bf16 on a GPU), and the expected tokens are HF fp32's.
        args = ["--device", device, "--dtype", "float32", "--kv-tokens", "65536", "--max-model-len", "2048",
                "--connector", "tcp" if mode == "colocated" else connector, *(["--kv-layerwise"] if layerwise else []),
                "--tensor-parallel-size", str(tensor_parallel_size)]
        start = time.perf_counter()
        try:
            c = start_cluster(str(model_dir), "random-smollm2", ServeConfig(log_dir=str(log_root / mode),
                                                                               start_timeout_s=240),
                              colocated=mode == "colocated", worker_args=args, env=env)
        except Exception as e:  # noqa: BLE001 - report and go on with the other connectors
            out[mode] = dict(started=False, error=f"{type(e).__name__}: {e}", log_tail=_log_tail(log_root / mode))
            print(f"cluster {mode}: did not start: {e}", flush=True)
            continue
        try:
            async def main():
                async with AsyncClient(c.address) as client:
                    return await asyncio.gather(*(client.complete(p, SP(max_tokens=NEW_TOKENS, temperature=0.0,
                                                                        ignore_eos=True), timeout=120)
                                                  for p in prompts_))
            comps = asyncio.run(main())
            got = [x.token_ids for x in comps]
            out[mode] = dict(started=True, agreement=agreement(got, expected),
                             mismatched_prompts=mismatches(got, expected),
                             cached_prompt_tokens=sum(x.cached_prompt_tokens for x in comps),
                             idle=_idle(c), seconds=time.perf_counter() - start)
        except Exception as e:  # noqa: BLE001
            out[mode] = dict(started=True, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:],
                             log_tail=_log_tail(log_root / mode))
        finally:
            c.stop()
        print(f"cluster {mode}: {out[mode]}", flush=True)
    return out


def _idle(cluster, timeout_s: float = 30.0) -> bool:
    """Every worker's pool is back to all-free with no requests within timeout_s (no leaked KV blocks)."""
    import grpc

    from pdserve.v1 import worker_pb2, worker_pb2_grpc

    deadline = time.monotonic() + timeout_s
    while True:
        idle = True
        for addr in cluster.worker_addresses.values():
            with grpc.insecure_channel(addr) as ch:
                s = worker_pb2_grpc.WorkerStub(ch).GetStats(worker_pb2.WorkerStatsRequest(check_integrity=True),
                                                            timeout=10, metadata=cluster.worker_metadata)
            idle &= s.num_free_blocks == s.num_total_blocks and s.num_requests == 0 and s.pool_integrity_ok
        if idle or time.monotonic() > deadline:
            return idle
        time.sleep(0.2)


def _log_tail(d: Path, chars: int = 1500) -> dict:
    return {p.name: p.read_text(errors="replace")[-chars:] for p in sorted(d.glob("*.log"))} if d.exists() else {}


def throughput(model_dir: Path, batches: list[int], device: str, prompt_len: int = 128, new: int = 64) -> list[dict]:
    """Output tok/s of HF generate() and of pdserve's engine, with CUDA graphs (the default) and eager
    (`--enforce-eager`), on the same bf16 batches; ratios against HF; each engine's decode steps profiled."""
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(0)
    batch_ids = {b: torch.randint(3, 49152, (b, prompt_len), generator=gen) for b in batches}
    rows = {b: dict(batch=b, prompt_tokens=prompt_len, new_tokens=new) for b in batches}
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).to(device).eval()
    for b, ids in batch_ids.items():
        for _ in range(2):  # the first pass warms up; the second is timed
            _sync(device)
            start = time.perf_counter()
            with torch.inference_mode():
                hf.generate(ids.to(device), attention_mask=torch.ones_like(ids).to(device), max_new_tokens=new,
                            min_new_tokens=new, do_sample=False, pad_token_id=0)
            _sync(device)
            rows[b]["hf_tok_s"] = b * new / (time.perf_counter() - start)
    del hf
    for eager in (False, True):
        mode = "eager" if eager else "graphs"
        start = time.perf_counter()
        parts = build_engine(EngineArgs(model_dir=str(model_dir), dtype="bfloat16", device=device,
                                        kv_tokens=131072, max_num_seqs=max(batches), max_num_batched_tokens=8192,
                                        max_model_len=1024, enforce_eager=eager))
        sched, runner = parts.scheduler, parts.runner
        print(f"engine {mode} built in {time.perf_counter() - start:.1f} s", flush=True)
        for b, ids in batch_ids.items():
            for rep in range(2):
                reqs = [Request(f"t{b}-{rep}-{i}", row.tolist(),
                                SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
                        for i, row in enumerate(ids)]
                start, steps = time.perf_counter(), []
                for r in reqs:
                    sched.add_request(r)
                while sched.has_work():
                    t0 = time.perf_counter()
                    out = sched.schedule()
                    sched.update(out, runner.execute(out))
                    if not out.prefills:
                        steps.append(time.perf_counter() - t0)
                tok_s = b * new / (time.perf_counter() - start)
            row = rows[b]
            row[f"pdserve_{mode}_tok_s"] = tok_s
            row[f"ratio_{mode}"] = tok_s / row["hf_tok_s"]
            row[f"pdserve_{mode}_decode_step_ms"] = sorted(steps)[len(steps) // 2] * 1e3
            if device.startswith("cuda"):
                row[f"profile_{mode}"] = decode_profile(sched, runner, ids, f"p{b}")
                if eager:
                    row["graph_ceiling"] = graph_ceiling(sched, runner, ids, f"g{b}")
            print(f"throughput {mode} {row}", flush=True)
        del parts, sched, runner
    return list(rows.values())


def decode_profile(sched, runner, ids: torch.Tensor, tag: str, steps: int = 5) -> dict:
    """Is a decode step host-bound? Profiles `steps` all-decode steps of len(ids) requests (after their prefill)
    with CPU and CUDA activity: device-busy time (sum of kernel times) beside the wall time, kernel launches per
    step, and the host ops that cost the most CPU time per step."""
    from torch.profiler import ProfilerActivity, profile

    for i, row in enumerate(ids):
        sched.add_request(Request(f"{tag}-{i}", row.tolist(), SamplingParams(max_tokens=steps + 8, temperature=0.0,
                                                                              ignore_eos=True)))
    while True:  # run until a step has only decodes
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        if not out.prefills:
            break
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            out = sched.schedule()
            sched.update(out, runner.execute(out))
        wall = (time.perf_counter() - start) / steps
    while sched.has_work():
        out = sched.schedule()
        sched.update(out, runner.execute(out))
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                         "cudaLaunchKernelExC"))
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    return dict(wall_ms=wall * 1e3, device_busy_ms=device_us / 1e3 / steps, launches_per_step=launches / steps,
                top_host_ops_ms={e.key: e.self_cpu_time_total / 1e3 / steps for e in top})


def graph_ceiling(sched, runner, ids: torch.Tensor, tag: str, reps: int = 20) -> dict:
    """The launch-free ceiling of one all-decode step (run on an eager engine): its forward + logits + argmax on
    the same inputs, eager against captured once and replayed (`torch.cuda.CUDAGraph`), ms per step; no host
    work between steps, unlike the engine's own graph path. The replays rewrite the same KV slots, harmless
    for timing."""
    for i, row in enumerate(ids):
        sched.add_request(Request(f"{tag}-{i}", row.tolist(), SamplingParams(max_tokens=8, temperature=0.0,
                                                                              ignore_eos=True)))
    while True:
        out = sched.schedule()
        if not out.prefills:
            break
        sched.update(out, runner.execute(out))
    model, seen = runner.model, {}
    forward = model.forward

    def spy(*a, **k):
        seen["args"], seen["kwargs"] = a, k
        return forward(*a, **k)
    model.forward = spy
    try:
        sched.update(out, runner.execute(out))
    finally:
        del model.forward
    args = seen["args"]

    def step():
        return model.compute_logits(model(*args)).argmax(dim=-1)

    def per_step(fn) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / reps * 1e3

    eager_ms = per_step(step)
    result = dict(eager_ms=eager_ms)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        result.update(graph_ms=per_step(graph.replay), speedup=eager_ms / per_step(graph.replay))
    except Exception as e:  # noqa: BLE001 - a capture failure is itself the finding
        result["error"] = f"{type(e).__name__}: {e}"
    while sched.has_work():
        out = sched.schedule()
        sched.update(out, runner.execute(out))
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-files", required=True, help="directory with config.json and tokenizer files")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_check.json"))
    p.add_argument("--skip", default="", help="comma list of engine,cluster,throughput to skip")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--modes", default=",".join(MODES), help="cluster topologies / connectors to run")
    p.add_argument("--device", default="cuda", help="cuda; cpu only to dry-run this script (C kernel + reference)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks of every cluster worker, one GPU each (needs that many GPUs; the nccl connector "
                        "refuses shards on several GPUs: leave nccl out of --modes)")
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity: IEEE fp32 matmuls on both sides
    skip = set(filter(None, args.skip.split(",")))
    import triton

    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "none"
    doc = dict(info=dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                         python=platform.python_version(), commit=os.environ.get("PDSERVE_COMMIT", "?"),
                         date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())))
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    model_dir = work / "model"
    make_model(Path(args.model_files), model_dir)
    waves = prompts(model_dir)

    def save():
        Path(args.out).write_text(json.dumps(doc, indent=1))

    expected = None
    if "engine" not in skip:
        doc["engine"], expected = engine_parity(model_dir, waves, args.device, args.dtypes.split(","))
        save()
    if "cluster" not in skip:
        if expected is None:
            from transformers import AutoModelForCausalLM
            hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(args.device).eval()
            expected = [hf_greedy(hf, p, NEW_TOKENS) for w in waves for p in w]
            del hf
        first = waves[0]
        doc["cluster"] = cluster_parity(model_dir, first, expected[:len(first)], work / "logs",
                                       args.device, args.modes.split(","), args.tensor_parallel_size)
        save()
    if "throughput" not in skip:
        doc["throughput"] = throughput(model_dir, [int(b) for b in args.batches.split(",")], args.device)
        save()
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
