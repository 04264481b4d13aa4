"""Where a decode step's time goes, and what fraction of the machine it uses (the steering number for CPU work).

    python bench/step_profile.py                          # packaged model, fp32 + bf16, batch 1/16/64, ctx 256
    python bench/step_profile.py --dtypes float32 --batches 64 --steps 20
    python bench/step_profile.py --backends torch,cpu     # the torch reference vs the C decode kernel, same run
    python bench/step_profile.py --dtypes bfloat16 --packed-weights on,off   # oneDNN-prepacked bf16 linears or not

For each dtype and batch size B, B requests of `--context` prompt tokens are prefilled through the real engine
(`build_engine`: scheduler + ModelRunner, the same objects a worker runs), then `--steps` decode steps are timed
through `ModelRunner.execute`, the path a worker takes (metadata packing, forward, logits, sampling). A second pass
under `torch.profiler` splits the step into:

- gemm: self time of the dense matmul ops (aten::mm / addmm / linear's mkldnn forms), lm_head included;
- attention: everything inside the paged attention ops (RoPE with the KV write, gather, softmax, the reference
  einsums);
- other ops: the per-token ops counted whole (RMSNorm with its residual add, SiLU-and-mul; C or torch) and
  every other aten op (embedding, sampling's argmax, tensor creation);
- fused: the one-region decode step (`pdserve::decode_layers_fused`, bf16 packed or fp32 weights: every layer's
  linears, attention and per-token ops inside one OpenMP region, which the profiler cannot split);
- python: the step's wall time minus the time inside any op (packing lists, module dispatch, the scheduler's own
  bookkeeping is outside `execute` and not counted).

The baselines are measured in the same run, same dtype and thread count:

- GEMM rate: `torch.mm` on the model's own linear shapes at M = B rows (for bf16, oneDNN's prepacked op when
  faster: the best dense GEMM torch offers in that dtype);
- copy bandwidth: `Tensor.copy_` of a 256 MiB buffer (bytes read + written per second).

Fraction of the machine = achieved model FLOP/s / GEMM rate at M = B, where model FLOPs per step = 2 x (matmul
parameters) x B + attention's 4 x B x context x heads x head_dim x layers (the usual accounting, e.g. PaLM's MFU,
Chowdhery et al. 2022, appendix B). For B = 1 the step is bandwidth-bound, so the figure is weight bytes read per
second / copy bandwidth. Profiler timings carry the profiler's own overhead; the split is reported as shares of the
profiled step, the wall time from the unprofiled pass.

Roofline fraction = max(model FLOPs / GEMM rate, (weight + K/V bytes) / read bandwidth) / step time: the share of
the lower of the two bounds the step reaches. On a CPU with AMX the GEMM rate at M = 64 is high enough that a
decode step streaming its weights is bound by memory at every batch this benchmark runs, and the GEMM fraction
alone reads low; read bandwidth is a sum over a 256 MiB fp32 buffer (bytes read per second).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from pdserve_server.engine.args import EngineArgs  # noqa: E402
from pdserve_server.engine.builder import build_engine  # noqa: E402
from pdserve_server.engine.hardware import set_threads  # noqa: E402
from pdserve_server.engine.hardware import cpu_flags  # noqa: E402
from pdserve_server.engine.execution.cpu_decode_stack import CpuDecodeStack  # noqa: E402
from pdserve_server.engine.execution.packing import SmallBatchLinear, packing_supported  # noqa: E402
from pdserve_server.engine.request import Request, SamplingParams  # noqa: E402
from hostinfo import FLAGS_SHOWN, commit, machine  # noqa: E402

GEMM_OPS = {"aten::mm", "aten::addmm", "aten::mkldnn_linear", "mkldnn::_linear_pointwise", "aten::_mkl_linear",
            "mkl::_mkl_linear", "aten::_weight_int8pack_mm",
            "aten::_weight_int4pack_mm_for_cpu", "pdserve::linear_small_m", "pdserve::linear_packed_bf16",
            "pdserve::linear_blocks", "pdserve::linear_w8a8"}
# Ranges counted whole: _instrument's around the ops a Python forward calls, and those pdserve::decode_layers opens
# around the C calls it makes directly (kernels/cpu_ops.cpp).
ATTENTION_RANGES = ("attention", "pdserve::decode_layers:attention")
LAYER_OP_RANGES = ("layer_op", "pdserve::decode_layers:layer_op")
# The one-region decode step (kernels/cpu_decode_step.c): every layer's ops inside, not split.
FUSED_RANGES = ("pdserve::decode_layers_fused:step",)


def _time(fn, min_s: float = 0.3) -> float:
    """Seconds per call of fn(): one warm-up, then repeat until min_s has passed."""
    fn()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_s:
            return elapsed / n


def config_linear_shapes(mc) -> list[tuple[int, int]]:
    """(in_features, out_features) of every matmul in one token's forward, from a `ModelConfig` alone (pdserve's
    fused layout: q/k/v and gate/up are one matmul each), LM head included. A mixture-of-experts layer
    (`mc.moe.sparse_layers`) counts its router and the top_k experts one token runs; a batch of several tokens
    reads more experts' weights than that."""
    h, q, kv = mc.hidden_size, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    shapes = []
    for i in range(mc.num_layers):
        shapes += [(h, q + 2 * kv), (q, h)]
        moe = mc.moe
        if moe is not None and i in moe.sparse_layers:
            shapes += [(h, moe.num_experts)] + [(h, 2 * moe.intermediate_size), (moe.intermediate_size, h)] * moe.top_k
        else:
            shapes += [(h, 2 * mc.intermediate_size), (mc.intermediate_size, h)]
    return shapes + [(h, mc.vocab_size)]


