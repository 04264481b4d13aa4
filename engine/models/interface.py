"""What a model architecture provides, in one place: read this before adding one.

An architecture is a module `engine/models/<name>.py` registered under its HF `model_type` in
`engine.models.registry` (one line). The module provides two things:

    def config_flags(hf_config) -> ArchFlags
        Config parsing: read the HF config (`transformers.PretrainedConfig`, or anything with its attributes) and
        return the decoder's switches, or raise ValueError naming the field (or RoPE type) the module does not
        implement, so a checkpoint is never served with silently different numerics. The checks every
        architecture shares (MLP activation, RoPE type, sizes) run first, in `engine.models.registry.arch_flags`;
        the module adds its own (`engine.models.config_checks` has the common ones, e.g. a sliding window).

    Model: type[CausalLM]
        The network. Most architectures are the shared decoder (`engine.models.decoder.DecoderModel`) switched by
        `ArchFlags`; one whose checkpoint names its tensors differently subclasses it and sets `CHECKPOINT`
        (`CheckpointNames`, e.g. Mixtral's `block_sparse_moe.experts.N.w1`); one with different numerics writes its
        own module from the building blocks in `engine.models.layers` (RMSNorm, RoPE incl. Llama-3 scaling,
        GQA attention over the paged KV cache, gated MLP) and `engine.models.moe` (routed experts, run grouped).

The forward pass works on a flat token batch: the tokens of every scheduled request concatenated (decodes first,
then prefill chunks), with `engine.attention.AttentionMetadata` saying where each one's K/V lives in the paged
cache; there is no batch dimension and no padding. Weight loading is strict: every parameter supplied, every
tensor of the checkpoint consumed (`engine.models.decoder.StrictWeights`).

Tensor parallelism (`engine.parallel.tensor_parallel`): `Model(cfg, ops, tp)` builds one rank's share. The projections
are plain `nn.Linear`s sized for the rank; q/k/v, gate/up and the experts' gate/up are column-parallel (split on output
features), o_proj, down_proj and the experts' down row-parallel (split on input features, the layer all-reduces
its output), embedding and LM head vocab-parallel, as in Megatron-LM (Shoeybi et al. 2019);
`engine.models.sharding` is the table of which parameter splits how, applied by the loader.

This module is standard library only: `engine.config` imports its dataclasses, which travel between processes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Protocol

if TYPE_CHECKING:
    import torch

    from pdserve_server.engine.attention import AttentionMetadata


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3 (3.1+) RoPE frequency scaling, rope_type "llama3"; `engine.models.layers.llama3_inv_freq` applies it.

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
class MoEConfig:
    """Sparse mixture-of-experts MLP (Shazeer et al. 2017; Mixtral, Qwen3-MoE): a router picks `top_k` of
    `num_experts` SiLU-gated experts per token and sums their outputs weighted by the router's softmax.

    Attributes:
        num_experts: experts per MoE layer.
        top_k: experts per token (HF `num_experts_per_tok`).
        intermediate_size: each expert's hidden width (Qwen3-MoE `moe_intermediate_size`; Mixtral's
            `intermediate_size`).
        norm_topk_prob: renormalise the top_k probabilities to sum to 1 (Mixtral always; Qwen3-MoE per config).
        sparse_layers: indices of the layers whose MLP is the MoE block; the others have a dense MLP of the model's
            `intermediate_size` (Qwen3-MoE's `mlp_only_layers` / `decoder_sparse_step`).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]


@dataclass(frozen=True)
class ArchFlags:
    """Architecture switches of the shared decoder, as `config_flags` returns them.

    Attributes:
        qkv_bias: the fused q/k/v projection has a bias (Qwen2; Llama / Qwen3 with `attention_bias=True`).
        o_bias: the attention output projection has a bias (Llama / Qwen3 with `attention_bias=True`).
        qk_norm: RMSNorm over head_dim on every q and k head after the projection, before RoPE, with weights
            `self_attn.q_norm.weight` / `self_attn.k_norm.weight` of size head_dim (Qwen3, Qwen3-MoE).
        rope_llama3: Llama-3 scaling of the RoPE inverse frequencies; None for plain RoPE (rope_type "default").
            Set by the registry's shared RoPE check, not by `config_flags`.
        moe: the sparse MLP of a mixture-of-experts model; None for a dense one.
        layer_windows: each layer's sliding window W (its query sees its own token and the W - 1 before it, HF's
            sliding-window mask; 0: full causal attention), one int per layer; None: every layer attends fully.
        attention_scale: the softmax scale; None: head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5).
        final_logit_softcapping: cap c of tanh(logits / c) * c on the LM head's output (Gemma); None: no capping.
        rope_theta: the RoPE base, when the module reads it from per-layer-type `rope_parameters` (Gemma 3's
            full-attention layers); None: the config's `rope_theta`.
        rope_local_theta: the RoPE base of the sliding-window layers (Gemma 3's `rope_local_base_freq`); None: the
            same as the others.
        rope_linear_factor: HF rope_type "linear" on the full-attention layers (inverse frequencies divided by it;
            Gemma 3 4B+ use 8); None: unscaled.
    """

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    rope_llama3: Llama3RopeScaling | None = None
    moe: MoEConfig | None = None
    layer_windows: tuple[int, ...] | None = None
    attention_scale: float | None = None
    final_logit_softcapping: float | None = None
    rope_theta: float | None = None
    rope_local_theta: float | None = None
    rope_linear_factor: float | None = None


@dataclass(frozen=True)
class CheckpointNames:
    """How a checkpoint names the MLP tensors of a layer (HF names, after `model.layers.N.`).

    Attributes:
        mlp: the MLP's module name ("mlp"; Mixtral's MoE layers "block_sparse_moe").
        router: the router's linear under `mlp` ("gate").
        experts: one expert's (gate, up, down) projections under `mlp.experts.E.` (("gate_proj", "up_proj",
            "down_proj"); Mixtral ("w1", "w3", "w2")).
    """

    mlp: str = "mlp"
    router: str = "gate"
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


class CausalLM(Protocol):
    """The network an architecture module exports as `Model` (an `nn.Module`), built as `Model(cfg, ops, tp)` from
    an `engine.models.config.ModelConfig`, the worker's `kernels.backends.AttentionOps` and the rank's
    `engine.parallel.tensor_parallel.TensorParallel` (default: no tensor parallelism)."""

    CHECKPOINT: ClassVar[CheckpointNames]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
                on_layer_written: Callable[[int], None] | None = None) -> torch.Tensor:
        """One packed step. input_ids, positions: [T] int64; kv_layers[l] = layer l's (k_cache, v_cache), each
        [num_blocks, block_size, kv_heads, head_dim]; writes the step's K/V into them and returns the final hidden
        states [T, hidden] in the model dtype. on_layer_written(l) runs once layer l's K/V are written (layer-wise
        KV streaming)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in the model dtype."""
        ...

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Copy an HF-named state dict in, strictly. Raises KeyError (missing tensor) or ValueError (unused or
        misshapen tensors), naming them, before anything is copied."""
        ...
