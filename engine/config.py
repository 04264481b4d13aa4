"""The engine's resolved configuration: KV cache geometry and step limits (the model's architecture is
`engine.models.config.ModelConfig`). Built once per process by `engine.builder` from `engine.args.EngineArgs` (where
every default lives); never mutated afterwards."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
import torch

from pdserve_server.engine.models.config import ModelConfig
from pdserve_server.engine.parallel.tensor_parallel import kv_heads_per_rank
from pdserve_server.engine.speculative import SpeculativeConfig


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry.

    Attributes:
        block_size: tokens per KV block.
        num_blocks: blocks in the pool (the KV budget). Derive it with `num_blocks_for_budget`.
        tensor_parallel_size: ranks the KV heads of every block are split across (`engine.execution.kv_cache` layout).
    """

    block_size: int
    num_blocks: int
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.num_blocks <= 0 or self.tensor_parallel_size <= 0:
            raise ValueError(f"block_size, num_blocks and tensor_parallel_size must be positive, got {self}")


def kv_bytes_per_block(model: ModelConfig, block_size: int, tensor_parallel_size: int = 1) -> int:
    """Bytes one KV block takes across all layers and ranks: layers x {K,V} x block_size x kv heads stored x
    head_dim x itemsize, where the kv heads stored are tp x `kv_heads_per_rank` (num_kv_heads, more when tensor
    parallelism pads or replicates them)."""
    itemsize = torch.empty((), dtype=model.torch_dtype).element_size()
    tp = tensor_parallel_size
    heads = tp * kv_heads_per_rank(model.num_kv_heads, tp)
    return model.num_layers * 2 * block_size * heads * model.head_dim * itemsize


def num_blocks_for_budget(model: ModelConfig, block_size: int, kv_bytes: int | None, kv_tokens: int | None,
                          tensor_parallel_size: int = 1) -> int:
    """Number of KV blocks for a budget given in bytes or in tokens (exactly one of them), with the KV layout of
    `tensor_parallel_size` ranks.

    Raises:
        ValueError: neither or both budgets given, or the budget holds less than one block.
    """
    if (kv_bytes is None) == (kv_tokens is None):
        raise ValueError("give exactly one of kv_bytes / kv_tokens")
    n = (kv_bytes // kv_bytes_per_block(model, block_size, tensor_parallel_size) if kv_bytes is not None
         else kv_tokens // block_size)
    if n < 1:
        raise ValueError(f"KV budget too small for one block of {block_size} tokens")
    return int(n)


@dataclass(frozen=True)
class SchedulerConfig:
    """Step scheduling limits.

    Attributes:
        max_num_batched_tokens: token budget per step (prefill chunks + one token per decode).
        max_num_seqs: most requests in the running batch.
        max_model_len: most tokens (prompt + output) one request may hold.
        enable_prefix_caching: reuse full KV blocks whose chained token hash matches.
        vocab_size: token ids a request may carry are [0, vocab_size).
        speculative: n-gram speculative decoding (off by default).
        itl_target_ms: while requests are decoding, cap each step's prefill tokens so the step is predicted to
            take at most this long, ms (`engine.scheduling.step_cost`; at least a block of prefill a step); 0 = no cap
            beyond max_num_batched_tokens.
    """

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_prefix_caching: bool
    vocab_size: int
    speculative: SpeculativeConfig = SpeculativeConfig()
    itl_target_ms: float = 0.0


def compat_hash(model: ModelConfig, cache: CacheConfig) -> str:
    """Hash that two workers must share to exchange KV blocks: model shapes, dtype, block size and layout.

    The layout tag names the KV layout in `engine.execution.kv_cache` (a shard per rank, [num_blocks, layers, 2,
    block_size, kv_heads_per_rank, head_dim], block-major; a block travels as each rank's region); change it whenever
    that layout changes. Two workers of different tensor parallel sizes hash differently: a block's bytes are split by
    rank (no resharding on transfer).
    """
    fields = asdict(model)
    fields.pop("path")
    fields["block_size"] = cache.block_size
    fields["tensor_parallel_size"] = cache.tensor_parallel_size
    fields["layout"] = "block-major-shards-v3"
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
