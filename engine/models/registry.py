"""HF `model_type` -> the architecture module that serves it (`engine.models.interface` says what one provides).

Modules are imported on first use, by name, so reading a config loads no model code and this file imports nothing
of ours beyond the standard-library config checks. Adding an architecture is its module and one line here.
"""
from __future__ import annotations

import importlib
from dataclasses import replace
from types import MappingProxyType, ModuleType
from typing import Any, Mapping

from pdserve_server.engine.models.config_checks import rope_scaling
from pdserve_server.engine.models.interface import ArchFlags

_MODULES: Mapping[str, str] = MappingProxyType({
    "gemma3_text": "pdserve_server.engine.models.gemma3",
    "llama": "pdserve_server.engine.models.llama",
    "mistral": "pdserve_server.engine.models.mistral",
    "mixtral": "pdserve_server.engine.models.mixtral",
    "phi3": "pdserve_server.engine.models.phi3",
    "qwen2": "pdserve_server.engine.models.qwen2",
    "qwen3": "pdserve_server.engine.models.qwen3",
    "qwen3_moe": "pdserve_server.engine.models.qwen3_moe",
})

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_MODULES))


def architecture(model_type: str | None) -> ModuleType:
    """The module serving `model_type`: it has `config_flags(hf_config)` and `Model`.

    Raises:
        ValueError: `model_type` is not one of `SUPPORTED_MODEL_TYPES` (the message lists them).
    """
    name = _MODULES.get(model_type)  # type: ignore[arg-type]
    if name is None:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return importlib.import_module(name)


def arch_flags(hf_config: Any) -> ArchFlags:
    """Read the decoder flags of an HF config (`transformers.PretrainedConfig` or anything with its attributes).

    Checks common to every model_type come first: the MLP activation (every MLP here is SiLU-gated) and the RoPE
    parameters (`config_checks.rope_scaling`); then the architecture's own `config_flags`.

    Raises:
        ValueError: `model_type` is not supported (the message lists those that are), or the config asks for a
            feature the architecture does not implement (the message names the field or the rope type).
    """
    model_type = getattr(hf_config, "model_type", None)
    module = architecture(model_type)
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{model_type}: hidden_act={act!r} is not supported (the MLP is SiLU-gated)")
    rope_llama3 = rope_scaling(model_type, hf_config)
    return replace(module.config_flags(hf_config), rope_llama3=rope_llama3)
