"""The shared pre-norm decoder (embedding, N x [attention, MLP], final norm, LM head) that serves every registered
architecture, switched by `engine.models.config.ModelConfig` (from `engine.models.interface.ArchFlags`), and its strict
weight loader."""
from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from pdserve_server.engine.attention import AttentionMetadata
from pdserve_server.engine.models.config import ModelConfig
from pdserve_server.engine.models.interface import CheckpointNames
from pdserve_server.engine.models.layers import Attention, GatedMLP, RMSNorm, RotaryEmbedding
from pdserve_server.engine.models.moe import SparseMoE
from pdserve_server.engine.models.sharding import shard, vocab_parallel_embed, vocab_parallel_logits, vocab_per_rank
from pdserve_server.engine.parallel.tensor_parallel import SINGLE, TensorParallel
from pdserve_server.kernels.backends import AttentionOps


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block; `DecoderModel.forward` applies it (the residual adds live there). The MLP is
    the routed `SparseMoE` on the layers `cfg.moe.sparse_layers` names, else a dense `GatedMLP`; the attention
    slides over the window `cfg.layer_windows[index]` (0 or no `layer_windows`: full attention)."""

    def __init__(self, cfg: ModelConfig, ops: AttentionOps, index: int, tp: TensorParallel):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        window = cfg.layer_windows[index] if cfg.layer_windows is not None else 0
        self.self_attn = Attention(cfg, ops, tp, sliding_window=window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (SparseMoE(cfg.hidden_size, cfg.moe, ops, tp)
                               if cfg.moe is not None and index in cfg.moe.sparse_layers
                               else GatedMLP(cfg.hidden_size, cfg.intermediate_size, ops, tp))


class StrictWeights:
    """An HF state dict read strictly: names with or without the `model.` prefix, every read recorded, so
    `unused()` can list what no parameter took (an architecture mismatch)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state
        self.consumed: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.state or "model." + name in self.state

    def take(self, name: str) -> torch.Tensor:
        """Raises: KeyError naming the tensor when neither `name` nor `model.<name>` is present."""
        for key in (name, "model." + name):
            if key in self.state:
                self.consumed.add(key)
                return self.state[key]
        raise KeyError(f"missing tensor {name!r} (nor 'model.{name}') in the state dict")

    def fused(self, names: list[str], whole: str, dim: int = 0) -> torch.Tensor:
        """The checkpoint's own fused tensor `whole` when it has one (Phi-3 stores q/k/v and gate/up fused, in our
        order), else `names` concatenated along `dim`."""
        if self.has(whole):
            return self.take(whole)
        return torch.cat([self.take(n) for n in names], dim=dim)

    def unused(self) -> list[str]:
        """Tensors nobody took, sorted; `*.rotary_emb.inv_freq` buffers are tolerated (RoPE is recomputed)."""
        return sorted(k for k in self.state if k not in self.consumed and not k.endswith("rotary_emb.inv_freq"))

    def copy_into(self, module: nn.Module, params: dict[str, torch.Tensor], model_name: str) -> None:
        """The end of a strict load: `params` (our parameter names -> tensors taken from here, already cut to the
        rank's share) are checked against the checkpoint (nothing left unused) and against `module`'s parameters
        (the same names and shapes), then copied in, cast to each parameter's dtype; nothing is copied unless all
        of it checks out.

        Raises:
            ValueError: checkpoint tensors were not consumed (listed, sorted), or a tensor has the wrong shape.
            RuntimeError: `params` and the module's parameters name different sets (a loader bug).
        """
        unused = self.unused()
        if unused:
            more = f" and {len(unused) - 10} more" if len(unused) > 10 else ""
            raise ValueError(f"{len(unused)} unused tensor(s) in the state dict (architecture mismatch with "
                             f"{model_name!r}?): {', '.join(unused[:10])}{more}")
        own = dict(module.named_parameters())
        if own.keys() != params.keys():  # the loader and the module tree disagree: a bug here, not in the checkpoint
            raise RuntimeError(f"loader/module mismatch: {sorted(own.keys() ^ params.keys())}")
        for name, tensor in params.items():
            if own[name].shape != tensor.shape:
                raise ValueError(f"{name}: expected shape {tuple(own[name].shape)}, got {tuple(tensor.shape)}")
        with torch.no_grad():
            for name, tensor in params.items():
                own[name].copy_(tensor.to(own[name].dtype))


