"""Llama (1, 2, 3.x): the shared decoder with no switches but `attention_bias` (HF: one switch for q, k, v and o)
and Llama-3 RoPE scaling (read by the registry's shared RoPE check)."""
from __future__ import annotations

from typing import Any

from pdserve_server.engine.models.config_checks import attention_bias
from pdserve_server.engine.models.decoder import DecoderModel as Model  # noqa: F401  (the architecture's network)
from pdserve_server.engine.models.interface import ArchFlags


def config_flags(hf_config: Any) -> ArchFlags:
    """Raises: ValueError for `mlp_bias=True` (HF Llama's bias on gate/up/down; the MLP here has none)."""
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("llama: mlp_bias=True is not supported (gate/up/down projections have no bias here)")
    bias = attention_bias(hf_config)
    return ArchFlags(qkv_bias=bias, o_bias=bias)
