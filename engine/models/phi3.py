"""Phi-3: Llama's numerics with q/k/v and gate/up stored fused in the checkpoint (the strict loader takes either
layout) and no biases."""
from __future__ import annotations

from typing import Any

from engine.models.config_checks import refuse_short_window
from engine.models.decoder import DecoderModel as Model  # noqa: F401  (the architecture's network)
from engine.models.interface import ArchFlags


def config_flags(hf_config: Any) -> ArchFlags:
    """Raises: ValueError for a sliding window shorter than the context (Phi-3-mini-4k has 2047 against 4096)."""
    refuse_short_window("phi3", hf_config)
    return ArchFlags()
