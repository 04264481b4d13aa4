"""Attention and KV-cache ops over the paged KV cache, and a decoder layer's small per-token ops: Triton kernels
and C beside pure-torch references; this module picks one backend's set (`select_ops`). The folder has no
__init__.py on purpose (setup.py, NAMESPACE_PACKAGES: it must never shadow Hugging Face's `kernels`).

Each op has one signature and up to three implementations: `kernels.reference` (torch; defines the semantics, runs
anywhere), `kernels.triton_*` (Triton; CUDA, or CPU under TRITON_INTERPRET=1 for tests) and, for CPU workers,
`kernels.cpu_ops` (decode attention, the KV write and the per-token ops in C, compiled when pdserve is installed:
setup.py; bf16 prefill attention too where the CPU has AVX512_BF16) with `kernels.cpu_prefill` (prefill attention as
blocked GEMMs otherwise). The model gets one
`AttentionOps` from `select_ops` and never imports any of them directly.

Layout shared by all ops (see `engine.execution.kv_cache`):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], one layer's view (may be strided in dim 0)
    block_tables:     [num_seqs, max_blocks_per_seq] int32, physical block ids, padded with 0
    slot_mapping:     [num_tokens] int64, block_id * block_size + offset for each new token

Both attention ops take `sliding_window` (an int per call, so per layer: Gemma alternates local and global layers;
0 or None: full causal attention): with W >= 1 the query at position q sees keys k <= q with q - k < W, HF
transformers' sliding-window mask (`kernels.reference`). Every backend starts reading K/V at the window.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

# Names only: importing this package loads no torch, so the command line can list the choices cheaply.
BACKENDS = ("auto", "torch", "triton", "cpu")


@dataclass(frozen=True)
class AttentionOps:
    """The three paged-KV ops of one backend (RoPE with the KV write, decode and prefill attention) and the
    per-token ops its layers call around them (see
    `kernels.reference` for their contracts), and whether its decode path can be captured in a CUDA graph
    (`engine.execution.cuda_graphs`)."""

    name: str
    rotary_and_write_kv: Callable[..., torch.Tensor]
    paged_decode_attention: Callable[..., torch.Tensor]
    prefill_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]
    silu_and_mul: Callable[..., torch.Tensor]
    # No host sync or host-side data dependence in the decode path, so a CUDA graph can capture it (the torch
    # reference reads context_lens.max() on the host).
    capturable: bool = False
    # fp32 y = x W^T (+ b) for the few rows of a decode step, (x [M, K], weight [N, K], bias [N] | None) -> [M, N]
    # (the cpu backend's `kernels/cpu_linear.c`; `engine.execution.packing.SmallBatchLinear` decides when), or None.
    small_batch_linear: Callable[..., torch.Tensor] | None = None
    # Every decoder layer of an all-decode step in one call (the cpu backend's `pdserve::decode_layers`;
    # `engine.execution.cpu_decode_stack` calls it), or None.
    decode_layers: Callable[..., torch.Tensor] | None = None
    # bf16 y = x W^T (+ b) for a decode step's rows over a weight in oneDNN's packed layout, (x [M, K], weight_ptr,
    # N, padded_k, bias [N] | None) -> [M, N] (the cpu backend's `kernels/cpu_linear.c`; `engine.execution.packing.
    # PackedLinear` checks the layout and decides when), and the all-decode step over such weights or fp32 ones in
    # one OpenMP region (`pdserve::decode_layers_fused`), or None.
    packed_bf16_linear: Callable[..., torch.Tensor] | None = None
    decode_layers_fused: Callable[..., torch.Tensor] | None = None
    # fp32 y = x W^T (+ b) for a decode step's rows with W held as GGUF blocks, (x [M, K], qs, scales, bias [N] |
    # None) -> [M, N] (the cpu backend's `kernels/cpu_linear.c`; `engine.execution.packing.gguf_blocks` finds the
    # blocks of a dequantized Q4_1 or Q8_0 weight), or None.
    blocks_linear: Callable[..., torch.Tensor] | None = None
    # blocks_linear also computes prefill rows faster than torch's fp32 GEMM (the AVX2 build's panels,
    # `kernels/cpu_linear.c`), so `SmallBatchLinear` sends it every row count, not only a decode step's.
    blocks_prefill: bool = False
    # fp32 y = x W^T (+ b) through 8-bit integer products, (x [M, K], wq packed [ceil(N / 16), K / 4, 64] uint8,
    # w_scale [N], bias [N] | None) -> [M, N] (the cpu backend's `kernels/cpu_int8_gemm.c`;
    # `engine.execution.packing.use_w8a8`), or None.
    int8_linear: Callable[..., torch.Tensor] | None = None


def triton_usable(device: torch.device | str) -> bool:
    """True when Triton kernels can run on `device`: a CUDA device, or any device under TRITON_INTERPRET=1."""
    import torch

    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def select_ops(backend: str, device: torch.device | str) -> AttentionOps:
    """Pick the attention ops for a worker.

    Args:
        backend: "auto" (Triton on CUDA, the compiled C kernels on CPU), "triton", "cpu" or "torch" (the
            reference, on any device).
        device: the device the KV cache lives on.

    Raises:
        ValueError: unknown backend; "triton" where Triton cannot run (no CUDA and no TRITON_INTERPRET=1); "cpu"
            on another device; "cpu", or "auto" on CPU, when the compiled kernels (`kernels/_C`) are missing or do
            not load: a worker fails at start rather than serve several times slower on the reference without
            saying so (the message says how to reinstall, or to choose --attention-backend torch).
    """
    import torch

    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    device_type = torch.device(device).type
    if backend == "auto":
        backend = ("cpu" if device_type == "cpu" else
                   "triton" if device_type == "cuda" and triton_usable(device) else "torch")
    if backend == "cpu":
        from pdserve_server.kernels.cpu_ops import KernelLoadError
        if device_type != "cpu":
            raise ValueError(f"attention backend 'cpu' runs on CPU only (device {device})")
        try:
            return _cpu_ops()
        except KernelLoadError as e:
            raise ValueError(f"attention backend 'cpu': {e}") from e
    if backend == "torch":
        from pdserve_server.kernels import reference as ref
        return AttentionOps("torch", ref.rotary_and_write_kv, ref.paged_decode_attention, ref.prefill_attention,
                            ref.rms_norm, ref.silu_and_mul)
    if not triton_usable(device):
        raise ValueError(f"attention backend 'triton' needs a CUDA device or TRITON_INTERPRET=1 (device {device})")
    from pdserve_server.kernels import reference as ref
    from pdserve_server.kernels.triton_cache import write_kv_cache
    from pdserve_server.kernels.triton_decode import paged_decode_attention
    from pdserve_server.kernels.triton_prefill import prefill_attention
    return AttentionOps("triton", functools.partial(ref.rotary_and_write_kv, write_kv=write_kv_cache),
                        paged_decode_attention, prefill_attention, ref.rms_norm, ref.silu_and_mul, capturable=True)


def _cpu_ops() -> AttentionOps:
    """The "cpu" backend: the C decode kernel, KV write, per-token ops and small-batch fp32 linear
    (`kernels.cpu_ops`), and prefill attention: in C for fp32 caches and for bf16 ones on a CPU with AVX512_BF16
    (`kernels/cpu_prefill_attention.c`), else as blocked GEMMs (`kernels.cpu_prefill`, its softmax in C); a sliding
    window takes the blocked GEMMs (16-bit) or the reference (fp32).

    Raises:
        KernelLoadError: the compiled kernels are missing or do not load.
    """
    from pdserve_server.kernels.cpu_ops import CpuKernels, cpu_isa

    c = CpuKernels.load()
    return AttentionOps("cpu", c.rotary_and_write_kv, c.paged_decode_attention, c.prefill_attention, c.rms_norm,
                        c.silu_and_mul, small_batch_linear=c.linear_small_m, decode_layers=c.decode_layers,
                        packed_bf16_linear=c.linear_packed_bf16, decode_layers_fused=c.decode_layers_fused,
                        blocks_linear=c.linear_blocks, blocks_prefill=cpu_isa() == "avx2", int8_linear=c.linear_w8a8)
