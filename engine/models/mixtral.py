"""Mixtral: Mistral's attention with a routed mixture-of-experts MLP on every layer (top-k probabilities always
renormalised), stored as `block_sparse_moe.experts.E.w1 / w3 / w2` (gate / up / down)."""
from __future__ import annotations

from typing import Any

from pdserve_server.engine.models.config_checks import uniform_windows
from pdserve_server.engine.models.decoder import DecoderModel
from pdserve_server.engine.models.interface import ArchFlags, CheckpointNames, MoEConfig


def config_flags(hf_config: Any) -> ArchFlags:
    """Every layer slides over `sliding_window` when it is set (HF MixtralModel, as Mistral).

    Raises: ValueError for a sliding_window that is not an int >= 1."""
    moe = MoEConfig(num_experts=int(hf_config.num_local_experts), top_k=int(hf_config.num_experts_per_tok),
                    intermediate_size=int(hf_config.intermediate_size), norm_topk_prob=True,
                    sparse_layers=tuple(range(hf_config.num_hidden_layers)))
    return ArchFlags(moe=moe, layer_windows=uniform_windows("mixtral", hf_config))


class Model(DecoderModel):
    """The shared decoder reading Mixtral's tensor names."""

    CHECKPOINT = CheckpointNames(mlp="block_sparse_moe", router="gate", experts=("w1", "w3", "w2"))