class DecoderModel(nn.Module):
    """The decoder stack plus LM head (see `engine.models.interface.CausalLM` for the contract).

    forward() takes one packed step (tokens of many sequences concatenated) and the per-layer paged KV cache
    views; it writes the step's K/V into the cache and returns hidden states. Use `load_weights` to fill it from
    an HF state dict. `ops` are the paged attention ops (`kernels.backends.select_ops`). `CHECKPOINT` says how the
    checkpoint names the MLP tensors; an architecture with other names subclasses this and sets it.

    With tensor parallelism (`tp.size` > 1) this is one rank's share (`engine.models.sharding` says which
    parameters split how): every rank runs forward on the same inputs, and the collectives inside leave every rank
    with the same hidden states and, from `compute_logits`, the same full logits.

    Raises (constructor):
        ValueError: tp.size does not divide the heads, kv heads or intermediate sizes (the message names which).
    """

    CHECKPOINT: ClassVar[CheckpointNames] = CheckpointNames()

    def __init__(self, cfg: ModelConfig, ops: AttentionOps, tp: TensorParallel = SINGLE):
        super().__init__()
        self.cfg, self.ops, self.tp = cfg, ops, tp
        rows = vocab_per_rank(cfg.vocab_size, tp.size)  # this rank's slice of the vocabulary
        self.embed_tokens = nn.Embedding(rows, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, rows, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_llama3)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
                on_layer_written: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids, positions: [T] int64. kv_layers[l] = (k_cache, v_cache) of layer l. Returns [T, hidden].
        on_layer_written(l) is called as soon as layer l's attention has written the step's K/V (before its MLP),
        for layer-wise KV streaming."""
        # h is the residual stream; each norm adds the previous sublayer's output into it in place first (vLLM's
        # fused_add_rms_norm), the same sums as h = h + sublayer(norm(h)) in fewer ops.
        h = vocab_parallel_embed(self.embed_tokens, input_ids, self.tp)
        rope = self.rope.tables(positions, h.dtype)
        rms_norm = self.ops.rms_norm
        norms = [layer.input_layernorm for layer in self.layers] + [self.norm]  # norms[i + 1] follows layer i
        x = rms_norm(h, norms[0].weight, norms[0].eps)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_layers)):
            attn = layer.self_attn(x, rope, meta, k_cache, v_cache)
            if on_layer_written is not None:
                on_layer_written(i)
            post = layer.post_attention_layernorm
            x = layer.mlp(rms_norm(attn, post.weight, post.eps, h))
            x = rms_norm(x, norms[i + 1].weight, norms[i + 1].eps, h)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in the model's dtype. Not widened to fp32 here: the greedy argmax
        reads bf16 as it is (widening is exact, so the argmax is the same), and only the rows that need fp32
        (penalties, temperature, logprobs) are widened, by the sampler. At 64 rows x 49152 the widening of every row
        was 1.2 ms of a 41 ms bf16 decode step (Intel Xeon VM, 2 threads). Under TP every rank must call it (the
        vocab-parallel logits are all-gathered, the padding columns cut off)."""
        return vocab_parallel_logits(self.lm_head, hidden, self.cfg.vocab_size, self.tp)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Copy an HF state dict (q/k/v and gate/up separate or fused; names with or without the `model.` prefix)
        into the fused modules, strictly: every parameter must be supplied and every tensor consumed, so a
        checkpoint whose architecture differs from `cfg` (e.g. Qwen2 q/k/v biases on a bias-free config, Qwen3
        q_norm / k_norm weights on a config without `qk_norm`, experts on a dense config) fails instead of loading
        into wrong numerics. Tolerated leftovers: `*.rotary_emb.inv_freq` buffers (RoPE is recomputed) and
        `lm_head.weight` when `cfg.tie_word_embeddings` (the head is the embedding). Experts are read per expert
        (`mlp.experts.E.gate_proj.weight`, as checkpoints store them) or stacked (`mlp.experts.gate_up_proj`, as HF
        >= 5 holds them in memory). Under TP each full tensor is cut to this rank's share
        (`engine.models.sharding.shard`). Nothing is copied unless the whole state dict checks out.

        Raises:
            KeyError: a required tensor is missing (the message names it).
            ValueError: tensors were not consumed (the message lists them, sorted), or a tensor has the wrong shape.
        """
        w = StrictWeights(state)
        cfg = self.cfg
        params: dict[str, torch.Tensor] = {
            "embed_tokens.weight": w.take("embed_tokens.weight"),
            "norm.weight": w.take("norm.weight"),
        }
        if cfg.tie_word_embeddings:
            params["lm_head.weight"] = params["embed_tokens.weight"]
            if "lm_head.weight" in state:  # saved copy of the embedding
                w.consumed.add("lm_head.weight")
        else:
            params["lm_head.weight"] = w.take("lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            params.update(self._attention_weights(w, p))
            if isinstance(layer.mlp, SparseMoE):
                params.update(self._moe_weights(w, p))
            else:
                mlp = p + "mlp."
                params[mlp + "gate_up_proj.weight"] = w.fused([mlp + "gate_proj.weight", mlp + "up_proj.weight"],
                                                              mlp + "gate_up_proj.weight")
                params[mlp + "down_proj.weight"] = w.take(mlp + "down_proj.weight")
            params[p + "input_layernorm.weight"] = w.take(p + "input_layernorm.weight")
            params[p + "post_attention_layernorm.weight"] = w.take(p + "post_attention_layernorm.weight")

        w.copy_into(self, {name: shard(name, tensor, cfg, self.tp) for name, tensor in params.items()}, cfg.name)

    def _attention_weights(self, w: StrictWeights, p: str) -> dict[str, torch.Tensor]:
        """Layer prefix `p`'s attention parameters (our names) from the checkpoint."""
        cfg, attn = self.cfg, p + "self_attn."
        out = {}
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            out[f"{attn}qkv_proj.{kind}"] = w.fused([f"{attn}{n}_proj.{kind}" for n in "qkv"], f"{attn}qkv_proj.{kind}")
        out[attn + "o_proj.weight"] = w.take(attn + "o_proj.weight")
        if cfg.o_bias:
            out[attn + "o_proj.bias"] = w.take(attn + "o_proj.bias")
        if cfg.qk_norm:
            out[attn + "q_norm.weight"] = w.take(attn + "q_norm.weight")
            out[attn + "k_norm.weight"] = w.take(attn + "k_norm.weight")
        return out

    def _moe_weights(self, w: StrictWeights, p: str) -> dict[str, torch.Tensor]:
        """Layer prefix `p`'s router and stacked experts (our names `mlp.gate.weight`, `mlp.experts.gate_up_proj`
        [E, 2I, hidden], `mlp.experts.down_proj` [E, hidden, I]) from the checkpoint's names (`CHECKPOINT`)."""
        names, ours = self.CHECKPOINT, p + "mlp."
        src = f"{p}{names.mlp}."
        out = {ours + "gate.weight": w.take(f"{src}{names.router}.weight")}
        if w.has(src + "experts.gate_up_proj"):
            out[ours + "experts.gate_up_proj"] = w.take(src + "experts.gate_up_proj")
            out[ours + "experts.down_proj"] = w.take(src + "experts.down_proj")
            return out
        gate, up, down = names.experts
        experts = range(self.cfg.moe.num_experts)
        out[ours + "experts.gate_up_proj"] = torch.stack([
            torch.cat([w.take(f"{src}experts.{e}.{gate}.weight"), w.take(f"{src}experts.{e}.{up}.weight")])
            for e in experts])
        out[ours + "experts.down_proj"] = torch.stack([w.take(f"{src}experts.{e}.{down}.weight") for e in experts])
        return out
