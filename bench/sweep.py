"""The concurrency sweep (seed 004's benchmark shape): pdserve disaggregated vs colocated vs the naive
`model.generate()` server, plus optional OpenAI-compatible peers, on one model and machine in one run.

    python bench/sweep.py --quick                 # < 10 min on a 2-core CPU
    python bench/sweep.py                         # concurrency 1,4,8,16,32,64 x 64 requests each
    python bench/sweep.py --peer vllm=http://127.0.0.1:8000,SmolLM2   # add a running peer

Writes results.json, results.md and results.png to --out-dir. Each level sends fresh prompts (different windows of
real text) after a warm-up request per system, so first-connect costs stay out of the numbers.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from interleave import combine, head_to_head, round_order  # noqa: E402
from loadgen import run_level  # noqa: E402
from metrics import Slo, summarize  # noqa: E402
from prompts import make_requests, seed_requests  # noqa: E402
from hostinfo import commit, machine  # noqa: E402
from report import markdown, plot  # noqa: E402
import systems  # noqa: E402

LLAMACPP_SYSTEMS = {"llamacpp": "q4_1", "llamacpp-q8_0": "q8_0", "llamacpp-bf16": "bf16", "llamacpp-f32": "f32"}
# Thread-runtime settings every system inherits from this shell. OMP_WAIT_POLICY=PASSIVE (what scripts/test.sh sets
# for the tests) put every OpenMP barrier to sleep: `serve` at S c=1 ran 47.3 tok/s with it against 98.4 without on
# the Zen 3 VM (2026-12-07). Recorded in the results' config and named before the run.
THREAD_ENV = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "OMP_PROC_BIND", "GOMP_SPINCOUNT", "KMP_BLOCKTIME",
              "MKL_NUM_THREADS")
ALL_SYSTEMS = ("pdserve-disagg", "pdserve-colocated", "naive", *LLAMACPP_SYSTEMS, "vllm", "vllm-all-cores",
               "vllm-bf16", "vllm-all-cores-bf16", "pdserve-disagg-observed")


def default_systems() -> tuple[str, ...]:
    """pdserve both ways, the naive baseline, and each peer in its best dense precision on this CPU: bf16 where
    the CPU has native bf16 arithmetic (AVX512-BF16 or AMX: what pdserve's `--dtype auto` picks too), else fp32
    (a peer's bf16 is emulated there, slower than its fp32); and llama.cpp's quantized GGUFs of the same weights
    (Q4_1, the packaged file itself, and Q8_0), which a llama.cpp user serves: on an AMD EPYC Zen 4 with AVX512-BF16
    its Q8_0 ran 94-104 tok/s at one short request against its bf16's 70-75 (docs/benchmarks.md)."""
    from pdserve_server.engine.hardware import resolve_dtype

    bf16 = resolve_dtype("auto", "cpu") == "bfloat16"
    peers = ("llamacpp-bf16", "vllm-bf16", "vllm-all-cores-bf16") if bf16 else ("llamacpp-f32", "vllm",
                                                                                "vllm-all-cores")
    return ("pdserve-disagg", "pdserve-colocated", "naive", *peers, "llamacpp", "llamacpp-q8_0")


WORKLOADS = ("docs", "seed")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", default=None, help=f"comma list from {ALL_SYSTEMS} (default: `default_systems`, "
                                                   "pdserve, each peer in this CPU's best dense precision, llama.cpp's "
                                                   "Q4_1 and Q8_0)")
    p.add_argument("--peer", action="append", default=[], help="name=http://host:port[,model] (repeat)")
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=disagg|colocated[xN]:WORKER_ARGS[|COORDINATOR_ARGS], a further pdserve system with "
                        "its own worker (and coordinator) flags (xN: N colocated workers, or N decode workers beside "
                        "one prefill worker), e.g. 'pdserve-int8=colocated:--dtype bfloat16 --quantization int8' or "
                        "'pdserve-local=disagg:--dtype bfloat16|--local-prefill-tokens 64' (repeat)")
    p.add_argument("--model-dir", default=None, help="HF directory (default: the packaged SmolLM2-135M)")
    p.add_argument("--workload", default="docs", choices=WORKLOADS,
                   help="docs = --input-len windows of real text; seed = seed 004's one chat prompt, 75 tokens out")
    p.add_argument("--llama-server", default=None, help="llama-server binary (default: $LLAMA_SERVER, the "
                                                        "bench/README.md build, or PATH)")
    p.add_argument("--vllm", default=None, help="vllm command (default: $VLLM, ~/.cache/vllm-venv/bin/vllm, or PATH)")
    p.add_argument("--concurrency", default="1,4,8,16,32,64")
    p.add_argument("--num-requests", type=int, default=64,
                   help="requests per concurrency level (at least the level's concurrency)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=None, help="default 64 (docs), 75 (seed)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="0 = fixed lengths; r = uniform +-r")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=150.0)
    p.add_argument("--level-time-limit-s", type=float, default=1200.0, help="bound on one level")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads per system in total")
    p.add_argument("--worker-args", default="", help="extra flags for pdserve workers, e.g. '--kv-tokens 8192'")
    p.add_argument("--quick", action="store_true",
                   help="output 32 tokens, max(concurrency, 16) requests per level, 180 s per level at most")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every system this many times, the order reversed each round (ABC CBA ...), so a "
                        "machine that drifts favours no system; a level's figures are medians over the rounds "
                        "(bench/interleave.py), each round's kept in results.json")
    p.add_argument("--out-dir", default=None, help="default bench/results/<UTC timestamp>")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.systems is None:
        args.systems = ",".join(default_systems())
    if args.output_len is None:
        args.output_len = 75 if args.workload == "seed" else 64
    if args.quick:
        args.output_len = min(args.output_len, 32)
        args.level_time_limit_s = min(args.level_time_limit_s, 180.0)
    return args


