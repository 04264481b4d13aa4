"""The engine's resolved configuration: KV cache geometry and step limits (the model's architecture is
`engine.models.config.ModelConfig`). Built once per process by `engine.builder` from `engine.args.EngineArgs` (where
every default lives); never mutated afterwards."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
import torch

from pdserve_server.engine.models.config import DTYPES, ModelConfig
from pdserve_server.engine.parallel.tensor_parallel import kv_heads_per_rank
from pdserve_server.engine.speculative import SpeculativeConfig


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry.

    Attributes:
        block_size: tokens per KV block.
        num_blocks: blocks in the pool (the KV budget). Derive it with `num_blocks_for_budget`.
        tensor_parallel_size: ranks the KV heads of every block are split across (`engine.execution.kv_cache` layout).
        cache_dtype: the cache's dtype name (`engine.models.config.DTYPES`), None: the model's
            (`resolve_cache_dtype`).
    """

    block_size: int
    num_blocks: int
    tensor_parallel_size: int = 1
    cache_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.num_blocks <= 0 or self.tensor_parallel_size <= 0:
            raise ValueError(f"block_size, num_blocks and tensor_parallel_size must be positive, got {self}")
        if self.cache_dtype is not None and self.cache_dtype not in DTYPES:
            raise ValueError(f"cache_dtype must be one of {sorted(DTYPES)} or None, got {self.cache_dtype!r}")

    def dtype_name(self, model: ModelConfig) -> str:
        """The KV cache's dtype name for `model`: cache_dtype, or the model's own."""
        return self.cache_dtype or model.dtype

    def torch_dtype(self, model: ModelConfig) -> torch.dtype:
        """`dtype_name` as a torch dtype."""
        return DTYPES[self.dtype_name(model)]


def resolve_cache_dtype(name: str, model_dtype: str, device: str, attention_backend: str = "auto") -> str | None:
    """`--kv-cache-dtype` as `CacheConfig.cache_dtype`: "auto" or the model's dtype is None (the model's); bfloat16
    under a float32 model on a CPU (the cpu or torch attention backend) is a bf16 cache that the kernels write by
    rounding to nearest even and read widened exactly (`kernels/cpu_decode.c`, `cpu_prefill_attention.c`,
    `cpu_layer_ops.c`; `kernels.reference`), all arithmetic in fp32: the decode attention reads half the bytes (vLLM's
    `--kv-cache-dtype`; llama.cpp's cache is 16-bit by default).

    Raises:
        ValueError: any other pairing (a narrower model over a wider cache, float16, a GPU or the Triton backend,
            whose kernels read the cache in the model's dtype), saying what to pass instead.
    """
    if name in ("auto", model_dtype):
        return None
    if (name == "bfloat16" and model_dtype == "float32" and torch.device(device).type == "cpu"
            and attention_backend in ("auto", "cpu", "torch")):
        return name
    raise ValueError(f"--kv-cache-dtype {name} with --dtype {model_dtype} on {device} (attention backend "
                     f"{attention_backend}) is not supported: the KV cache takes the model's dtype (auto), or "
                     "bfloat16 under a float32 model on a CPU with the cpu or torch attention backend")


def kv_bytes_per_block(model: ModelConfig, block_size: int, tensor_parallel_size: int = 1,
                       cache_dtype: str | None = None) -> int:
    """Bytes one KV block takes across all layers and ranks: layers x {K,V} x block_size x kv heads stored x
    head_dim x itemsize (of `cache_dtype`, None: the model's dtype), where the kv heads stored are tp x
    `kv_heads_per_rank` (num_kv_heads, more when tensor parallelism pads or replicates them)."""
    itemsize = torch.empty((), dtype=DTYPES[cache_dtype or model.dtype]).element_size()
    tp = tensor_parallel_size
    heads = tp * kv_heads_per_rank(model.num_kv_heads, tp)
    return model.num_layers * 2 * block_size * heads * model.head_dim * itemsize


# The default KV budget (`auto_kv_tokens`): the share of the memory free at start a pool takes, per device type.
AUTO_KV_MEMORY_FRACTION = {"cpu": 0.1, "cuda": 0.5}
AUTO_KV_MIN_TOKENS = 16384  # the fixed default before the budget was sized from memory