def gemm_rate(shapes: list[tuple[int, int]], rows: int, dtype: torch.dtype) -> float:
    """FLOP/s of the best dense GEMM torch has for `dtype` over the model's linear shapes at `rows` rows (each
    distinct shape once, weighted by how often the model uses it): torch.mm, and for bf16 on CPU the oneDNN
    prepacked op pdserve runs (`engine.execution.packing`) when it is faster."""
    counts: dict[tuple[int, int], int] = {}
    for s in shapes:
        counts[s] = counts.get(s, 0) + 1
    flops = secs = 0.0
    for (k, n), c in counts.items():
        a, b = torch.randn(rows, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        t = _time(lambda: torch.mm(a, b), min_s=0.15)
        if packing_supported(a.device, dtype):
            w = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous())
            t = min(t, _time(lambda: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], ""), min_s=0.15))
        flops += c * 2 * rows * k * n
        secs += c * t
    return flops / secs


def copy_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes/s of a large copy (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    return 2 * nbytes / _time(lambda: dst.copy_(src), min_s=0.5)


def read_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes/s read by a sum over a large fp32 buffer: what a step that streams its weights and K/V can reach."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / _time(lambda: src.sum(), min_s=0.5)


def _instrument(model: torch.nn.Module) -> None:
    """Wrap the model's ops in record_function ranges so the profiler can attribute them: the paged attention ops
    (RoPE and the KV write included) in "attention", the per-token ops (RMSNorm, SiLU-and-mul; C calls on the cpu
    backend, which the profiler does not see otherwise) in "layer_op"."""
    def wrap(fn, label):
        def inner(*a, **k):
            with record_function(label):
                return fn(*a, **k)
        return inner
    ops = model.ops
    profiled = replace(ops, name=ops.name + "+profiled", **{
        name: wrap(getattr(ops, name), label) for name, label in (
            ("rotary_and_write_kv", "attention"), ("paged_decode_attention", "attention"),
            ("prefill_attention", "attention"), ("rms_norm", "layer_op"),
            ("silu_and_mul", "layer_op"))})
    model.ops = profiled
    for layer in model.layers:
        layer.self_attn.ops = layer.mlp.ops = profiled


def drop_gguf_blocks(runner) -> None:
    """Make `runner` read its fp32 weights where it holds GGUF blocks of them (`SmallBatchLinear.blocks`): the same
    numbers through the fp32 small-batch kernel, so the two forms can be timed against each other."""
    for m in runner.model.modules():
        if isinstance(m, SmallBatchLinear):
            m.blocks = None
    if runner.decode_stack is not None:
        runner.decode_stack = CpuDecodeStack.build(runner.model, runner.attention_ops)


def linear_bytes(model: torch.nn.Module) -> int | None:
    """Bytes of matmul weights one step reads when some linears are held as GGUF blocks (their qs and scales, the fp32
    tensor for the others), else None (the dtype's bytes per weight then apply)."""
    linears = [m for m in model.modules() if isinstance(m, SmallBatchLinear)]
    if not any(m.blocks is not None for m in linears):
        return None
    return sum(m.blocks[0].nbytes + m.blocks[1].nbytes if m.blocks is not None else m.weight.nbytes for m in linears)


def measure(args: EngineArgs, batch: int, context: int, steps: int, gguf_blocks: bool = True) -> dict:
    """Prefill `batch` requests of `context` tokens, then time and profile `steps` decode steps; gguf_blocks=False
    reads the fp32 weights where GGUF blocks of them are held. The KV budget (args.kv_tokens) is sized here: every
    request's prompt and tokens at once."""
    # The first requests decode while the last are prefilled: their tokens must outlast the prefill steps too, or
    # they finish before every request decodes together.
    max_tokens = 4 * steps + 8 + -(-batch * context // args.max_num_batched_tokens)
    parts = build_engine(replace(args, kv_tokens=batch * (context + max_tokens + 24) + 64))
    sched, runner = parts.scheduler, parts.runner
    if not gguf_blocks:
        drop_gguf_blocks(runner)
    gen = torch.Generator().manual_seed(0)
    vocab = parts.model_config.vocab_size
    for i in range(batch):
        prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens,
                                                                  temperature=0.0, ignore_eos=True)))

    def step() -> tuple[int, float]:
        out = sched.schedule()
        start = time.perf_counter()
        result = runner.execute(out)
        elapsed = time.perf_counter() - start
        sched.update(out, result)
        return len(out.decodes) if not out.prefills else -1, elapsed

    while step()[0] != batch:  # prefill everything; the first all-decode step ends the loop
        pass
    step()  # warm-up
    wall = [step()[1] for _ in range(steps)]
    step_s = sorted(wall)[len(wall) // 2]

    _instrument(runner.model)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        prof_wall = 0.0
        for _ in range(steps):
            prof_wall += step()[1]
    gemm_us = attn_us = ops_us = fused_us = 0.0
    for ev in prof.key_averages():
        if ev.key in FUSED_RANGES:
            fused_us += ev.cpu_time_total
        elif ev.key in ATTENTION_RANGES:
            attn_us += ev.cpu_time_total
        elif ev.key in LAYER_OP_RANGES:
            ops_us += ev.cpu_time_total
    # Self times of ops outside the attention ranges: walk the event tree once.
    for ev in prof.events():
        if ev.cpu_parent is None:
            gemm_us, ops_us = _accumulate(ev, gemm_us, ops_us)
    total_us = prof_wall * 1e6
    python_us = max(total_us - gemm_us - attn_us - ops_us - fused_us, 0.0)

    mc = parts.model_config
    shapes = config_linear_shapes(mc)
    matmul_params = sum(k * n for k, n in shapes)  # every linear, lm_head on the B sampled rows included
    ctx = context + steps  # the average context during the timed steps, to a few tokens
    flops = 2 * matmul_params * batch + 4 * batch * ctx * mc.num_heads * mc.head_dim * mc.num_layers
    # Bytes per weight: int8 1, int4 half a byte plus a 2-byte scale and zero per 32-weight group.
    elem = torch.empty((), dtype=mc.torch_dtype).element_size()
    blocks_bytes = linear_bytes(runner.model)
    weight_bytes = blocks_bytes or matmul_params * {"int8": 1.0, "int4": 0.5 + 4 / 32}.get(args.quantization, elem)
    kv_bytes = batch * ctx * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * elem  # K and V read once a step
    return {"batch": batch, "context": context, "backend": runner.attention_ops.name, "step_ms": step_s * 1e3,
            "gguf_blocks_read": blocks_bytes is not None,
            "tok_s": batch / step_s,
            "model_flop_s": flops / step_s, "weight_bytes_s": weight_bytes / step_s, "flops": flops,
            "bytes": weight_bytes + kv_bytes, "step_s": step_s,
            "split": {"gemm": gemm_us / total_us, "attention": attn_us / total_us, "other_ops": ops_us / total_us,
                      "fused": fused_us / total_us, "python": python_us / total_us},
            "shapes": shapes}


def _accumulate(ev, gemm_us: float, ops_us: float) -> tuple[float, float]:
    """Add self CPU time of ev's subtree to gemm / other ops, skipping the "attention" and "layer_op" ranges (counted
    whole)."""
    if ev.name in ATTENTION_RANGES or ev.name in LAYER_OP_RANGES or ev.name in FUSED_RANGES:
        return gemm_us, ops_us
    if ev.name in GEMM_OPS:
        gemm_us += ev.self_cpu_time_total
    elif ev.name.startswith(("aten::", "mkldnn::", "mkl::")):
        ops_us += ev.self_cpu_time_total
    for child in ev.cpu_children:
        gemm_us, ops_us = _accumulate(child, gemm_us, ops_us)
    return gemm_us, ops_us


def main(argv=None) -> int:
    from pdserve_server.cli.models import resolve_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=None, help="HF directory (default: the packaged SmolLM2-135M)")
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="comma-separated; DTYPE+int8 / DTYPE+int4 add weight-only quantized linears "
                        "(e.g. bfloat16+int4); float32+gguf: the GGUF blocks against 8-bit batch-1 rows "
                        "(--quantization gguf)")
    p.add_argument("--backends", default="auto",
                   help="comma-separated attention backends to compare (auto, torch, cpu; see "
                        "kernels.backends.select_ops)")
    p.add_argument("--packed-weights", default="on",
                   help="comma-separated on/off: bf16 linears prepacked for oneDNN (engine.execution.packing) or plain")
    p.add_argument("--gguf-blocks", default="on",
                   help="comma-separated on/off: fp32 linears whose weights are a dequantized GGUF tensor (the "
                        "packaged model's) read as those blocks, or as fp32 (engine.execution.packing.gguf_blocks)")
    p.add_argument("--enforce-eager", default="off",
                   help="comma-separated off/on: on runs every layer's ops from Python instead of the cpu backend's "
                        "one-call decode loop (engine.execution.cpu_decode_stack)")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=10, help="decode steps timed (and profiled) per point")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (a decode worker's share)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    set_threads(a.threads)
    base = EngineArgs(model_dir=str(resolve_model(a.model_dir)), threads=a.threads, max_num_seqs=256,
                      max_num_batched_tokens=max(512, a.context), kv_tokens=0)
    batches = [int(b) for b in a.batches.split(",")]
    report = {"machine": machine(), "cpu_flags": sorted(cpu_flags() & FLAGS_SHOWN), "commit": commit(),
              "threads": a.threads,
              "torch": torch.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds"), "copy_bytes_s": copy_bandwidth(), "read_bytes_s": read_bandwidth(),
              "points": []}
    print(f"# {report['machine']}; flags {' '.join(report['cpu_flags'])}; commit {report['commit']}; "
          f"{a.threads} thread(s); copy bandwidth {report['copy_bytes_s'] / 1e9:.1f} GB/s, read "
          f"{report['read_bytes_s'] / 1e9:.1f} GB/s")
    print("dtype     attn  pack gguf eager batch  step ms   tok/s  GEMM@B GF/s  model GF/s  frac   wbytes/copy  "
          "roofline  gemm  attn  other  fused  python")
    for name, backend, packing, gguf, eager in ((n, be, pk, q, e) for n in a.dtypes.split(",")
                                                for be in a.backends.split(",") for pk in a.packed_weights.split(",")
                                                for q in a.gguf_blocks.split(",") for e in a.enforce_eager.split(",")):
        dt, _, quant = name.partition("+")
        for b in batches:
            args = replace(base, dtype=dt, quantization=quant or "none", attention_backend=backend,
                           packed_weights=packing == "on", enforce_eager=eager == "on")
            point = measure(args, b, a.context, a.steps, gguf_blocks=gguf == "on")
            point["gguf_blocks"] = point.pop("gguf_blocks_read")
            torch_dtype = getattr(torch, dt)  # the GEMM baseline stays the dense one: what int8 must beat
            point["dtype"], point["attention_backend"] = name, point.pop("backend")
            point["enforce_eager"] = eager == "on"
            # bf16: oneDNN-prepacked weights; fp32: the cpu backend's small-batch kernel (engine.execution.packing)
            point["packed_weights"] = (packing == "on" and dt in ("bfloat16", "float32")
                                       and quant in ("", "none", "gguf"))
            point["gemm_flop_s"] = gemm_rate(point.pop("shapes"), b, torch_dtype)
            point["fraction"] = point["model_flop_s"] / point["gemm_flop_s"]
            point["bandwidth_fraction"] = point["weight_bytes_s"] / report["copy_bytes_s"]
            # The roofline: the step cannot beat its GEMMs at the measured rate nor its weight + K/V bytes at the
            # measured read bandwidth (Williams et al. 2009, "Roofline"); this is the share of that bound reached.
            point["roofline_fraction"] = max(point.pop("flops") / point["gemm_flop_s"],
                                             point.pop("bytes") / report["read_bytes_s"]) / point.pop("step_s")
            sp = point["split"]
            print(f"{name:9} {point['attention_backend']:5} {'on' if point['packed_weights'] else '-':4} "
                  f"{'on' if point['gguf_blocks'] else '-':4} {eager:5} "
                  f"{b:5d} "
                  f"{point['step_ms']:8.1f} {point['tok_s']:7.1f} {point['gemm_flop_s'] / 1e9:11.1f} "
                  f"{point['model_flop_s'] / 1e9:11.1f} {point['fraction']:5.2f} {point['bandwidth_fraction']:12.2f}  "
                  f"{point['roofline_fraction']:8.2f}  "
                  f"{sp['gemm']:4.0%} {sp['attention']:5.0%} {sp['other_ops']:6.0%} {sp['fused']:6.0%} "
                  f"{sp['python']:6.0%}", flush=True)
            report["points"].append(point)
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
