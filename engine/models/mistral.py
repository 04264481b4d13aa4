"""Mistral: Llama's numerics under another model_type, with `sliding_window` (when set) on every layer."""
from __future__ import annotations

from typing import Any

from pdserve_server.engine.models.config_checks import uniform_windows
from pdserve_server.engine.models.decoder import DecoderModel as Model  # noqa: F401  (the architecture's network)
from pdserve_server.engine.models.interface import ArchFlags


def config_flags(hf_config: Any) -> ArchFlags:
    """Every layer slides over `sliding_window` when it is set (HF MistralModel; Mistral 7B v0.1 has 4096).

    Raises: ValueError for a sliding_window that is not an int >= 1."""
    return ArchFlags(layer_windows=uniform_windows("mistral", hf_config))