def requests_per_level(args, concurrency: int) -> int:
    """At least one request per slot: a level with fewer requests than its concurrency never reaches it."""
    return max(concurrency, 16 if args.quick else args.num_requests)


async def sweep_system(name: str, backend, args, tokenizer, levels: list[int], slo: Slo) -> list[dict]:
    """Warm up, then run every concurrency level. Returns one metrics row per level.

    Raises:
        RuntimeError: the warm-up request failed (the system is not serving).
    """
    from tqdm import tqdm

    warm = make_requests(tokenizer, 1, 16, 4, seed=10_000)[0]
    res = await backend.run(warm)
    if res.error:
        raise RuntimeError(f"{name}: warm-up request failed: {res.error}")
    rows = []
    for i, conc in enumerate(levels):
        n = requests_per_level(args, conc)
        reqs = (seed_requests(tokenizer, n, args.output_len) if args.workload == "seed" else
                make_requests(tokenizer, n, args.input_len, args.output_len, args.range_ratio, seed=i))
        with tqdm(total=len(reqs), desc=f"{name} c={conc}", unit="req", leave=False) as bar:
            results, duration = await run_level(backend, reqs, conc, args.level_time_limit_s,
                                                on_done=lambda r: bar.update(1))
        row = {"concurrency": conc, **summarize(results, duration, slo)}
        errors = sorted({r.error for r in results if r.error})
        if errors:
            row["errors"] = errors[:5]
        rows.append(row)
        print(f"{name:>18} c={conc:<3} done={row['completed']:<3} fail={row['failed']:<3} "
              f"TTFT p50={row['ttft_ms_p50']:8.0f} ms  ITL p50={row['itl_ms_p50']:7.1f} ms  "
              f"TPOT p50={row['tpot_ms_p50']:7.1f} ms  {row['output_tok_s']:7.1f} tok/s  "
              f"goodput={row['goodput_req_s']:.2f} req/s", flush=True)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from pdserve_server.cli.models import resolve_model

    model_dir = args.model_dir or str(resolve_model(None))
    levels = [int(c) for c in args.concurrency.split(",")]
    names = [n for n in args.systems.split(",") if n]
    unknown = set(names) - set(ALL_SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {ALL_SYSTEMS} or use --peer")
    try:  # a malformed --peer must stop the run before it starts, not after the other systems ran unrecorded
        peers = [systems.peer(spec) for spec in args.peer]
    except ValueError as e:
        raise SystemExit(str(e)) from e
    out_dir = Path(args.out_dir or HERE / "results" / datetime.datetime.utcnow().strftime("%Y%m%dT%H%M%SZ"))
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = out_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    results = {"config": {"model": Path(model_dir).name, "workload": args.workload,
                          "input_len": len(seed_requests(tokenizer, 1)[0].prompt_ids) if args.workload == "seed"
                          else args.input_len, "output_len": args.output_len,
                          "range_ratio": args.range_ratio, "num_requests": "max(c,16)" if args.quick else
                          args.num_requests, "levels": levels, "slo_ttft_ms": args.slo_ttft_ms,
                          "slo_tpot_ms": args.slo_tpot_ms, "threads": args.threads, "machine": machine(),
                          "commit": commit(), "date": utc_now(),
                          "quick": args.quick, "rounds": args.rounds, "worker_args": args.worker_args,
                          "variants": args.variant,
                          "thread_env": {k: os.environ[k] for k in THREAD_ENV if k in os.environ}},
               "systems": {}}
    starters = {
        "pdserve-disagg": lambda: systems.start_pdserve("pdserve-disagg", model_dir, False, args.threads,
                                                        str(log_dir), args.worker_args.split()),
        "pdserve-colocated": lambda: systems.start_pdserve("pdserve-colocated", model_dir, True, args.threads,
                                                           str(log_dir), args.worker_args.split()),
        "pdserve-disagg-observed": lambda: systems.start_pdserve(
            "pdserve-disagg-observed", model_dir, False, args.threads, str(log_dir), args.worker_args.split(),
            observed=True),
        "naive": lambda: systems.start_naive(model_dir, args.threads, str(log_dir)),
        **{name: (lambda name=name, kind=kind: _start_llamacpp(args, tokenizer, levels, log_dir, name, kind))
           for name, kind in LLAMACPP_SYSTEMS.items()},
        "vllm": lambda: _start_vllm(args, model_dir, levels, log_dir, all_cores=False),
        "vllm-bf16": lambda: _start_vllm(args, model_dir, levels, log_dir, all_cores=False, dtype="bfloat16"),
        "vllm-all-cores": lambda: _start_vllm(args, model_dir, levels, log_dir, all_cores=True),
        "vllm-all-cores-bf16": lambda: _start_vllm(args, model_dir, levels, log_dir, all_cores=True,
                                                   dtype="bfloat16"),
    }
    variant_args: dict[str, list[str]] = {}
    for spec in args.variant:
        name, _, rest = spec.partition("=")
        topology, _, extra = rest.partition(":")
        extra, _, coordinator = extra.partition("|")
        variant_args[name] = extra.split()
        shape = re.fullmatch(r"(disagg|colocated)(?:x([1-9][0-9]*))?", topology)
        if not name or shape is None:
            raise SystemExit(f"--variant wants NAME=disagg|colocated[xN]:WORKER_ARGS[|COORDINATOR_ARGS], got {spec!r}")
        starters[name] = (lambda name=name, colocated=shape[1] == "colocated", n=int(shape[2] or 1), extra=extra,
                          coordinator=coordinator:
                          systems.start_pdserve(name, model_dir, colocated, args.threads, str(log_dir),
                                                args.worker_args.split() + extra.split(), workers=n,
                                                coordinator_args=coordinator.split()))
        names.append(name)
    plan = [(n, starters[n]) for n in names] + [(p.name, lambda p=p: p) for p in peers]
    if results["config"]["thread_env"]:
        print("note: every system inherits " + " ".join(f"{k}={v}" for k, v in results["config"]["thread_env"].items())
              + " from this shell", flush=True)
    per_round: list[dict[str, list[dict]]] = [{} for _ in range(args.rounds)]
    for rnd, (name, start) in round_order(plan, args.rounds):
        print(f"starting {name}" + (f" (round {rnd + 1} of {args.rounds})" if args.rounds > 1 else "") + " ...",
              flush=True)
        results.setdefault("order", []).append({"round": rnd, "system": name, "start": utc_now()})
        try:
            system = start()
        except (RuntimeError, FileNotFoundError) as e:  # a peer that cannot start is reported, the rest still run
            print(f"{name}: not run: {e}", flush=True)
            # per round: a system that failed to start in one round may have run in another (its rows are those)
            results.setdefault("not_run", {})[name if args.rounds == 1 else f"{name} (round {rnd + 1})"] = str(e)
            continue
        try:
            per_round[rnd][name] = asyncio.run(_run(system, args, tokenizer, levels, slo))
        finally:
            system.stop()
        # what has run so far, so a sweep stopped part-way (an hour at L) keeps it; removed once results.json is written
        (out_dir / "partial.json").write_text(json.dumps({**results, "rounds": per_round}, indent=1))
    for name, _ in plan:
        rows = [r[name] for r in per_round if name in r]
        if rows:
            results["systems"][name] = combine(rows) if args.rounds > 1 else rows[0]
    pdserve_names = {n for n in starters if n.startswith("pdserve")} | set(variant_args)
    add_machine_fraction(results, model_dir, args.threads,
                         {name: weight_format(name, args.worker_args.split() + variant_args.get(name, []),
                                              pdserve=name in pdserve_names,
                                              gguf_source=None if args.model_dir else "q4_1")
                          for name in results["systems"]})
    if args.rounds > 1:
        results["rounds"] = per_round
    is_ours = pdserve_names.__contains__
    results["versus_peers"] = {"combined": head_to_head(results["systems"], is_ours),
                               "rounds": [head_to_head(r, is_ours) for r in per_round] if args.rounds > 1 else []}
    naive = {r["concurrency"]: r["output_tok_s"] for r in results["systems"].get("naive", [])}
    if naive:
        results["ratios"] = {name: {r["concurrency"]: r["output_tok_s"] / naive[r["concurrency"]]
                                    for r in rows if naive.get(r["concurrency"])}
                             for name, rows in results["systems"].items() if name != "naive"}
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "partial.json").unlink(missing_ok=True)
    (out_dir / "results.md").write_text(markdown(results))
    plot(results, out_dir / "results.png")
    print(markdown(results))
    print(f"wrote {out_dir}/results.{{json,md,png}}")
    failed = sum(r["failed"] for rows in results["systems"].values() for r in rows)
    return 1 if failed else 0


