"""The cpu backend's fp32 small-M linear (`pdserve::linear_small_m`, kernels/cpu_linear.c) against torch's
`F.linear` on one decode step's linears of a model, same process, interleaved; with `--kernel int8`, the int8 GEMM of
`--quantization w8a8_int8` (`pdserve::linear_w8a8`, kernels/cpu_int8_gemm.c) against torch's fp32 `F.linear` on a
prefill chunk's rows (every linear it takes, the LM head included since `99d53c9`). `--baseline` names what "theirs"
is: torch's `F.linear` (the default), our fp32 small-M kernel, or our GGUF-blocks kernel over Q4_1 weights (the
packaged model's form, the weights then made exactly Q4_1; `pdserve::linear_blocks`, x of one row quantized to 8 bits
as `--quantization gguf` computes it, more rows exact): what a decode step's rows read without `w8a8_int8`.

For each row count M (a decode batch), x of M rows goes through every linear of the model once per pass (its own
weights, distinct tensors, so they stream from DRAM as in a step: SmolLM2-135M's are 538 MB in fp32), alternately
ours then torch's, `--repeats` times; the best pass of each is reported, and their ratio (torch / ours: > 1 means
ours is faster). The weights are random (only shapes matter); the shapes come from the model's config.json.

`--ceiling` (with `--kernel int8`) also measures what the GEMM cannot exceed on this CPU: bench/int8_ceiling.c, its
inner loop's instruction mix for the ISA level in use with nothing to load or store, built with the system's C
compiler and run on the same threads right before each row count and after the last; each row reports the GEMM's
GOPS as a fraction of the higher of the two probes around it (VMs change speed from minute to minute here).

    .venv/bin/python bench/small_linear.py                       # packaged model, M = 1 2 4 ... 64, 2 threads
    .venv/bin/python bench/small_linear.py --rows 16,32 --threads 1 --out result.json
    .venv/bin/python bench/small_linear.py --kernel int8 --rows 128,512     # int8 GEMM, prefill-sized M
    .venv/bin/python bench/small_linear.py --kernel int8 --baseline blocks --rows 1,2,4,8,16,32,64   # decode rows
    .venv/bin/python bench/small_linear.py --kernel int8 --rows 64,512 --ceiling     # against the CPU's own ceiling
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hostinfo import commit, machine  # noqa: E402


def q4_1_exact(out_features: int, in_features: int, gen):
    """A random fp32 [N, K] weight that is exactly a Q4_1 tensor's dequantization (each block of 32 along K holds its
    minimum and maximum, d and m fp16), as `engine.execution.packing.q4_1_blocks` recognizes one."""
    import torch

    q = torch.randint(0, 16, (out_features, in_features // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(out_features, in_features // 32, 1, generator=gen) * 0.01 + 1e-3).half().float()
    m = (-torch.rand(out_features, in_features // 32, 1, generator=gen) * 0.05).half().float()
    return (d * q + m).reshape(out_features, in_features)


def linear_shapes(model_dir: Path) -> list[tuple[int, int, int]]:
    """(out_features, in_features, count) of one forward's linears: q, k, v, o, gate, up, down per layer, and the LM
    head."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(model_dir))
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    h, q, kv, inter, n = (c.hidden_size, c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim,
                          c.intermediate_size, c.num_hidden_layers)
    shapes: dict[tuple[int, int], int] = {}
    for out, inp in [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter)]:
        shapes[(out, inp)] = shapes.get((out, inp), 0) + n
    shapes[(c.vocab_size, h)] = shapes.get((c.vocab_size, h), 0) + 1
    return [(o, i, k) for (o, i), k in shapes.items()]


# The ISA level the library runs -> the instruction mix of its int8 GEMM (bench/int8_ceiling.c's MIX).
CEILING_MIX = {"avx2": "avx2", "avx512": "avx512", "avx512_vnni": "avx512_vnni", "avx512_bf16": "avx512_vnni"}


