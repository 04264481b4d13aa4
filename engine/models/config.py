"""A model's architecture as the engine serves it (`ModelConfig`), read from an HF `config.json`: what every model
module (`engine.models.*`) is built from. It lives beside the modules so they import nothing above their folder."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pdserve_server.engine.args import DTYPE_NAMES
from pdserve_server.engine.models.interface import Llama3RopeScaling, MoEConfig
from pdserve_server.engine.models.registry import arch_flags

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder served by `engine.models` (the registry lists the model types), read from an HF
    `config.json`.

    Attributes are in the field's usual units: sizes in elements, `rope_theta` the RoPE base; `head_dim` is the
    config's own when it has one (Qwen3's differs from hidden_size / num_heads); `architecture` is the HF
    `model_type` (it picks the module, `engine.models.registry.architecture`). The rest are
    `engine.models.interface.ArchFlags`, set per `model_type` and config: `qkv_bias` / `o_bias` (the fused q/k/v
    projection / o_proj carry a bias), `qk_norm` (per-head RMSNorm on q and k before RoPE), `rope_llama3`
    (Llama-3 RoPE frequency scaling, None for plain RoPE), `moe` (the routed experts of an MoE model),
    `layer_windows` (each layer's sliding window, 0 = full attention; None: no layer slides), and Gemma 3's
    `attention_scale`, `final_logit_softcapping`, `rope_local_theta` and `rope_linear_factor` (see ArchFlags).
    """

    name: str
    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    dtype: str = "float32"
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    rope_llama3: Llama3RopeScaling | None = None
    moe: MoEConfig | None = None
    layer_windows: tuple[int, ...] | None = None
    attention_scale: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None
    rope_linear_factor: float | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def from_hf(cls, hf_config: Any, name: str, path: str, dtype: str = "float32") -> "ModelConfig":
        """Build from a `transformers.PretrainedConfig` of a registered model type (`engine.models.registry`).

        Raises:
            ValueError: the model_type, a feature it asks for (the field is named) or its RoPE type (named) is not
                supported, or dtype is unknown.
        """
        flags = arch_flags(hf_config)  # refuses what the decoder cannot serve, RoPE types included
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        eos = hf_config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        num_heads = hf_config.num_attention_heads
        rope_theta = getattr(hf_config, "rope_theta", None)
        if flags.rope_theta is not None:  # read by the module (per-layer-type rope_parameters)
            rope_theta = flags.rope_theta
        elif rope_theta is None:  # transformers >= 5 keeps it in rope_parameters
            rope_theta = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return cls(
            name=name,
            path=path,
            architecture=hf_config.model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=float(rope_theta),
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            dtype=dtype,
            qkv_bias=flags.qkv_bias,
            o_bias=flags.o_bias,
            qk_norm=flags.qk_norm,
            rope_llama3=flags.rope_llama3,
            moe=flags.moe,
            layer_windows=flags.layer_windows,
            attention_scale=flags.attention_scale,
            final_logit_softcapping=flags.final_logit_softcapping,
            rope_local_theta=flags.rope_local_theta,
            rope_linear_factor=flags.rope_linear_factor,
        )
