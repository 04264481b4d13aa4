"""Qwen3-MoE: Qwen3's attention (q/k norm, `attention_bias` on q, k, v and o) with a routed mixture-of-experts MLP
(no shared expert) on the layers `decoder_sparse_step` and `mlp_only_layers` select, a dense MLP on the others.
With `use_sliding_window` every layer slides (HF Qwen3MoeModel reads neither `max_window_layers` nor
`layer_types`, unlike Qwen2 / Qwen3)."""
from __future__ import annotations

from typing import Any

from pdserve_server.engine.models.config_checks import attention_bias, uniform_windows
from pdserve_server.engine.models.decoder import DecoderModel as Model  # noqa: F401  (the architecture's network)
from pdserve_server.engine.models.interface import ArchFlags, MoEConfig


def config_flags(hf_config: Any) -> ArchFlags:
    """Sparse layers as HF Qwen3MoeDecoderLayer picks them: layer i is MoE iff i is not in `mlp_only_layers`,
    num_experts > 0 and (i + 1) % decoder_sparse_step == 0.

    Raises:
        ValueError: a sliding_window that is not an int >= 1 (with `use_sliding_window`).
    """
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
    # HF Qwen3MoeConfig.__post_init__ drops sliding_window unless use_sliding_window; a plain attribute object may not
    windows = uniform_windows("qwen3_moe", hf_config) if getattr(hf_config, "use_sliding_window", False) else None
    return ArchFlags(qkv_bias=bias, o_bias=bias, qk_norm=True, moe=moe, layer_windows=windows)
