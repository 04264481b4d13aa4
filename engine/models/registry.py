"""HF `model_type` -> architecture adapter.

Llama, Mistral and Qwen2 share one decoder (`engine.models.llama`); they differ only in which projections carry a
bias and in features we do not implement (sliding-window attention, MLP bias). An adapter reads those fields from
an HF config and either returns the decoder's flags or refuses the model, naming the field, so a checkpoint is never
served with silently different numerics. Standard library only: `engine.config` imports this module.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class ArchFlags:
    """Architecture switches of the shared decoder.

    Attributes:
        qkv_bias: the fused q/k/v projection has a bias (Qwen2; Llama with `attention_bias=True`).
        o_bias: the attention output projection has a bias (Llama with `attention_bias=True`).
    """

    qkv_bias: bool = False
    o_bias: bool = False


def _llama(hf_config: Any) -> ArchFlags:
    # HF Llama puts `mlp_bias` on gate/up/down; our fused MLP has no bias.
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("llama: mlp_bias=True is not supported (gate/up/down projections have no bias here)")
    bias = bool(getattr(hf_config, "attention_bias", False))  # HF: one switch for q, k, v and o
    return ArchFlags(qkv_bias=bias, o_bias=bias)


def _mistral(hf_config: Any) -> ArchFlags:
    # A window at least as long as the context never masks anything, so only a shorter one changes numerics.
    window = getattr(hf_config, "sliding_window", None)
    if window is not None and window < hf_config.max_position_embeddings:
        raise ValueError(f"mistral: sliding_window={window} < max_position_embeddings="
                         f"{hf_config.max_position_embeddings} is not supported (no sliding-window attention)")
    return ArchFlags()


def _qwen2(hf_config: Any) -> ArchFlags:
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("qwen2: use_sliding_window=True is not supported (no sliding-window attention)")
    return ArchFlags(qkv_bias=True, o_bias=False)  # HF Qwen2Attention: bias on q/k/v only


_ADAPTERS: Mapping[str, Callable[[Any], ArchFlags]] = MappingProxyType({
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
})

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_ADAPTERS))


def arch_flags(hf_config: Any) -> ArchFlags:
    """Read the decoder flags of an HF config (`transformers.PretrainedConfig` or anything with its attributes).

    Raises:
        ValueError: `model_type` is not one of `SUPPORTED_MODEL_TYPES` (the message lists them), or the config
            asks for a feature the decoder does not implement (the message names the field).
    """
    model_type = getattr(hf_config, "model_type", None)
    adapter = _ADAPTERS.get(model_type)
    if adapter is None:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return adapter(hf_config)
