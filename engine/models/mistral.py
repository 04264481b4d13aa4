"""Mistral: Llama's numerics under another model_type; its sliding window is refused when shorter than the context."""
from __future__ import annotations

from typing import Any

from engine.models.config_checks import refuse_short_window
from engine.models.decoder import DecoderModel as Model  # noqa: F401  (the architecture's network)
from engine.models.interface import ArchFlags


def config_flags(hf_config: Any) -> ArchFlags:
    """Raises: ValueError for a sliding window shorter than max_position_embeddings."""
    refuse_short_window("mistral", hf_config)
    return ArchFlags()
