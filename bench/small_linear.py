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

    .venv/bin/python bench/small_linear.py                       # packaged model, M = 1 2 4 ... 64, 2 threads
    .venv/bin/python bench/small_linear.py --rows 16,32 --threads 1 --out result.json
    .venv/bin/python bench/small_linear.py --kernel int8 --rows 128,512     # int8 GEMM, prefill-sized M
    .venv/bin/python bench/small_linear.py --kernel int8 --baseline blocks --rows 1,2,4,8,16,32,64   # decode rows
"""
from __future__ import annotations

import argparse
import json
import sys
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=None, help="model directory (default: the packaged model)")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64", help="row counts M, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--kernel", choices=("small_m", "int8"), default="small_m")
    parser.add_argument("--baseline", choices=("torch", "small_m", "blocks"), default="torch",
                        help="what ours is timed against (module docstring)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()

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
    print(f"# {machine()}; commit {commit()}; isa {cpu_isa()}; {args.threads} thread(s); kernel {args.kernel}; "
          f"{len(weights)} linears, {params * 4 / 1e6:.0f} MB fp32; baseline {args.baseline}")
    print(f"{'M':>4} {'ours ms':>9} {'theirs ms':>9} {'theirs/ours':>11} {'ours GFLOP/s':>13}")
    rows = []
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
        rows.append(row)
        print(f"{m:>4} {row['ours_ms']:>9.1f} {row['theirs_ms']:>9.1f} {row['ratio']:>11.2f} "
              f"{row['ours_gflops']:>13.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine(), "commit": commit(), "isa": cpu_isa(),
                                              "threads": args.threads, "kernel": args.kernel, "baseline": args.baseline,
                                              "rows": rows},
                                             indent=1))


if __name__ == "__main__":
    main()
