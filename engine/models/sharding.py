"""Which parameters are split across tensor-parallel ranks, and how: a rank's share of each full (checkpoint) tensor.

Our parameter names (`engine.models.decoder`), by suffix:

    column-parallel (output features split; each fused segment split on its own, so a rank's q, k, v stay aligned):
        self_attn.qkv_proj.{weight,bias}   segments q, k, v: num_heads, num_kv_heads, num_kv_heads heads
        mlp.gate_up_proj.weight            segments gate, up
        mlp.experts.gate_up_proj           [E, 2I, hidden]: segments gate, up along dim 1 (every rank has every expert)
    row-parallel (input features split; the layer's output is all-reduced):
        self_attn.o_proj.weight, mlp.down_proj.weight       dim 1
        mlp.experts.down_proj                                [E, hidden, I]: dim 2
        self_attn.o_proj.bias              rank 0 keeps it, the others hold zeros (added once by the all-reduce)
    vocab-parallel (rows split, the vocabulary padded to a multiple of the group size with zero rows):
        embed_tokens.weight, lm_head.weight
    everything else (norms, the MoE router) is replicated.

Splitting heads keeps each rank's attention self-contained (its own q heads with their kv heads), so the paged KV
cache splits the same way: a rank stores num_kv_heads / size heads of every block.
"""
from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.parallel import TensorParallel


def vocab_per_rank(vocab_size: int, size: int) -> int:
    """Rows of the vocab-parallel embedding and LM head each rank holds: ceil(vocab_size / size)."""
    return -(-vocab_size // size)


def _segments(full: torch.Tensor, sizes: list[int], dim: int, tp: TensorParallel) -> torch.Tensor:
    """Split `full` along `dim` into consecutive segments of `sizes`, keep part `tp.rank` of each, concatenated."""
    parts = torch.split(full, sizes, dim=dim)
    return torch.cat([p.chunk(tp.size, dim=dim)[tp.rank] for p in parts], dim=dim)


def shard(name: str, full: torch.Tensor, cfg: ModelConfig, tp: TensorParallel) -> torch.Tensor:
    """This rank's share of parameter `name` (our name) given its full tensor; `full` itself when size is 1 or the
    parameter is replicated. The caller checks the result's shape against the module's.

    Raises:
        ValueError: a split dimension is not divisible by the group size (`TensorParallel.split` names it).
    """
    if tp.size == 1:
        return full
    if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
        tp.split(cfg.num_heads, "num_attention_heads")
        tp.split(cfg.num_kv_heads, "num_key_value_heads")
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return _segments(full, [q, kv, kv], 0, tp)
    if name.endswith("o_proj.bias"):
        return full if tp.rank == 0 else torch.zeros_like(full)
    if name.endswith("experts.gate_up_proj"):
        inter = full.shape[1] // 2
        tp.split(inter, "moe_intermediate_size")
        return _segments(full, [inter, inter], 1, tp)
    if name.endswith("experts.down_proj"):
        tp.split(full.shape[2], "moe_intermediate_size")
        return full.chunk(tp.size, dim=2)[tp.rank]
    if name.endswith("gate_up_proj.weight"):
        inter = full.shape[0] // 2
        tp.split(inter, "intermediate_size")
        return _segments(full, [inter, inter], 0, tp)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        tp.split(full.shape[1], "the row-parallel input features")
        return full.chunk(tp.size, dim=1)[tp.rank]
    if name in ("embed_tokens.weight", "lm_head.weight"):
        rows = vocab_per_rank(full.shape[0], tp.size)
        part = full[tp.rank * rows:(tp.rank + 1) * rows]
        if part.shape[0] < rows:  # the last rank's padding rows: never looked up, their logits are cut off
            part = torch.cat([part, part.new_zeros(rows - part.shape[0], full.shape[1])])
        return part
    return full
