"""Which parameters are split across tensor-parallel ranks, and how: a rank's share of each full (checkpoint) tensor.

Our parameter names (`engine.models.decoder`), by suffix:

    by attention head (`engine.parallel.tensor_parallel.head_split`: a rank's query heads with their kv heads, padding
    heads zero):
        self_attn.qkv_proj.{weight,bias}   rows: the rank's q heads, then its k heads, then its v heads
        self_attn.o_proj.weight            columns: the rank's q heads (row-parallel: the output is all-reduced)
    column-parallel (output features split; each fused segment split on its own):
        mlp.gate_up_proj.weight            segments gate, up
        mlp.experts.gate_up_proj           [E, 2I, hidden]: segments gate, up along dim 1 (every rank has every expert)
    row-parallel (input features split; the layer's output is all-reduced):
        mlp.down_proj.weight                                 dim 1
        mlp.experts.down_proj                                [E, hidden, I]: dim 2
        self_attn.o_proj.bias              rank 0 keeps it, the others hold zeros (added once by the all-reduce)
    vocab-parallel (rows split, the vocabulary padded to a multiple of the group size with zero rows):
        embed_tokens.weight, lm_head.weight
    everything else (norms, the MoE router) is replicated.

Splitting heads keeps each rank's attention self-contained (its own q heads with their kv heads), so the paged KV
cache splits the same way: a rank stores its kv heads of every block, ceil(num_kv_heads / size) of them
(`engine.parallel.tensor_parallel.kv_heads_per_rank`).
"""
from __future__ import annotations

import torch

from pdserve_server.engine.models.config import ModelConfig
from pdserve_server.engine.parallel.tensor_parallel import TensorParallel


def vocab_per_rank(vocab_size: int, size: int) -> int:
    """Rows of the vocab-parallel embedding and LM head each rank holds: ceil(vocab_size / size)."""
    return -(-vocab_size // size)


def _segments(full: torch.Tensor, sizes: list[int], dim: int, tp: TensorParallel) -> torch.Tensor:
    """Split `full` along `dim` into consecutive segments of `sizes`, keep part `tp.rank` of each, concatenated."""
    parts = torch.split(full, sizes, dim=dim)
    return torch.cat([p.chunk(tp.size, dim=dim)[tp.rank] for p in parts], dim=dim)


def vocab_parallel_embed(embedding: torch.nn.Embedding, input_ids: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Look `input_ids` ([T] int64, the full vocabulary's ids) up in this rank's slice of a vocab-parallel embedding
    (rows rank * n .. (rank + 1) * n - 1 of the full table, n = `embedding`'s rows): ids outside the slice give zero
    rows, and the all-reduce sums the one non-zero row per token. Returns [T, hidden] in the embedding's dtype."""
    if tp.size == 1:
        return embedding(input_ids)
    rows = embedding.num_embeddings
    local = input_ids - tp.rank * rows
    outside = (local < 0) | (local >= rows)
    h = embedding(local.masked_fill(outside, 0))
    return tp.all_reduce(h.masked_fill_(outside.unsqueeze(1), 0))


def vocab_parallel_logits(lm_head: torch.nn.Linear, hidden: torch.Tensor, vocab_size: int,
                          tp: TensorParallel) -> torch.Tensor:
    """hidden [N, hidden] -> logits [N, vocab_size] in the head's dtype: each rank's slice of a vocab-parallel LM
    head, all-gathered, the padding columns cut off. Every rank must call it (a collective)."""
    logits = lm_head(hidden)
    if tp.size == 1:
        return logits
    return tp.all_gather_last(logits)[:, :vocab_size]


def _heads(part: torch.Tensor, heads: tuple[int | None, ...], head_dim: int, dim: int) -> torch.Tensor:
    """The slices [h * head_dim, (h + 1) * head_dim) of `part` along `dim` for each head h, concatenated in order;
    zeros for a padding head (None)."""
    zero = torch.zeros_like(part.narrow(dim, 0, head_dim))
    return torch.cat([zero if h is None else part.narrow(dim, h * head_dim, head_dim) for h in heads], dim=dim)


def shard(name: str, full: torch.Tensor, cfg: ModelConfig, tp: TensorParallel) -> torch.Tensor:
    """This rank's share of parameter `name` (our name) given its full tensor; `full` itself when size is 1 or the
    parameter is replicated. The caller checks the result's shape against the module's.

    Raises:
        ValueError: a split dimension is not divisible by the group size, or the heads do not split
            (`TensorParallel.split` and `engine.parallel.tensor_parallel.head_split` name the quantity).
    """
    if tp.size == 1:
        return full
    if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
        heads, hd = tp.heads(cfg.num_heads, cfg.num_kv_heads), cfg.head_dim
        q, k, v = torch.split(full, [cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd])
        return torch.cat([_heads(q, heads.q_heads, hd, 0), _heads(k, heads.kv_heads, hd, 0),
                          _heads(v, heads.kv_heads, hd, 0)])
    if name.endswith("o_proj.weight"):
        return _heads(full, tp.heads(cfg.num_heads, cfg.num_kv_heads).q_heads, cfg.head_dim, 1)
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
    if name.endswith("down_proj.weight"):
        tp.split(full.shape[1], "the row-parallel input features")
        return full.chunk(tp.size, dim=1)[tp.rank]
    if name in ("embed_tokens.weight", "lm_head.weight"):
        rows = vocab_per_rank(full.shape[0], tp.size)
        part = full[tp.rank * rows:(tp.rank + 1) * rows]
        if part.shape[0] < rows:  # the last rank's padding rows: never looked up, their logits are cut off
            part = torch.cat([part, part.new_zeros(rows - part.shape[0], full.shape[1])])
        return part
    return full
