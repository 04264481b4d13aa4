"""Compile every Triton kernel for Hopper (sm_90) on any machine, GPU or not, and report its resources.

Triton lowers the kernels to PTX and assembles them with its bundled ptxas; `cuobjdump` (also bundled) reads the
cubin's registers, stack (local-memory spills) and shared memory, and counts the tensor-core and load
instructions in the SASS. This is the "read what costs no device time" step before any GPU timing: errors the CPU
interpreter cannot see (layouts, dot shapes) and spills show up here.

Argument hints match what Triton's JIT infers at a real launch on our tensors (pointers and integer arguments
divisible by 16, but those a kernel marks do_not_specialize); shapes are Llama-3-8B's in bf16 (32 q / 8 kv heads,
head_dim 128, block size 16).

Usage: python bench/kernel_report.py [--json PATH]   (must run without TRITON_INTERPRET=1)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

BF16 = "*bf16"
LLAMA3 = dict(BLOCK_SIZE=16, NUM_KV_HEADS=8, GROUP=4, HEAD_DIM=128, HEAD_PAD=128)
ATTN_TYPES = dict(q_ptr=BF16, k_ptr=BF16, v_ptr=BF16, bt_ptr="*i32", ctx_ptr="*i32", cu_ptr="*i32", out_ptr=BF16,
                  part_acc_ptr="*fp32", part_ml_ptr="*fp32", qk_scale="fp32")


def _cases():
    from pdserve_server.kernels.triton_cache import _write_kv_kernel
    from pdserve_server.kernels.triton_decode import _decode_kernel, _merge_kernel
    import torch

    from pdserve_server.kernels.triton_prefill import _prefill_kernel, prefill_config

    dot = dict(UPCAST_DOT=False, DOT_PRECISION="tf32")
    pf = prefill_config(LLAMA3["HEAD_PAD"], torch.bfloat16)  # the launch shape the engine would use
    return {
        "decode": (_decode_kernel, ATTN_TYPES, dict(LLAMA3, GROUP_PAD=16, BLOCK_N=64, SPLIT=False, **dot)),
        "decode-split": (_decode_kernel, ATTN_TYPES, dict(LLAMA3, GROUP_PAD=16, BLOCK_N=64, SPLIT=True, **dot)),
        "merge": (_merge_kernel, dict(part_acc_ptr="*fp32", part_ml_ptr="*fp32", out_ptr=BF16),
                  dict(NUM_Q_HEADS=32, HEAD_DIM=128, HEAD_PAD=128, SPLITS_PAD=64)),
        "prefill": (_prefill_kernel, ATTN_TYPES, dict(LLAMA3, BLOCK_M=pf.block_m, BLOCK_N=pf.block_n,
                                                       SPLIT_MASK=pf.split_mask, **dot),
                    dict(num_warps=pf.num_warps, num_stages=pf.num_stages)),
        "write_kv": (_write_kv_kernel, dict(key_ptr=BF16, value_ptr=BF16, k_cache_ptr=BF16, v_cache_ptr=BF16,
                                            slot_ptr="*i64"), dict(BLOCK_SIZE=16, ROW=1024, ROW_PAD=1024)),
    }


def compile_sm90(kernel, types: dict[str, str], consts: dict, num_warps: int = 4, num_stages: int = 3):
    """Ahead-of-time compile one @triton.jit kernel for sm_90. Returns Triton's CompiledKernel (asm: ptx, cubin)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    # the launch hints ints divisible by 16, except those the kernel asks Triton not to specialize on
    unspecialized = {names[i] if isinstance(i, int) else i for i in getattr(kernel, "do_not_specialize", ())}
    hinted = [n for n in names if (signature[n] == "i32" and n not in unspecialized) or signature[n].startswith("*")]
    src = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in hinted})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def report() -> list[dict]:
    """One row per kernel: registers, stack bytes (spills), shared bytes, SASS counts of MMA and wide loads.

    Raises:
        RuntimeError: under TRITON_INTERPRET=1 (kernels are then interpreter objects and cannot be compiled).
        subprocess.CalledProcessError: cuobjdump failed.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET to compile the kernels")
    import triton.backends.nvidia as nv

    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (kernel, types, consts, *options) in _cases().items():
            compiled = compile_sm90(kernel, types, consts, **(options[0] if options else {}))
            cubin = os.path.join(tmp, name + ".cubin")
            with open(cubin, "wb") as f:
                f.write(compiled.asm["cubin"])
            usage = subprocess.run([tool, "--dump-resource-usage", cubin], capture_output=True, text=True,
                                   check=True).stdout
            sass = subprocess.run([tool, "--dump-sass", cubin], capture_output=True, text=True, check=True).stdout
            fields = dict(f.split(":") for f in next(l for l in usage.splitlines() if "REG:" in l).split()
                          if ":" in f and f.split(":")[1].isdigit())
            rows.append(dict(kernel=name, registers=int(fields["REG"]), stack_bytes=int(fields["STACK"]),
                             shared_bytes=compiled.metadata.shared,
                             mma=sass.count("HGMMA") + sass.count("HMMA"), ldg128=sass.count("LDG.E.128"),
                             ldgsts=sass.count("LDGSTS"), local_loads=sass.count("LDL")))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    rows = report()
    print(f"{'kernel':<15}{'regs':>6}{'stack B':>9}{'shared B':>10}{'mma':>6}{'ldg128':>8}{'ldgsts':>8}{'LDL':>6}")
    for r in rows:
        print(f"{r['kernel']:<15}{r['registers']:>6}{r['stack_bytes']:>9}{r['shared_bytes']:>10}{r['mma']:>6}"
              f"{r['ldg128']:>8}{r['ldgsts']:>8}{r['local_loads']:>6}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