DENSE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # bytes per weight of a dense dtype


def weight_format(name: str, worker_args: list[str], pdserve: bool, gguf_source: str | None = None) -> str | None:
    """How a system stores its matmul weights: a dense dtype (`DENSE_BYTES`), "int8" / "int4" (pdserve's
    --quantization), "gguf:<type>" (llama.cpp's quantized files, `systems.GGUF_TYPES`, its f32 / bf16 files being
    dense; and pdserve's --quantization gguf on a model converted from such a file), "float32+gguf:<type>" (fp32
    compute on weights read as the GGUF blocks they exactly are), or None where the harness does not know (a --peer).
    pdserve (`pdserve`: a built-in pdserve system or a --variant, whatever its name): its --dtype, auto resolved for
    this CPU, unless quantized; in fp32 on a model converted from a GGUF of type `gguf_source` (the packaged default:
    q4_1) its decode steps read that file's blocks (`engine.execution.packing.gguf_blocks`). The naive server fp32;
    vLLM its --dtype (float32, or bfloat16 for the -bf16 system)."""
    from pdserve_server.engine.args import EngineArgs
    from pdserve_server.engine.hardware import resolve_dtype

    if pdserve:
        dtype = next(f.default for f in dataclasses.fields(EngineArgs) if f.name == "dtype")  # what a worker takes
        quantization = "none"
        for i, arg in enumerate(worker_args[:-1]):  # as the worker reads its flags: the last one wins
            if arg == "--dtype":
                dtype = worker_args[i + 1]
            elif arg == "--quantization":
                quantization = worker_args[i + 1]
        if quantization == "gguf":  # the model's own GGUF blocks, as llama.cpp reads them
            return f"gguf:{gguf_source}" if gguf_source else None
        if quantization != "none":
            return quantization
        dtype = resolve_dtype(dtype, "cpu")
        return f"float32+gguf:{gguf_source}" if dtype == "float32" and gguf_source else dtype
    if name in LLAMACPP_SYSTEMS:
        kind = LLAMACPP_SYSTEMS[name]
        return {"f32": "float32", "bf16": "bfloat16"}.get(kind, f"gguf:{kind}")
    if name == "naive":
        return "float32"
    if name.startswith("vllm"):
        return "bfloat16" if name.endswith("-bf16") else "float32"
    return None


