"""Phi-3: Llama's numerics with q/k/v and gate/up stored fused in the checkpoint (the strict loader takes either
layout) and no biases; `sliding_window` (when set) on every layer."""
from __future__ import annotations

from typing import Any

from pdserve_server.engine.models.config_checks import uniform_windows
from pdserve_server.engine.models.decoder import DecoderModel as Model  # noqa: F401  (the architecture's network)
from pdserve_server.engine.models.interface import ArchFlags


def config_flags(hf_config: Any) -> ArchFlags:
    """Every layer slides over `sliding_window` when it is set, the value as is: HF Phi3Model builds
    `create_sliding_window_causal_mask` from `config.sliding_window` (Phi-3-mini-4k's 2047: a query sees its own
    token and the 2046 before it), with no adjustment by one.

    Raises: ValueError for a sliding_window that is not an int >= 1."""
    return ArchFlags(layer_windows=uniform_windows("phi3", hf_config))
