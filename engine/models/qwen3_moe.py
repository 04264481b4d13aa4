"""Qwen3-MoE: Qwen3's attention (q/k norm, `attention_bias` on q, k, v and o) with a routed mixture-of-experts MLP
(no shared expert) on the layers `decoder_sparse_step` and `mlp_only_layers` select, a dense MLP on the others."""
from __future__ import annotations

from typing import Any

from engine.models.config_checks import attention_bias, refuse_use_sliding_window
from engine.models.decoder import DecoderModel as Model  # noqa: F401  (the architecture's network)
from engine.models.interface import ArchFlags, MoEConfig


def config_flags(hf_config: Any) -> ArchFlags:
    """Sparse layers as HF Qwen3MoeDecoderLayer picks them: layer i is MoE iff i is not in `mlp_only_layers`,
    num_experts > 0 and (i + 1) % decoder_sparse_step == 0.

    Raises:
        ValueError: `use_sliding_window=True`.
    """
    refuse_use_sliding_window("qwen3_moe", hf_config)
    bias = attention_bias(hf_config)
    num_experts = int(getattr(hf_config, "num_experts", 0) or 0)
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    sparse = tuple(i for i in range(hf_config.num_hidden_layers)
                   if num_experts > 0 and i not in dense and (i + 1) % step == 0)
    moe = MoEConfig(num_experts=num_experts, top_k=int(hf_config.num_experts_per_tok),
                    intermediate_size=int(hf_config.moe_intermediate_size),
                    norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
                    sparse_layers=sparse) if sparse else None
    return ArchFlags(qkv_bias=bias, o_bias=bias, qk_norm=True, moe=moe)
