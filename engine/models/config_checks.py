"""Reading an HF config: the checks architectures share, each refusing (ValueError naming the field) what our layers
do not implement. Standard library only: config parsing runs before any model code is loaded."""
from __future__ import annotations

from typing import Any, Mapping

from engine.models.interface import Llama3RopeScaling


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The RoPE dict: transformers >= 5 keeps it in `rope_parameters` (with `rope_scaling` an alias of it), older
    configs in `rope_scaling` (None for plain RoPE, the type under "rope_type" or the legacy "type").

    Raises:
        ValueError: it is not one dict (per-layer-type RoPE dicts are not supported).
    """
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"unsupported rope_parameters {params!r} (expected one dict)")
    return dict(params)


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_scaling(model_type: str, hf_config: Any) -> Llama3RopeScaling | None:
    """Plain RoPE (None) or Llama-3 scaling.

    Raises:
        ValueError: any other rope type, or a partial rotary dimension: the layers would silently compute different
            frequencies or rotate the wrong dimensions.
    """
    params = rope_parameters(hf_config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{model_type}: partial_rotary_factor={partial} is not supported (RoPE on all of head_dim)")
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ValueError(f"{model_type}: rope_type {rope_type!r} is not supported (only 'default' and 'llama3'); "
                         f"rope_parameters={params}")
    missing = [k for k in _LLAMA3_KEYS if params.get(k) is None]
    if missing:
        raise ValueError(f"{model_type}: rope_type 'llama3' needs {', '.join(missing)} in rope_parameters")
    scaling = Llama3RopeScaling(float(params["factor"]), float(params["low_freq_factor"]),
                                float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]))
    if scaling.high_freq_factor == scaling.low_freq_factor:  # HF's smoothing divides by their difference
        raise ValueError(f"{model_type}: rope_type 'llama3' needs high_freq_factor != low_freq_factor")
    return scaling


def refuse_short_window(model_type: str, hf_config: Any) -> None:
    """A sliding window at least as long as the context never masks anything, so only a shorter one changes
    numerics: refuse it (ValueError naming the field); the decoder attends to the whole context."""
    window = getattr(hf_config, "sliding_window", None)
    if window is not None and window < hf_config.max_position_embeddings:
        raise ValueError(f"{model_type}: sliding_window={window} < max_position_embeddings="
                         f"{hf_config.max_position_embeddings} is not supported (no sliding-window attention)")


def refuse_use_sliding_window(model_type: str, hf_config: Any) -> None:
    """Qwen2's and Qwen3's switch for their (optional) sliding window: refused when on."""
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError(f"{model_type}: use_sliding_window=True is not supported (no sliding-window attention)")


def attention_bias(hf_config: Any) -> bool:
    """HF Llama / Qwen3 `attention_bias`: one switch for the q, k, v and o projections (default False)."""
    return bool(getattr(hf_config, "attention_bias", False))