def dense_dtype(fmt: str | None) -> str | None:
    """The dense dtype of a `weight_format`, the dtype of the GEMM rate the machine fraction is measured against;
    None for quantized or unknown weights (no dense GEMM rate is their baseline: int4 at M = 1 beats it); fp32 for
    fp32 compute on GGUF blocks."""
    dense = (fmt or "").partition("+")[0]
    return dense if dense in DENSE_BYTES else None


def weight_bytes_per_token(fmt: str | None, shapes: list[tuple[int, int]]) -> float | None:
    """Bytes of matmul weights a system stored as `fmt` (`weight_format`) reads to decode one token at batch 1: every
    projection and the LM head once (`shapes`, `step_profile.config_linear_shapes`); the embedding lookup's one row
    is left out. None where the format is unknown.

    Dense: 4 or 2 bytes a weight; int8 one byte plus a 2-byte scale per output channel; int4 half a byte plus a
    2-byte scale and zero per group of 32 (`engine.execution.quantization`); gguf:<type> (and float32+gguf:<type>,
    which reads the same blocks): that file's 2-D tensors at their stored sizes, the token embedding counted as the
    tied LM head (the packaged Q4_1 file: Q4_1 layers, a Q8_0 head)."""
    params = sum(k * n for k, n in shapes)
    if fmt in DENSE_BYTES:
        return params * DENSE_BYTES[fmt]
    if fmt == "int8":
        return params + 2 * sum(n for _, n in shapes)
    if fmt == "int4":
        return params * (0.5 + 4 / 32)
    if fmt is not None and "gguf:" in fmt:
        return _gguf_matmul_bytes(fmt.partition("gguf:")[2])
    return None


