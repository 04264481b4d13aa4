"""Qwen3: Llama plus per-head RMSNorm on q and k before RoPE (q_norm / k_norm), `attention_bias` on q, k, v and o
alike, a head_dim of its own (not hidden_size / heads) and Qwen2's optional sliding window."""
from __future__ import annotations

from typing import Any

from pdserve_server.engine.models.config_checks import attention_bias, qwen_layer_windows
from pdserve_server.engine.models.decoder import DecoderModel as Model  # noqa: F401  (the architecture's network)
from pdserve_server.engine.models.interface import ArchFlags


def config_flags(hf_config: Any) -> ArchFlags:
    """Raises: ValueError for `layer_types` naming another attention type, or a bad window
    (`config_checks.qwen_layer_windows`)."""
    bias = attention_bias(hf_config)
    return ArchFlags(qkv_bias=bias, o_bias=bias, qk_norm=True, layer_windows=qwen_layer_windows("qwen3", hf_config))
