"""Attention and KV-cache ops over the paged KV cache: Triton kernels beside pure-torch references.

Each op exists twice with one signature: `kernels.reference` (torch; defines the semantics, runs anywhere) and
`kernels.triton_*` (Triton; CUDA, or CPU under TRITON_INTERPRET=1 for tests). The model gets one `AttentionOps`
from `select_ops` and never imports either directly.

Layout shared by all ops (see `engine.kv_cache`):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], one layer's view (may be strided in dim 0)
    block_tables:     [num_seqs, max_blocks_per_seq] int32, physical block ids, padded with 0
    slot_mapping:     [num_tokens] int64, block_id * block_size + offset for each new token
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

# Names only: importing this package loads no torch, so the command line can list the choices cheaply.
BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class AttentionOps:
    """The three paged-KV ops of one backend (see `kernels.reference` for their contracts)."""

    name: str
    write_kv_cache: Callable[..., None]
    paged_decode_attention: Callable[..., torch.Tensor]
    prefill_attention: Callable[..., torch.Tensor]


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
        backend: "auto" (Triton on CUDA, torch elsewhere), "triton" or "torch".
        device: the device the KV cache lives on.

    Raises:
        ValueError: unknown backend, or "triton" where Triton cannot run (no CUDA and no TRITON_INTERPRET=1).
    """
    import torch

    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if torch.device(device).type == "cuda" and triton_usable(device) else "torch"
    if backend == "torch":
        from kernels import reference as ref
        return AttentionOps("torch", ref.write_kv_cache, ref.paged_decode_attention, ref.prefill_attention)
    if not triton_usable(device):
        raise ValueError(f"attention backend 'triton' needs a CUDA device or TRITON_INTERPRET=1 (device {device})")
    from kernels.triton_cache import write_kv_cache
    from kernels.triton_decode import paged_decode_attention
    from kernels.triton_prefill import prefill_attention
    return AttentionOps("triton", write_kv_cache, paged_decode_attention, prefill_attention)