def _gguf_matmul_bytes(kind: str) -> float:
    """Bytes of a GGUF's 2-D tensors (llama.cpp's matmul weights; `systems.find_gguf(kind)`), without the token
    embedding when the file has a separate output head (then the embedding is only looked up)."""
    import gguf

    tensors = [t for t in gguf.GGUFReader(str(systems.find_gguf(kind))).tensors if len(t.shape) == 2]
    has_head = any(t.name == "output.weight" for t in tensors)
    return float(sum(int(t.n_bytes) for t in tensors if not (has_head and t.name == "token_embd.weight")))


def add_machine_fraction(results: dict, model_dir: str, threads: int, formats: dict[str, str | None]) -> None:
    """Add the fraction of the machine to every level row (the steering number for CPU work), both against baselines
    measured now with the sweep's thread count:

    - `machine_fraction`: achieved model FLOP/s over the dense GEMM rate in the system's dtype at M = the level's
      concurrency (bench/step_profile.py's `gemm_rate`). Model FLOPs per output token = 2 x matmul parameters (LM
      head included) + attention's 4 x context x heads x head_dim x layers at the mean context (prompt + half the
      output); the PaLM MFU accounting (Chowdhery et al. 2022, appendix B). Prefill FLOPs are left out: the seed's
      prompt is a prefix-cache hit. NaN where the system has no dense dtype (`dense_dtype`).
    - `bandwidth_fraction`, at concurrency 1 only, where a decode step reads every weight once per token: weight
      bytes read per second (output tok/s x `weight_bytes_per_token`) over the copy bandwidth (bytes read + written per
      second of a 256 MiB `Tensor.copy_`, `step_profile.copy_bandwidth`, the median of three). Also for quantized
      systems and llama.cpp, which have no dense GEMM baseline.
    """
    import torch

    from pdserve_server.engine.hardware import set_threads
    from pdserve_server.engine.models.config import ModelConfig
    from step_profile import config_linear_shapes, copy_bandwidth, gemm_rate
    from transformers import AutoConfig

    mc = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir), name="m", path=model_dir)
    shapes = config_linear_shapes(mc)
    ctx = results["config"]["input_len"] + results["config"]["output_len"] / 2
    flops_per_token = 2 * sum(k * n for k, n in shapes) + 4 * ctx * mc.num_heads * mc.head_dim * mc.num_layers
    set_threads(threads)
    rates: dict[tuple[str, int], float] = {}
    copy_bytes_s = None
    weight_bytes = {name: weight_bytes_per_token(formats.get(name), shapes) for name in results["systems"]}
    for name, rows in results["systems"].items():
        dtype, per_token = dense_dtype(formats.get(name)), weight_bytes[name]
        for r in rows:
            if r["concurrency"] == 1 and per_token is not None:
                # the median of three: one run here read 78 GB/s where the others, before and after, read 44-46
                copy_bytes_s = copy_bytes_s or sorted(copy_bandwidth() for _ in range(3))[1]
                r["bandwidth_fraction"] = r["output_tok_s"] * per_token / copy_bytes_s
            if dtype is None:
                r["machine_fraction"] = float("nan")
                continue
            key = (dtype, r["concurrency"])
            if key not in rates:
                rates[key] = gemm_rate(shapes, r["concurrency"], getattr(torch, dtype))
            r["gemm_flop_s"] = rates[key]
            r["machine_fraction"] = r["output_tok_s"] * flops_per_token / rates[key]
    results["config"]["gemm_flop_s"] = {f"{d}@{c}": v for (d, c), v in rates.items()}
    results["config"]["copy_bytes_s"] = copy_bytes_s
    results["config"]["weight_bytes_per_token"] = weight_bytes