class Ceiling:
    """bench/int8_ceiling.c built once into a temporary directory it owns; `gops()` runs it (about a second).

    Raises:
        SystemExit: no C compiler, the build failed, or the ISA level has no int8 mix (one line, for the user).
    """

    def __init__(self, isa: str, threads: int):
        if isa not in CEILING_MIX:
            raise SystemExit(f"--ceiling: the {isa} build has no vector int8 mix to measure")
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if not cc:
            raise SystemExit("--ceiling needs a C compiler (cc, gcc or $CC)")
        self._dir = tempfile.TemporaryDirectory(prefix="pdserve-ceiling-")  # removed with this object
        self.binary = str(Path(self._dir.name) / "int8_ceiling")
        build = subprocess.run([cc, "-O2", "-fopenmp", str(Path(__file__).with_name("int8_ceiling.c")), "-o",
                                self.binary], capture_output=True, text=True)
        if build.returncode:
            raise SystemExit(f"--ceiling: {cc} could not build bench/int8_ceiling.c: {build.stderr.strip()[-300:]}")
        self.mix, self.threads = CEILING_MIX[isa], threads

    def gops(self) -> float:
        """GOPS (2 x int8 products / s) of the mix on `threads` threads, now."""
        out = subprocess.run([self.binary, self.mix, str(self.threads)], capture_output=True, text=True, check=True)
        return float(out.stdout.split()[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=None, help="model directory (default: the packaged model)")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64", help="row counts M, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--kernel", choices=("small_m", "int8"), default="small_m")
    parser.add_argument("--baseline", choices=("torch", "small_m", "blocks"), default="torch",
                        help="what ours is timed against (module docstring)")
    parser.add_argument("--ceiling", action="store_true",
                        help="with --kernel int8: also measure the CPU's ceiling for the GEMM's instruction mix "
                             "(bench/int8_ceiling.c; needs a C compiler) and report the GEMM's fraction of it")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    if args.ceiling and args.kernel != "int8":
        parser.error("--ceiling measures the int8 GEMM's ceiling: add --kernel int8")

    import torch

    from pdserve_server.cli.models import resolve_model
    from pdserve_server.kernels.cpu_ops import cpu_isa, load_library

    load_library()
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir) if args.model_dir else resolve_model(None)
    shapes = linear_shapes(model_dir)
    if args.kernel == "int8":
        from pdserve_server.engine.execution.packing import W8A8_BLOCK, w8a8_packed, w8a8_weights

        shapes = [(o, i, k) for o, i, k in shapes if i % W8A8_BLOCK == 0]  # what use_w8a8 switches, LM head too
    gen = torch.Generator().manual_seed(0)
    make = q4_1_exact if args.baseline == "blocks" else lambda o, i, g: torch.randn(o, i, generator=g)
    weights = [make(o, i, gen) for o, i, k in shapes for _ in range(k)]
    theirs = torch.nn.functional.linear
    if args.baseline == "small_m":
        theirs = lambda x, w: torch.ops.pdserve.linear_small_m(x, w, None)  # noqa: E731
    elif args.baseline == "blocks":
        from pdserve_server.engine.execution.packing import q4_1_blocks

        blocks = {id(w): q4_1_blocks(w) for w in weights}
        theirs = lambda x, w: torch.ops.pdserve.linear_blocks(x, *blocks[id(w)], None, x.shape[0] == 1)  # noqa: E731
    if args.kernel == "int8":
        packed = {id(w): (w8a8_packed(wq), w_scale) for w in weights for wq, w_scale in [w8a8_weights(w)]}
        ours = lambda x, w: torch.ops.pdserve.linear_w8a8(x, *packed[id(w)], None)  # noqa: E731
    else:
        ours = lambda x, w: torch.ops.pdserve.linear_small_m(x, w, None)  # noqa: E731
    params = sum(w.numel() for w in weights)
    ceiling = Ceiling(cpu_isa(), args.threads) if args.ceiling else None
    print(f"# {machine()}; commit {commit()}; isa {cpu_isa()}; {args.threads} thread(s); kernel {args.kernel}; "
          f"{len(weights)} linears, {params * 4 / 1e6:.0f} MB fp32; baseline {args.baseline}"
          + (f"; ceiling: bench/int8_ceiling.c {ceiling.mix}" if ceiling else ""))
    print(f"{'M':>4} {'ours ms':>9} {'theirs ms':>9} {'theirs/ours':>11} {'ours GFLOP/s':>13}"
          + (f" {'ceiling GOPS':>13} {'of ceiling':>10}" if ceiling else ""))
    rows = []
    probe = ceiling.gops() if ceiling else None
    for m in [int(r) for r in args.rows.split(",")]:
        xs = {w.shape[1]: torch.randn(m, w.shape[1], generator=gen) for w in weights}
        best = {"ours": float("inf"), "theirs": float("inf")}
        for _ in range(args.repeats):
            for name, fn in (("ours", ours), ("theirs", theirs)):
                start = time.perf_counter()
                for w in weights:
                    fn(xs[w.shape[1]], w)
                best[name] = min(best[name], time.perf_counter() - start)
        row = {"rows": m, "ours_ms": best["ours"] * 1e3, "theirs_ms": best["theirs"] * 1e3,
               "ratio": best["theirs"] / best["ours"], "ours_gflops": 2 * m * params / best["ours"] / 1e9}
        tail = ""
        if ceiling:
            before, probe = probe, ceiling.gops()
            row.update(ceiling_gops=max(before, probe), ceiling_probes=[before, probe])
            row["of_ceiling"] = row["ours_gflops"] / row["ceiling_gops"]
            tail = f" {row['ceiling_gops']:>13.1f} {row['of_ceiling']:>10.2f}"
        rows.append(row)
        print(f"{m:>4} {row['ours_ms']:>9.1f} {row['theirs_ms']:>9.1f} {row['ratio']:>11.2f} "
              f"{row['ours_gflops']:>13.1f}" + tail)
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine(), "commit": commit(), "isa": cpu_isa(),
                                              "threads": args.threads, "kernel": args.kernel, "baseline": args.baseline,
                                              "ceiling_mix": ceiling.mix if ceiling else None, "rows": rows},
                                             indent=1))


if __name__ == "__main__":
    main()
