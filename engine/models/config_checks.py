"""Reading an HF config: the checks architectures share, each refusing (ValueError naming the field) what our layers
do not implement. Standard library only: config parsing runs before any model code is loaded."""
from __future__ import annotations

from typing import Any, Mapping

from pdserve_server.engine.models.interface import Llama3RopeScaling


# Model types whose module reads per-layer-type `rope_parameters` itself (Gemma 3: {"sliding_attention": {...},
# "full_attention": {...}}, each layer type with its own base and scaling); `rope_scaling` leaves them alone.
OWN_ROPE_PARSING = frozenset({"gemma3_text"})


def is_per_layer_type(params: Any) -> bool:
    """True for transformers >= 5's per-layer-type RoPE dict: one RoPE dict per attention type (Gemma 3)."""
    return isinstance(params, Mapping) and bool(params) and all(isinstance(v, Mapping) for v in params.values())


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The RoPE dict: transformers >= 5 keeps it in `rope_parameters` (with `rope_scaling` an alias of it), older
    configs in `rope_scaling` (None for plain RoPE, the type under "rope_type" or the legacy "type").

    Raises:
        ValueError: it is not one dict (per-layer-type RoPE dicts are only read by `OWN_ROPE_PARSING` modules).
    """
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if not isinstance(params, Mapping) or is_per_layer_type(params):
        raise ValueError(f"unsupported rope_parameters {params!r} (expected one dict)")
    return dict(params)


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_scaling(model_type: str, hf_config: Any) -> Llama3RopeScaling | None:
    """Plain RoPE (None) or Llama-3 scaling; None for the `OWN_ROPE_PARSING` model types, whose `config_flags`
    check their RoPE themselves.

    Raises:
        ValueError: any other rope type, or a partial rotary dimension: the layers would silently compute different
            frequencies or rotate the wrong dimensions.
    """
    if model_type in OWN_ROPE_PARSING:
        return None
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


def _window(model_type: str, window: Any) -> int:
    """A config's `sliding_window` as the ops' W (HF's mask uses the value as is: a query sees its own token and the
    W - 1 before it, `masking_utils.sliding_window_overlay`).

    Raises:
        ValueError: W is not an int >= 1 (HF's mask would hide every key, the query's own included).
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{model_type}: sliding_window={window!r} is not supported (a window of >= 1 tokens)")
    return window


def uniform_windows(model_type: str, hf_config: Any) -> tuple[int, ...] | None:
    """Mistral, Mixtral and Phi-3: when `sliding_window` is set, every layer slides over it, as HF's MistralModel /
    MixtralModel / Phi3Model build `create_sliding_window_causal_mask` from `config.sliding_window` for all layers
    (`layer_types`, if a config carries it, is not read by their modeling code). None: no window, full attention.

    Raises:
        ValueError: a window that is not an int >= 1.
    """
    window = getattr(hf_config, "sliding_window", None)
    if window is None:
        return None
    return (_window(model_type, window),) * hf_config.num_hidden_layers


def windows_from_layer_types(model_type: str, hf_config: Any, layer_types: Any,
                             window: int | None) -> tuple[int, ...] | None:
    """Per-layer windows from HF's `layer_types`: "sliding_attention" layers slide over `window`,
    "full_attention" layers attend fully (0). None when no layer slides.

    Raises:
        ValueError: layer_types is not one entry per layer, names another attention type (the message names it),
            or a sliding layer has no window.
    """
    layer_types = list(layer_types)
    if len(layer_types) != hf_config.num_hidden_layers:
        raise ValueError(f"{model_type}: layer_types has {len(layer_types)} entries for "
                         f"{hf_config.num_hidden_layers} layers")
    windows = []
    for i, kind in enumerate(layer_types):
        if kind == "full_attention":
            windows.append(0)
        elif kind != "sliding_attention":
            raise ValueError(f"{model_type}: layer_types[{i}]={kind!r} is not supported (only 'full_attention' "
                             f"and 'sliding_attention')")
        elif window is None:
            raise ValueError(f"{model_type}: layer_types[{i}]='sliding_attention' needs a sliding_window (None)")
        else:
            windows.append(_window(model_type, window))
    return tuple(windows) if any(windows) else None


def qwen_layer_windows(model_type: str, hf_config: Any) -> tuple[int, ...] | None:
    """Qwen2 / Qwen3: the window is `sliding_window` only with `use_sliding_window` (HF Qwen2Config.__post_init__
    sets it to None otherwise), and it applies to the layers `layer_types` marks "sliding_attention"
    (Qwen2Attention.sliding_window). Without `layer_types` the config's default is built as HF does: layer i slides
    iff a window is set and i >= max_window_layers (HF's default 28).

    Raises:
        ValueError: as `windows_from_layer_types`.
    """
    window = getattr(hf_config, "sliding_window", None) if getattr(hf_config, "use_sliding_window", False) else None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        first = getattr(hf_config, "max_window_layers", 28)
        layer_types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                       for i in range(hf_config.num_hidden_layers)]
    return windows_from_layer_types(model_type, hf_config, layer_types, window)


def attention_bias(hf_config: Any) -> bool:
    """HF Llama / Qwen3 `attention_bias`: one switch for the q, k, v and o projections (default False)."""
    return bool(getattr(hf_config, "attention_bias", False))
