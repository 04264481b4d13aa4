"""The all-decode step's layer loop in one C++ call on CPU: what CUDA graphs (`engine.execution.cuda_graphs`) do for a
GPU.

Why: at batch 1 a decode step of a small model is ~10 op calls per layer, and on a CPU each costs Python dispatch
on top of its arithmetic. Measured with `bench/step_profile.py` (SmolLM2-135M, bf16, 2 threads, AMD EPYC with
AVX512-BF16): 20% of a 9.4 ms step was Python between the ops, more than the attention. The cpu backend's
`pdserve::decode_layers` (kernels/cpu_ops.cpp) runs every layer's ops, the same ops in the same order, from C++.

Which steps: all-decode steps (no prefill chunk, no n-gram drafts, no layer-wise KV streaming) of a dense
pre-norm decoder (`engine.models.decoder.DecoderModel`'s own forward: Llama, Mistral, Qwen2, Phi-3) without tensor
parallelism, sliding windows per layer allowed, whose linears are all one CPU form: `engine.execution.packing`'s (oneDNN
prepacked bf16, or fp32 through the small-batch kernel), `engine.execution.quantization`'s (int8, int4) or plain
`nn.Linear`. Everything else runs the model's forward (`CpuDecodeStack.build` returns None for a model it cannot run).

Three forms take a second op, `pdserve::decode_layers_fused`: bf16 packed linears whose layout the cpu backend's kernel
reads (`PackedLinear.weight_ptr`) up to `PACKED_GEMV_ROWS` sequences, fp32 through the small-batch kernel up to
`SMALL_BATCH_ROWS` (reading GGUF blocks instead when every linear holds them alike: `SmallBatchLinear.blocks`), and
`--quantization w8a8_int8`'s int8 GEMM (`SmallBatchLinear.int8`) at any rows (one row stays on the blocks). The same
ops again, but the whole step in one OpenMP region, the threads meeting at a barrier between ops instead of starting and
joining a region for each of ~270 ops (kernels/cpu_decode_step.c). Its linears are the forward's own kernels at those
rows, so the logits stay bit-equal to the model's forward. Past those rows (more than `--max-num-seqs`'s default
64 sequences decoding) fp32 linears take torch's GEMM here, where the forward on an AVX2 CPU reads GGUF blocks at any
row count (`SmallBatchLinear`, `blocks_prefill`): those steps' logits differ from the forward's in the last bits.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pdserve_server.engine.attention import AttentionMetadata
from pdserve_server.engine.models.decoder import DecoderModel
from pdserve_server.engine.execution.packing import (PACKED_GEMV_ROWS, SMALL_BATCH_ROWS, PackedLinear,
                                                    SmallBatchLinear, blocks_format)
from pdserve_server.engine.execution.quantization import Int4WeightOnlyLinear, Int8WeightOnlyLinear
from pdserve_server.kernels.backends import AttentionOps

# `pdserve::decode_layers`'s linear_form (kernels/cpu_ops.cpp).
TORCH_LINEAR, PACKED_LINEAR, SMALL_M_LINEAR, INT8_LINEAR, INT4_LINEAR = 0, 1, 2, 3, 4
_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
# `pdserve::decode_layers_fused`'s weight_blocks (kernels/cpu_kernels.h: PDSERVE_Q4_1, PDSERVE_Q8_0,
# PDSERVE_Q8_ACTIVATIONS added for SmallBatchLinear.q8_activations, and PDSERVE_W8A8 for SmallBatchLinear.int8).
PLAIN_WEIGHTS, Q4_1_BLOCKS, Q8_0_BLOCKS, Q8_ACTIVATIONS, W8A8_WEIGHTS = 0, 1, 2, 4, 8


_WEIGHT_BLOCKS = {"q4_1": Q4_1_BLOCKS, "q8_0": Q8_0_BLOCKS}


def _blocks_format(module: SmallBatchLinear) -> int | None:
    """The weight_blocks of the GGUF blocks a SmallBatchLinear holds its weight in as well (with Q8_ACTIVATIONS when
    it computes one row in 8 bits), or None."""
    if module.blocks is None:
        return None
    return _WEIGHT_BLOCKS[blocks_format(module.blocks)] | (Q8_ACTIVATIONS if module.q8_activations else 0)


def _linear(module: nn.Module) -> tuple[int, torch.Tensor, torch.Tensor | None] | None:
    """(form, weight, aux) of one projection as `pdserve::decode_layers` takes it, or None for one it does not
    apply: aux is the int8 scales or the int4 scales and zeros, else None."""
    if isinstance(module, PackedLinear):
        return PACKED_LINEAR, module.packed_weight, None
    if isinstance(module, SmallBatchLinear):
        return SMALL_M_LINEAR, module.weight, None
    if isinstance(module, Int8WeightOnlyLinear) and module.on_cpu:
        return INT8_LINEAR, module.weight_int8, module.scale
    if isinstance(module, Int4WeightOnlyLinear) and module.on_cpu:
        return INT4_LINEAR, module.weight_int4, module.scale_zero
    if type(module) is nn.Linear:
        return TORCH_LINEAR, module.weight.detach(), None
    return None


class CpuDecodeStack:
    """A model's decoder layers as one `pdserve::decode_layers` call per all-decode step. Holds the model's own
    weight tensors (no copy). Get one with `build`."""

    def __init__(self, model: DecoderModel, decode_layers: Callable[..., torch.Tensor], form: int,
                 linears: list[tuple[nn.Module, torch.Tensor, torch.Tensor | None]],
                 fused_step: Callable[..., torch.Tensor] | None = None):
        self.model, self._decode_layers, self.form = model, decode_layers, form
        layers = model.layers
        # 4 a layer, in _LINEARS order
        self.linear_weights = [weight for _, weight, _ in linears]
        self.linear_aux = [aux for _, _, aux in linears]
        self.linear_biases = [None if m.bias is None else m.bias.detach() for m, _, _ in linears]
        self.post_norm = [layer.post_attention_layernorm.weight.detach() for layer in layers]
        # Layer l's MLP output is added into the residual and normalised by the next layer's input norm (the final
        # norm after the last layer), as DecoderModel.forward does.
        self.next_norm = [layer.input_layernorm.weight.detach() for layer in layers[1:]] + [model.norm.weight.detach()]
        self.first_norm = layers[0].input_layernorm.weight.detach()
        self.windows = [layer.self_attn.sliding_window for layer in layers]
        self.eps, self.scale = model.cfg.rms_norm_eps, layers[0].self_attn.scale
        # The one-region step (None where it does not apply) and the most rows it takes: bf16 linears all read in
        # place by the backend's packed-layout kernel, or fp32 ones through its small-batch kernel.
        self._fused_step, self._fused_rows, self.weight_blocks, self.scale_ptrs = None, 0, PLAIN_WEIGHTS, []
        modules = [m for m, _, _ in linears]
        formats = {_blocks_format(m) for m in modules} if form == SMALL_M_LINEAR else {None}
        if fused_step is not None and form == PACKED_LINEAR and all(m.weight_ptr for m in modules):
            self._fused_step, self._fused_rows = fused_step, PACKED_GEMV_ROWS
            self.weight_ptrs = [m.weight_ptr for m in modules]
            self.padded_k = [m.padded_k for m in modules]
        elif fused_step is not None and len(formats) == 1 and None not in formats:
            # Every linear held as blocks of one GGUF format too: the step reads those (the same weights, fewer bytes).
            self._fused_step, self._fused_rows, self.weight_blocks = fused_step, SMALL_BATCH_ROWS, formats.pop()
            self.weight_ptrs = [m.blocks[0].data_ptr() for m in modules]
            self.scale_ptrs = [m.blocks[1].data_ptr() for m in modules]
            self.padded_k = [m.in_features for m in modules]
        elif fused_step is not None and form == SMALL_M_LINEAR and all(w.is_contiguous() for w in self.linear_weights):
            self._fused_step, self._fused_rows = fused_step, SMALL_BATCH_ROWS
            self.weight_ptrs = [w.data_ptr() for w in self.linear_weights]
            self.padded_k = [m.in_features for m in modules]
        # `--quantization w8a8_int8` (SmallBatchLinear.int8 on every linear; `build` leaves mixed forms to the
        # forward): the one-region step through the int8 GEMM at any rows, as the forward computes them, but one row
        # where the weights are held as blocks (the forward reads those there with 8-bit rows: fewer bytes than 8 bits
        # a weight).
        self._w8a8_ptrs: tuple[list[int], list[int]] | None = None
        self._w8a8_one_row = self.weight_blocks == PLAIN_WEIGHTS
        if fused_step is not None and form == SMALL_M_LINEAR and modules[0].int8 is not None:
            self._w8a8_ptrs = ([m.int8[1].data_ptr() for m in modules], [m.int8[2].data_ptr() for m in modules])
            self._fused_step, self.padded_k = fused_step, [m.in_features for m in modules]
        if self._fused_step is not None:
            self.num_heads = layers[0].self_attn.num_heads
            self.intermediate = modules[2].out_features // 2  # gate_up's width: gate and up side by side

    @classmethod
    def build(cls, model: nn.Module, ops: AttentionOps) -> CpuDecodeStack | None:
        """The C++ loop over `model`'s layers, or None when it cannot run them (see the module docstring): another
        backend than "cpu", a model with its own forward, tensor parallelism, MoE or Qwen3's q/k norms, linears of
        mixed forms or of a form it does not know, or no layers."""
        if (ops.decode_layers is None or not isinstance(model, DecoderModel)
                or type(model).forward is not DecoderModel.forward or model.tp.size > 1 or model.cfg.moe is not None
                or model.cfg.qk_norm or not len(model.layers)):
            return None
        modules = [layer.get_submodule(name) for layer in model.layers for name in _LINEARS]
        found = [_linear(m) for m in modules]
        forms = {f[0] if f is not None else None for f in found}
        if len(forms) != 1 or None in forms:
            return None
        int8 = {getattr(m, "int8", None) is not None for m in modules}
        if int8 == {True, False} or (True in int8 and (len({_blocks_format(m) for m in modules}) > 1
                                                       or ops.decode_layers_fused is None)):
            return None  # int8 GEMMs on some linears, blocks of mixed forms beside them, or no one-region step
        return cls(model, ops.decode_layers, forms.pop(), [(m, w, aux) for m, (_, w, aux) in zip(modules, found)],
                   ops.decode_layers_fused)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_layers: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """`DecoderModel.forward` of an all-decode step (meta.num_prefills == 0): input_ids, positions [B] int64;
        returns the final-normalised hidden states [B, hidden] in the model's dtype. Writes the step's K/V into
        kv_layers as forward does.

        Raises:
            ValueError: from the op's checks (a slot outside the cache, a context longer than its block table row,
                mismatched shapes or dtypes), with nothing further computed.
        """
        model = self.model
        with torch.inference_mode():
            h = model.embed_tokens(input_ids)
            cos, sin = model.rope.tables(positions, h.dtype)
            x = model.ops.rms_norm(h, self.first_norm, self.eps)
            # fp32's small-batch kernel takes up to SMALL_BATCH_ROWS rows; beyond, torch's GEMM on the same weights
            # (SmallBatchLinear's own rule but for blocks_prefill: the module docstring).
            form = TORCH_LINEAR if self.form == SMALL_M_LINEAR and x.shape[0] > SMALL_BATCH_ROWS else self.form
            fused = None
            if self._w8a8_ptrs is not None and (x.shape[0] > 1 or self._w8a8_one_row):
                fused = (*self._w8a8_ptrs, W8A8_WEIGHTS)
            elif self._fused_step is not None and x.shape[0] <= self._fused_rows:
                fused = (self.weight_ptrs, self.scale_ptrs, self.weight_blocks)
            if fused is not None:
                weight_ptrs, scale_ptrs, weight_blocks = fused
                return self._fused_step(
                    h, x, cos, sin, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
                    [k for k, _ in kv_layers], [v for _, v in kv_layers], weight_ptrs, self.padded_k,
                    self.linear_biases, self.post_norm, self.next_norm, self.windows, self.num_heads,
                    self.intermediate, self.eps, self.scale, weight_blocks, scale_ptrs)
            return self._decode_layers(
                h, x, cos, sin, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
                [k for k, _ in kv_layers], [v for _, v in kv_layers], self.linear_weights, self.linear_aux,
                self.linear_biases, self.post_norm, self.next_norm, self.windows, form, self.eps, self.scale)
