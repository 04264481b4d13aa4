"""Qwen2: Llama plus a bias on the q/k/v projections (HF Qwen2Attention; none on o_proj)."""
from __future__ import annotations

from typing import Any

from engine.models.config_checks import refuse_use_sliding_window
from engine.models.decoder import DecoderModel as Model  # noqa: F401  (the architecture's network)
from engine.models.interface import ArchFlags


def config_flags(hf_config: Any) -> ArchFlags:
    """Raises: ValueError for `use_sliding_window=True`."""
    refuse_use_sliding_window("qwen2", hf_config)
    return ArchFlags(qkv_bias=True, o_bias=False)
