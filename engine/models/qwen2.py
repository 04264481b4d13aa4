"""Qwen2: Llama plus a bias on the q/k/v projections (HF Qwen2Attention; none on o_proj), and with
`use_sliding_window` a sliding window on the layers `layer_types` (or `max_window_layers`) selects."""
from __future__ import annotations

from typing import Any

from pdserve_server.engine.models.config_checks import qwen_layer_windows
from pdserve_server.engine.models.decoder import DecoderModel as Model  # noqa: F401  (the architecture's network)
from pdserve_server.engine.models.interface import ArchFlags


def config_flags(hf_config: Any) -> ArchFlags:
    """Raises: ValueError for `layer_types` naming another attention type, or a bad window
    (`config_checks.qwen_layer_windows`)."""
    return ArchFlags(qkv_bias=True, o_bias=False, layer_windows=qwen_layer_windows("qwen2", hf_config))