def auto_kv_tokens(bytes_per_token: int, free_bytes: int | None, fraction: float, max_num_seqs: int,
                   max_model_len: int) -> int:
    """The KV budget, tokens, when neither --kv-tokens nor --kv-bytes is given: room for max_num_seqs requests of
    max_model_len tokens (more never widens the running batch), within `fraction` of `free_bytes` (the memory free
    on the device at start, `engine.hardware.free_memory_bytes`; None: unknown), and never under the smaller of
    that room and AUTO_KV_MIN_TOKENS. As vLLM sizes its pool from memory (`--gpu-memory-utilization`;
    VLLM_CPU_KVCACHE_SPACE on CPU) instead of a fixed count.

    Why: a fixed 16,384 tokens held only 14 of 16 requests of 1,128 tokens; at 16 concurrent 1,000-token prompts
    the last two were preempted and recomputed: 37.6 s against 29.7 s with room for all (SmolLM2-135M fp32, Ice
    Lake Xeon, 2 cores, offline engine; docs/benchmarks.md).

    Args:
        bytes_per_token: KV bytes one token takes across all layers and ranks (`kv_bytes_per_block` / block_size).
    """
    need = max_num_seqs * max_model_len
    floor = min(need, AUTO_KV_MIN_TOKENS)
    if free_bytes is None:
        return floor
    return max(floor, min(need, int(free_bytes * fraction) // max(bytes_per_token, 1)))


def num_blocks_for_budget(model: ModelConfig, block_size: int, kv_bytes: int | None, kv_tokens: int | None,
                          tensor_parallel_size: int = 1, cache_dtype: str | None = None) -> int:
    """Number of KV blocks for a budget given in bytes or in tokens (exactly one of them), with the KV layout of
    `tensor_parallel_size` ranks in `cache_dtype` (None: the model's dtype).

    Raises:
        ValueError: neither or both budgets given, or the budget holds less than one block.
    """
    if (kv_bytes is None) == (kv_tokens is None):
        raise ValueError("give exactly one of kv_bytes / kv_tokens")
    n = (kv_bytes // kv_bytes_per_block(model, block_size, tensor_parallel_size, cache_dtype) if kv_bytes is not None
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
        burst_prefill_tokens: when the requests with prompt tokens still to compute (waiting ones and unfinished
            chunks) are at least as many as the decoding ones, a step takes up to this many prompt tokens beside the
            decodes (`Scheduler._step_tokens`); 0 or at most max_num_batched_tokens = off.
    """

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_prefix_caching: bool
    vocab_size: int
    speculative: SpeculativeConfig = SpeculativeConfig()
    itl_target_ms: float = 0.0
    burst_prefill_tokens: int = 0

    @property
    def bursts(self) -> bool:
        """Whether a burst of arrivals may take a step past max_num_batched_tokens (`Scheduler._step_tokens`)."""
        return self.burst_prefill_tokens > self.max_num_batched_tokens

    @property
    def max_step_tokens(self) -> int:
        """The most tokens one step may schedule: a burst step's (burst_prefill_tokens plus a token for each of
        max_num_seqs running requests, `Scheduler._step_tokens`) where bursts are on, else max_num_batched_tokens."""
        if self.bursts:
            return self.burst_prefill_tokens + self.max_num_seqs
        return self.max_num_batched_tokens


def compat_hash(model: ModelConfig, cache: CacheConfig) -> str:
    """Hash that two workers must share to exchange KV blocks: model shapes, dtype, the cache's dtype, block size and
    layout.

    The layout tag names the KV layout in `engine.execution.kv_cache` (a shard per rank, [num_blocks, layers, 2,
    block_size, kv_heads_per_rank, head_dim], block-major; a block travels as each rank's region); change it whenever
    that layout changes. Two workers of different tensor parallel sizes hash differently: a block's bytes are split by
    rank (no resharding on transfer).
    """
    fields = asdict(model)
    fields.pop("path")
    fields["block_size"] = cache.block_size
    fields["tensor_parallel_size"] = cache.tensor_parallel_size
    fields["cache_dtype"] = cache.dtype_name(model)
    fields["layout"] = "block-major-shards-v3"
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
