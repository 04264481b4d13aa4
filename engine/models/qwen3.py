"""Qwen3: Llama plus per-head RMSNorm on q and k before RoPE (q_norm / k_norm), `attention_bias` on q, k, v and o
alike, and a head_dim of its own (not hidden_size / heads)."""
from __future__ import annotations

from typing import Any

from engine.models.config_checks import attention_bias, refuse_use_sliding_window
from engine.models.decoder import DecoderModel as Model  # noqa: F401  (the architecture's network)
from engine.models.interface import ArchFlags


def config_flags(hf_config: Any) -> ArchFlags:
    """Raises: ValueError for `use_sliding_window=True`."""
    refuse_use_sliding_window("qwen3", hf_config)
    bias = attention_bias(hf_config)
    return ArchFlags(qkv_bias=bias, o_bias=bias, qk_norm=True)
