"""Gemma 3 (text), model_type "gemma3_text": HF transformers' `Gemma3ForCausalLM` (models/gemma3/modeling_gemma3.py,
transformers 5.24), built from the shared blocks where Gemma computes the same thing and its own code where it
differs:

- the embedding is scaled by sqrt(hidden_size), rounded to the model dtype first (`Gemma3TextScaledWordEmbedding`);
- RMSNorm multiplies by (1 + w), in fp32, before rounding to the model dtype (`Gemma3RMSNorm`), on the residual
  stream four times per layer (input, post-attention, pre- and post-feed-forward) and per head on q and k;
- the softmax scale is query_pre_attn_scalar ** -0.5, not head_dim ** -0.5 (`Gemma3Attention.scaling`);
- the MLP is GeGLU, down(gelu_tanh(gate(x)) * up(x)) (`Gemma3MLP` with "gelu_pytorch_tanh");
- layers alternate by `layer_types`: "sliding_attention" layers attend over `sliding_window` with the local RoPE
  base, "full_attention" layers over the whole context with the global base, optionally linearly scaled
  (`Gemma3RotaryEmbedding`, per-layer-type `rope_parameters`);
- the logits are soft-capped, tanh(logits / c) * c, when `final_logit_softcapping` is set (`Gemma3ForCausalLM`);
- the LM head is the embedding (tied).

Under tensor parallelism it splits as the shared decoder does (`engine.models.sharding`): heads, the MLP's features
and the vocabulary; the soft-cap applies to the gathered logits.

Not implemented, refused by name when the config is read: `attn_logit_softcapping` (the attention kernels do not
cap scores), `use_bidirectional_attention`, other activations, RoPE and layer types.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pdserve_server.engine.attention import AttentionMetadata
from pdserve_server.engine.models.config import ModelConfig
from pdserve_server.engine.models.config_checks import attention_bias, is_per_layer_type, windows_from_layer_types
from pdserve_server.engine.models.decoder import StrictWeights
from pdserve_server.engine.models.interface import ArchFlags, CheckpointNames
from pdserve_server.engine.models.layers import Attention, GatedMLP, RMSNorm, RotaryEmbedding
from pdserve_server.engine.models.sharding import shard, vocab_parallel_embed, vocab_parallel_logits, vocab_per_rank
from pdserve_server.engine.parallel.tensor_parallel import SINGLE, TensorParallel
from pdserve_server.kernels.backends import AttentionOps

_NAME = "gemma3_text"


def _rope(hf_config: Any, layer_types: set[str]) -> tuple[float, float, float | None]:
    """(global base, local base, linear factor of the global layers or None) from the per-layer-type
    `rope_parameters` that transformers >= 5 builds for Gemma 3 (`Gemma3TextConfig.convert_rope_params_to_dict`,
    from `rope_theta`, `rope_local_base_freq` and `rope_scaling` in older config.json files).

    Raises:
        ValueError: no per-layer-type dict, a partial rotary dimension, or a RoPE type other than "default" (and
            "linear" on the full-attention layers), named.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if not is_per_layer_type(params):
        raise ValueError(f"{_NAME}: expected per-layer-type rope_parameters (transformers >= 5), got {params!r}")
    thetas: dict[str, float] = {}
    factor = None
    for kind in sorted(layer_types):
        p = params.get(kind)
        if p is None:
            raise ValueError(f"{_NAME}: rope_parameters has no {kind!r} entry")
        rope_type = p.get("rope_type", p.get("type", "default"))
        if p.get("partial_rotary_factor", 1.0) not in (1, 1.0):
            raise ValueError(f"{_NAME}: partial_rotary_factor={p['partial_rotary_factor']} is not supported")
        allowed = ("default", "linear") if kind == "full_attention" else ("default",)
        if rope_type not in allowed:
            raise ValueError(f"{_NAME}: rope_type {rope_type!r} for {kind} layers is not supported (only "
                             f"{' and '.join(repr(a) for a in allowed)}); rope_parameters={dict(params)}")
        if rope_type == "linear":
            factor = float(p["factor"])
        thetas[kind] = float(p["rope_theta"])
    local = thetas.get("sliding_attention", thetas.get("full_attention"))
    return thetas.get("full_attention", local), local, factor


