"""HF `model_type` -> architecture adapter.

Llama, Mistral, Qwen2 and Qwen3 share one decoder (`engine.models.llama`); they differ only in which projections
carry a bias, in Qwen3's per-head q/k RMSNorm, and in features we do not implement (sliding-window attention, MLP
bias, RoPE types other than plain and Llama-3's). An adapter reads those fields from an HF config and either returns
the decoder's flags or refuses the model, naming the field, so a checkpoint is never served with silently different
numerics. Standard library only: `engine.config` imports this module.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3 (3.1+) RoPE frequency scaling, rope_type "llama3"; `engine.models.llama.llama3_inv_freq` applies it.

    Attributes (HF `rope_parameters` keys of the same names; Llama 3.1 ships 8.0, 1.0, 4.0, 8192):
        factor: long wavelengths' inverse frequencies are divided by it.
        low_freq_factor / high_freq_factor: wavelengths above original_max_position_embeddings / low_freq_factor are
            scaled fully, below original_max_position_embeddings / high_freq_factor not at all, in between smoothly.
        original_max_position_embeddings: the pre-training context length.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ArchFlags:
    """Architecture switches of the shared decoder.

    Attributes:
        qkv_bias: the fused q/k/v projection has a bias (Qwen2; Llama / Qwen3 with `attention_bias=True`).
        o_bias: the attention output projection has a bias (Llama / Qwen3 with `attention_bias=True`).
        qk_norm: RMSNorm over head_dim on every q and k head after the projection, before RoPE, with weights
            `self_attn.q_norm.weight` / `self_attn.k_norm.weight` of size head_dim (Qwen3).
        rope_llama3: Llama-3 scaling of the RoPE inverse frequencies; None for plain RoPE (rope_type "default").
    """

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    rope_llama3: Llama3RopeScaling | None = None


def _rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The RoPE dict: transformers >= 5 keeps it in `rope_parameters` (with `rope_scaling` an alias of it), older
    configs in `rope_scaling` (None for plain RoPE, the type under "rope_type" or the legacy "type")."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"unsupported rope_parameters {params!r} (expected one dict)")
    return dict(params)


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope(model_type: str, hf_config: Any) -> Llama3RopeScaling | None:
    """Plain RoPE (None) or Llama-3 scaling; any other rope type, or a partial rotary dimension, is refused: the
    decoder would silently compute different frequencies or rotate the wrong dimensions."""
    params = _rope_parameters(hf_config)
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


def _llama(hf_config: Any) -> ArchFlags:
    # HF Llama puts `mlp_bias` on gate/up/down; our fused MLP has no bias.
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("llama: mlp_bias=True is not supported (gate/up/down projections have no bias here)")
    bias = bool(getattr(hf_config, "attention_bias", False))  # HF: one switch for q, k, v and o
    return ArchFlags(qkv_bias=bias, o_bias=bias)


def _refuse_short_window(model_type: str, hf_config: Any) -> None:
    """A sliding window at least as long as the context never masks anything, so only a shorter one changes
    numerics: refuse it (ValueError naming the field); the decoder attends to the whole context."""
    window = getattr(hf_config, "sliding_window", None)
    if window is not None and window < hf_config.max_position_embeddings:
        raise ValueError(f"{model_type}: sliding_window={window} < max_position_embeddings="
                         f"{hf_config.max_position_embeddings} is not supported (no sliding-window attention)")


def _mistral(hf_config: Any) -> ArchFlags:
    _refuse_short_window("mistral", hf_config)
    return ArchFlags()


def _qwen2(hf_config: Any) -> ArchFlags:
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("qwen2: use_sliding_window=True is not supported (no sliding-window attention)")
    return ArchFlags(qkv_bias=True, o_bias=False)  # HF Qwen2Attention: bias on q/k/v only


def _qwen3(hf_config: Any) -> ArchFlags:
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("qwen3: use_sliding_window=True is not supported (no sliding-window attention)")
    # HF Qwen3Attention: `attention_bias` (default False) on q, k, v and o alike; q_norm / k_norm always.
    bias = bool(getattr(hf_config, "attention_bias", False))
    return ArchFlags(qkv_bias=bias, o_bias=bias, qk_norm=True)


def _phi3(hf_config: Any) -> ArchFlags:
    # HF Phi3: Llama's numerics with q/k/v and gate/up stored fused (the loader takes either layout), no biases.
    _refuse_short_window("phi3", hf_config)  # Phi-3-mini-4k has 2047 against 4096
    return ArchFlags()


_ADAPTERS: Mapping[str, Callable[[Any], ArchFlags]] = MappingProxyType({
    "llama": _llama,
    "mistral": _mistral,
    "phi3": _phi3,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
})

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_ADAPTERS))


def arch_flags(hf_config: Any) -> ArchFlags:
    """Read the decoder flags of an HF config (`transformers.PretrainedConfig` or anything with its attributes).

    Checks common to every model_type come first: the MLP activation (the decoder's is SiLU-gated) and the RoPE
    parameters (`_rope`); then the model_type's adapter.

    Raises:
        ValueError: `model_type` is not one of `SUPPORTED_MODEL_TYPES` (the message lists them), or the config
            asks for a feature the decoder does not implement (the message names the field or the rope type).
    """
    model_type = getattr(hf_config, "model_type", None)
    adapter = _ADAPTERS.get(model_type)
    if adapter is None:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{model_type}: hidden_act={act!r} is not supported (the MLP is SiLU-gated)")
    rope_llama3 = _rope(model_type, hf_config)
    return replace(adapter(hf_config), rope_llama3=rope_llama3)
