"""The engine's resolved configuration: model architecture, KV cache geometry and step limits. Built once per
process by `engine.builder` from `engine.args.EngineArgs` (where every default lives); never mutated afterwards."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pdserve_server.engine.args import DTYPE_NAMES
from pdserve_server.engine.models.interface import Llama3RopeScaling, MoEConfig
from pdserve_server.engine.models.registry import arch_flags
from pdserve_server.engine.parallel import kv_heads_per_rank
from pdserve_server.engine.speculative import SpeculativeConfig

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder served by `engine.models` (the registry lists the model types), read from an HF
    `config.json`.

    Attributes are in the field's usual units: sizes in elements, `rope_theta` the RoPE base; `head_dim` is the
    config's own when it has one (Qwen3's differs from hidden_size / num_heads); `architecture` is the HF
    `model_type` (it picks the module, `engine.models.registry.architecture`). The rest are
    `engine.models.interface.ArchFlags`, set per `model_type` and config: `qkv_bias` / `o_bias` (the fused q/k/v
    projection / o_proj carry a bias), `qk_norm` (per-head RMSNorm on q and k before RoPE), `rope_llama3`
    (Llama-3 RoPE frequency scaling, None for plain RoPE), `moe` (the routed experts of an MoE model),
    `layer_windows` (each layer's sliding window, 0 = full attention; None: no layer slides), and Gemma 3's
    `attention_scale`, `final_logit_softcapping`, `rope_local_theta` and `rope_linear_factor` (see ArchFlags).
    """

    name: str
    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    dtype: str = "float32"
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    rope_llama3: Llama3RopeScaling | None = None
    moe: MoEConfig | None = None
    layer_windows: tuple[int, ...] | None = None
    attention_scale: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None
    rope_linear_factor: float | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def from_hf(cls, hf_config: Any, name: str, path: str, dtype: str = "float32") -> "ModelConfig":
        """Build from a `transformers.PretrainedConfig` of a registered model type (`engine.models.registry`).

        Raises:
            ValueError: the model_type, a feature it asks for (the field is named) or its RoPE type (named) is not
                supported, or dtype is unknown.
        """
        flags = arch_flags(hf_config)  # refuses what the decoder cannot serve, RoPE types included
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        eos = hf_config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        num_heads = hf_config.num_attention_heads
        rope_theta = getattr(hf_config, "rope_theta", None)
        if flags.rope_theta is not None:  # read by the module (per-layer-type rope_parameters)
            rope_theta = flags.rope_theta
        elif rope_theta is None:  # transformers >= 5 keeps it in rope_parameters
            rope_theta = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return cls(
            name=name,
            path=path,
            architecture=hf_config.model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=float(rope_theta),
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            dtype=dtype,
            qkv_bias=flags.qkv_bias,
            o_bias=flags.o_bias,
            qk_norm=flags.qk_norm,
            rope_llama3=flags.rope_llama3,
            moe=flags.moe,
            layer_windows=flags.layer_windows,
            attention_scale=flags.attention_scale,
            final_logit_softcapping=flags.final_logit_softcapping,
            rope_local_theta=flags.rope_local_theta,
            rope_linear_factor=flags.rope_linear_factor,
        )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry.

    Attributes:
        block_size: tokens per KV block.
        num_blocks: blocks in the pool (the KV budget). Derive it with `num_blocks_for_budget`.
        tensor_parallel_size: ranks the KV heads of every block are split across (`engine.kv_cache` layout).
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
            take at most this long, ms (`engine.step_cost`; at least a block of prefill a step); 0 = no cap beyond
            max_num_batched_tokens.
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

    The layout tag names the KV layout in `engine.kv_cache` (a shard per rank, [num_blocks, layers, 2, block_size,
    kv_heads_per_rank, head_dim], block-major; a block travels as each rank's region); change it whenever that
    layout changes. Two workers of different tensor parallel sizes hash differently: a block's bytes are split by
    rank (no resharding on transfer).
    """
    fields = asdict(model)
    fields.pop("path")
    fields["block_size"] = cache.block_size
    fields["tensor_parallel_size"] = cache.tensor_parallel_size
    fields["layout"] = "block-major-shards-v3"
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