def _start_llamacpp(args, tokenizer, levels: list[int], log_dir: Path, name: str, kind: str):
    """llama-server (system `name`) on the GGUF of the packaged weights in `kind` (`systems.find_gguf`), all of
    --threads, one slot per request at the highest level.

    Raises:
        FileNotFoundError: no llama-server binary or no such GGUF (bench/install_peers.sh makes both).
    """
    binary = args.llama_server or systems.find_llama_server()
    if not binary:
        raise FileNotFoundError("no llama-server binary: run `bash bench/install_peers.sh llamacpp`, or pass "
                                "--llama-server")
    ctx = (len(seed_requests(tokenizer, 1)[0].prompt_ids) if args.workload == "seed"
           else int(args.input_len * (1 + args.range_ratio))) + int(args.output_len * (1 + args.range_ratio)) + 64
    return systems.start_llama_server(name, binary, str(systems.find_gguf(kind)), args.threads, max(levels), ctx,
                                      str(log_dir))


def _start_vllm(args, model_dir: str, levels: list[int], log_dir: Path, all_cores: bool,
                dtype: str = "float32"):
    """vLLM's CPU build (bench/README.md), its default core placement or all of --threads.

    Raises:
        FileNotFoundError: no vllm command.
    """
    binary = args.vllm or systems.find_vllm()
    if not binary:
        raise FileNotFoundError("no vllm command: run `bash bench/install_peers.sh vllm`, or pass --vllm")
    return systems.start_vllm(binary, model_dir, args.threads, max(levels), str(log_dir), all_cores, dtype)


def utc_now() -> str:
    """The current UTC time as ISO 8601 to the second, e.g. "2026-12-07T14:42:29Z" (results' dates and start times)."""
    return datetime.datetime.utcnow().isoformat(timespec="seconds") + "Z"


async def _run(system, args, tokenizer, levels, slo):
    backend = system.make_backend()
    try:
        return await sweep_system(system.name, backend, args, tokenizer, levels, slo)
    finally:
        await backend.close()


if __name__ == "__main__":
    sys.exit(main())