def config_flags(hf_config: Any) -> ArchFlags:
    """Gemma 3's switches: windows per layer from `layer_types` (HF's default, when absent: every
    `sliding_window_pattern`-th layer, 6 by default, full, the others sliding), q/k norm, `attention_bias` on q, k, v
    and o, query_pre_attn_scalar's softmax scale, `final_logit_softcapping` and the RoPE of each layer type.

    Raises:
        ValueError: `attn_logit_softcapping` set, `use_bidirectional_attention`, `hidden_activation` other than
            "gelu_pytorch_tanh", or unsupported layer or RoPE types; the message names the field.
    """
    if getattr(hf_config, "attn_logit_softcapping", None) is not None:
        raise ValueError(f"{_NAME}: attn_logit_softcapping={hf_config.attn_logit_softcapping} is not supported (the "
                         f"attention kernels do not soft-cap scores)")
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError(f"{_NAME}: use_bidirectional_attention=True is not supported (causal attention only)")
    act = getattr(hf_config, "hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"{_NAME}: hidden_activation={act!r} is not supported (only 'gelu_pytorch_tanh')")
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:  # Gemma3TextConfig.__post_init__'s default
        pattern = getattr(hf_config, "sliding_window_pattern", 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                       for i in range(hf_config.num_hidden_layers)]
    windows = windows_from_layer_types(_NAME, hf_config, layer_types, getattr(hf_config, "sliding_window", None))
    theta, local_theta, factor = _rope(hf_config, set(layer_types))
    bias = attention_bias(hf_config)
    cap = getattr(hf_config, "final_logit_softcapping", None)
    return ArchFlags(qkv_bias=bias, o_bias=bias, qk_norm=True, layer_windows=windows,
                     attention_scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
                     final_logit_softcapping=None if cap is None else float(cap),
                     rope_theta=theta, rope_local_theta=local_theta, rope_linear_factor=factor)


def gemma_rms_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """HF `Gemma3RMSNorm`: x / rms(x) * (1 + w), all in fp32, rounded to x's dtype at the end (Llama rounds before
    the weight; the ops' `rms_norm` is Llama's). x: [..., size] -> same shape and dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)
    return (xf * (1.0 + norm.weight.float())).to(x.dtype)


class GemmaAttention(Attention):
    """The shared paged GQA attention with Gemma's softmax scale (query_pre_attn_scalar ** -0.5) and Gemma's q/k
    norm (`gemma_rms_norm` per head, after the projection and before RoPE, as `Gemma3Attention` does)."""

    def __init__(self, cfg: ModelConfig, ops: AttentionOps, tp: TensorParallel, sliding_window: int):
        super().__init__(cfg, ops, tp, sliding_window=sliding_window)
        self.scale = cfg.attention_scale

    def _qk_norm(self, qkv: torch.Tensor) -> None:
        """qkv: [T, heads + 2 * kv_heads, hd]; normalises its q and k heads in place."""
        h, kv = self.num_heads, self.num_kv_heads
        qkv[:, :h] = gemma_rms_norm(qkv[:, :h], self.q_norm)
        qkv[:, h:h + kv] = gemma_rms_norm(qkv[:, h:h + kv], self.k_norm)


class GemmaMLP(GatedMLP):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x)) (HF `Gemma3MLP` with "gelu_pytorch_tanh", i.e. torch's gelu with
    approximate="tanh"), gate/up fused, column- then row-parallel as `GatedMLP`. Computed in torch: the ops have only
    SiLU's `silu_and_mul`. x: [T, hidden] -> [T, hidden]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.gelu(gate, approximate="tanh") * up))


class GemmaLayer(nn.Module):
    """One `Gemma3DecoderLayer`'s modules: attention and MLP, each between a pre- and a post-norm
    (`Model.forward` applies them)."""

    def __init__(self, cfg: ModelConfig, ops: AttentionOps, tp: TensorParallel, sliding_window: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GemmaAttention(cfg, ops, tp, sliding_window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GemmaMLP(cfg.hidden_size, cfg.intermediate_size, ops, tp)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


class Model(nn.Module):
    """Gemma 3's decoder and LM head (`engine.models.interface.CausalLM`), matching HF `Gemma3ForCausalLM`; under
    TP one rank's share, as `engine.models.decoder.DecoderModel`.

    Raises (constructor):
        ValueError: tp.size does not divide the heads (`engine.parallel.tensor_parallel.head_split`) or intermediate
        size.
    """

    CHECKPOINT: ClassVar[CheckpointNames] = CheckpointNames()

    def __init__(self, cfg: ModelConfig, ops: AttentionOps, tp: TensorParallel = SINGLE):
        super().__init__()
        self.cfg, self.ops, self.tp = cfg, ops, tp
        windows = cfg.layer_windows or (0,) * cfg.num_layers
        rows = vocab_per_rank(cfg.vocab_size, tp.size)  # this rank's slice of the vocabulary
        self.embed_tokens = nn.Embedding(rows, cfg.hidden_size)
        # HF keeps sqrt(hidden) as an fp32 tensor and casts it to the weights' dtype before multiplying (bf16 rounds
        # sqrt(3072) = 55.43 to 55.5); a buffer is cast with the module, so `forward` multiplies by the same value.
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5), persistent=False)
        self.layers = nn.ModuleList(GemmaLayer(cfg, ops, tp, w) for w in windows)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, rows, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        if cfg.rope_linear_factor is not None:
            self._scale_linearly(self.rope, cfg.rope_linear_factor)
        self.rope_local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                          cfg.rope_local_theta or cfg.rope_theta)

    @staticmethod
    def _scale_linearly(rope: RotaryEmbedding, factor: float) -> None:
        """HF rope_type "linear" (`_compute_linear_scaling_rope_parameters`): the plain inverse frequencies divided
        by `factor` (positions / factor), and the cos/sin tables rebuilt from them as `RotaryEmbedding` builds
        them."""
        inv_freq = rope.inv_freq / factor
        freqs = torch.outer(torch.arange(rope.cos.shape[0], dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        rope.inv_freq, rope.cos, rope.sin = inv_freq, emb.cos(), emb.sin()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
                on_layer_written: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids, positions: [T] int64; kv_layers[l] = layer l's (k_cache, v_cache). Returns the final-normed
        hidden states [T, hidden] in the model dtype (`Gemma3TextModel.forward`)."""
        h = vocab_parallel_embed(self.embed_tokens, input_ids, self.tp)
        h = h * self.embed_scale.to(h.dtype)
        full = self.rope.tables(positions, h.dtype)
        local = self.rope_local.tables(positions, h.dtype)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_layers)):
            rope = local if layer.self_attn.sliding_window else full
            attn = layer.self_attn(gemma_rms_norm(h, layer.input_layernorm), rope, meta, k_cache, v_cache)
            if on_layer_written is not None:
                on_layer_written(i)
            h = h + gemma_rms_norm(attn, layer.post_attention_layernorm)
            mlp = layer.mlp(gemma_rms_norm(h, layer.pre_feedforward_layernorm))
            h = h + gemma_rms_norm(mlp, layer.post_feedforward_layernorm)
        return gemma_rms_norm(h, self.norm)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in the model dtype, soft-capped as `Gemma3ForCausalLM.forward`
        does when `final_logit_softcapping` is set. Under TP every rank must call it (`vocab_parallel_logits`)."""
        logits = vocab_parallel_logits(self.lm_head, hidden, self.cfg.vocab_size, self.tp)
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Copy an HF Gemma 3 state dict in (names with or without `model.`; q/k/v and gate/up fused here),
        strictly, as `DecoderModel.load_weights`: every parameter supplied, every tensor consumed (a saved
        `lm_head.weight` is tolerated when the head is tied), cut to this rank's share under TP
        (`engine.models.sharding.shard`), shapes checked, nothing copied unless all check out.

        Raises:
            KeyError: a required tensor is missing (named).
            ValueError: unused tensors (listed, sorted) or a wrong shape.
        """
        w = StrictWeights(state)
        cfg = self.cfg
        params = {"embed_tokens.weight": w.take("embed_tokens.weight"), "norm.weight": w.take("norm.weight")}
        if cfg.tie_word_embeddings:
            params["lm_head.weight"] = params["embed_tokens.weight"]
            if "lm_head.weight" in state:  # a saved copy of the embedding
                w.consumed.add("lm_head.weight")
        else:
            params["lm_head.weight"] = w.take("lm_head.weight")
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
                params[f"{attn}qkv_proj.{kind}"] = torch.cat([w.take(f"{attn}{n}_proj.{kind}") for n in "qkv"])
            for name in ["o_proj.weight", "q_norm.weight", "k_norm.weight"] + (["o_proj.bias"] if cfg.o_bias else []):
                params[attn + name] = w.take(attn + name)
            params[mlp + "gate_up_proj.weight"] = torch.cat([w.take(mlp + "gate_proj.weight"),
                                                             w.take(mlp + "up_proj.weight")])
            params[mlp + "down_proj.weight"] = w.take(mlp + "down_proj.weight")
            for norm in _NORMS:
                params[f"{p}{norm}.weight"] = w.take(f"{p}{norm}.weight")
        w.copy_into(self, {name: shard(name, tensor, cfg, self.tp) for name, tensor in params.items()}, cfg.name)
