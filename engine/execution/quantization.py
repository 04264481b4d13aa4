"""Weight-only int8 and int4 quantization of the decoder's linear layers, for the memory-bound small-batch decode
regime.

A batch-1 decode step reads every weight once per token, so its time is the weights' bytes over memory bandwidth:
int8 weights halve bf16's bytes, int4 quarter them. The matmuls are torch's own packed-weight ops (CPU kernels in
ATen, activations in bf16/fp16), not kernels of ours:

- int8: `aten._weight_int8pack_mm`, one scale per output channel. Scales are symmetric with round-to-nearest, the
  scheme of gpt-fast's and torchao's int8 weight-only; they divide the absmax by 127.5 and clamp to [-128, 127], we
  divide by 127 so that no weight clamps.
- int4: `aten._weight_int4pack_mm_for_cpu`, asymmetric per group of `group_size` input channels (a scale and a
  zero point per group; gpt-fast's and torchao's int4 weight-only scheme, and llama.cpp's Q4_1 with group 32): a
  code q in [0, 15] stands for (q - 8) * scale + zero.

Measured on an AMD EPYC VM (1 thread, SmolLM2-135M's 211 linears streamed from DRAM at M = 1): packed bf16
11.2 ms, int8 9.9 ms, int4 5.7 ms. At M = 16 both quantized ops lose to the dense bf16 GEMM (gate/up 1536 x 576:
167-188 us against 106 us), so they are levers for low concurrency, chosen per worker with `--quantization` and
measured in bench/step_profile.py.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)  # what both packed ops take (their fp32 paths are slow)
INT4_GROUP_SIZES = (32, 64, 128, 256)
# aten._weight_int8pack_mm on CPU (torch 2.13) segfaults for 2 or more rows when in_features is not a multiple of 16
# (K = 8, 24, 40, 72, 104, 136 crashed at M = 2, 4, 5, 8, 16; every multiple of 16 ran): refused before it runs.
INT8_CPU_K_MULTIPLE = 16  # what aten._weight_int4pack_mm_for_cpu accepts
# The ops as torch's Python bindings (torch._C._VariableFunctions), not through torch.ops.aten's OpOverloadPacket,
# whose Python __call__ added about 0.4 us to each of a batch-1 step's 121 matmuls (AMD EPYC VM).
_INT8_MM = torch._weight_int8pack_mm
_INT4_MM = torch._weight_int4pack_mm_for_cpu


class _WeightOnlyLinear(nn.Module):
    """What the int8 and int4 layers share: x [..., in] -> [..., out], their packed CPU op on CPU (`_cpu_matmul`),
    elsewhere a dense matmul of the dequantized weight (`_dense_weight`), then the bias. Subclasses set
    in_features, out_features, bias and on_cpu."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.dim() == 2  # the model's rows: a batch-1 step makes 121 of these calls, each op's wrapping counts
        rows = x if flat else x.reshape(-1, self.in_features)
        y = self._cpu_matmul(rows.contiguous()) if self.on_cpu else F.linear(rows, self._dense_weight(rows.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y if flat else y.reshape(*x.shape[:-1], self.out_features)


class Int8WeightOnlyLinear(_WeightOnlyLinear):
    """y = x @ (W_q * s[:, None])^T + b, with W_q int8 [out, in] and s [out] in the activation dtype.

    Each weight is off by at most s / 2 from the original (round to nearest against the stored scale s; the
    largest may clamp at 127 by a hair more). x: [..., in] in bf16 or fp16 ->
    [..., out] in the same dtype. On CPU this runs `aten._weight_int8pack_mm`; elsewhere it dequantizes and
    runs a dense matmul (the same numbers, none of the speed: unverified on GPU).

    Args:
        linear: the layer to quantize (its weight is [out, in]; its bias, if any, is kept as it is).

    Raises:
        ValueError: the layer's dtype is not bf16 or fp16 (the op's fp32 path is a slow reference kernel), or on
            CPU its in_features is not a multiple of INT8_CPU_K_MULTIPLE.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.weight.dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"int8 weight-only quantization needs bf16 or fp16 weights and activations, got "
                             f"{linear.weight.dtype}; use --dtype bfloat16 (or auto on a CPU with bf16 units)")
        if linear.weight.device.type == "cpu" and linear.in_features % INT8_CPU_K_MULTIPLE:
            raise ValueError(f"int8 weight-only on CPU needs in_features divisible by {INT8_CPU_K_MULTIPLE}, got "
                             f"{linear.in_features}")
        w = linear.weight.detach().float()
        # Rounded to the activation dtype first, and the weights quantized with that scale: rounding against the
        # fp32 scale and then storing it in bf16 nearly doubled the worst error (127 steps x bf16's 2^-8).
        scale = (w.abs().amax(dim=1).clamp(min=1e-12) / 127.0).to(linear.weight.dtype)  # [out]
        q = torch.round(w / scale.float()[:, None]).clamp(-128, 127)
        # Plain attributes, not buffers (as engine.execution.packing's packed weights): a buffer is read through
        # nn.Module.__getattr__ on every call, about 0.5 us each, at 121 calls per batch-1 step. They are made on
        # the weight's device after loading and never move.
        self.weight_int8, self.scale = q.to(torch.int8), scale
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.on_cpu = linear.weight.device.type == "cpu"

    def _cpu_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return _INT8_MM(rows, self.weight_int8, self.scale)

    def _dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight_int8.to(dtype) * self.scale[:, None]


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 codes of `weight` ([out, in], bf16/fp16) per group of `group_size` input channels.

    Per group, scale = (max - min) / 15 and zero = min + 8 * scale, rounded to the weight's dtype first; each code is
    then rounded to nearest against the stored pair, so a weight is off by at most about scale / 2.

    Returns:
        codes: [out, in] uint8 in [0, 15], on the weight's device.
        scale_zero: [in / group_size, out, 2] in the weight's dtype (scale, zero), the layout of
            `aten._weight_int4pack_mm_for_cpu`.
    """
    out_features, in_features = weight.shape
    w = weight.float().view(out_features, in_features // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [out, groups]
    scale = ((hi - lo) / 15).clamp(min=1e-12).to(weight.dtype)
    zero = (lo + 8 * scale.float()).to(weight.dtype)
    codes = torch.round((w - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp(0, 15)
    scale_zero = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous()
    return codes.view(out_features, in_features).to(torch.uint8), scale_zero


def dequantize_int4(codes: torch.Tensor, scale_zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """The weight int4 codes stand for: codes [out, in] uint8, scale_zero as `quantize_int4` returns ->
    [out, in] fp32, (code - 8) * scale + zero."""
    out_features, in_features = codes.shape
    scale, zero = scale_zero.float().transpose(0, 1).unbind(-1)  # [out, groups] each
    w = (codes.float().view(out_features, -1, group_size) - 8) * scale[..., None] + zero[..., None]
    return w.view(out_features, in_features)


class Int4WeightOnlyLinear(_WeightOnlyLinear):
    """y = x @ W_deq^T + b, with W_deq[n, k] = (q[n, k] - 8) * scale[k // g, n] + zero[k // g, n], q in [0, 15] the
    codes of `quantize_int4` (g = `group_size`). x: [..., in] in bf16 or fp16 -> [..., out] in the same dtype.

    On CPU the codes are packed once (`aten._convert_weight_to_int4pack_for_cpu`) and the matmul is
    `aten._weight_int4pack_mm_for_cpu`, which dequantizes in fp32 and accumulates in fp32; elsewhere the codes are
    kept as uint8 and dequantized into a dense matmul (the same numbers, none of the speed: unverified on GPU).

    Args:
        linear: the layer to quantize (its weight is [out, in]; its bias, if any, is kept as it is).
        group_size: input channels per scale/zero pair: 32, 64, 128 or 256.

    Raises:
        ValueError: the layer is not bf16 or fp16 (the op's fp32 path is a slow reference kernel), an unsupported
            group size, in_features not a multiple of it, or out_features not a multiple of 16 (the packing).
    """

    def __init__(self, linear: nn.Linear, group_size: int = 32):
        super().__init__()
        dtype = linear.weight.dtype
        out_features, in_features = linear.weight.shape
        if dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"int4 weight-only quantization needs bf16 or fp16 weights and activations, got {dtype}; "
                             f"use --dtype bfloat16 (or auto on a CPU with bf16 units)")
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        if in_features % group_size or out_features % 16:
            raise ValueError(f"int4 weight-only needs in_features divisible by the group size {group_size} and "
                             f"out_features divisible by 16; this linear is [{out_features}, {in_features}]")
        codes, self.scale_zero = quantize_int4(linear.weight.detach(), group_size)
        self.group_size = group_size
        self.in_features, self.out_features = in_features, out_features
        self.on_cpu = linear.weight.device.type == "cpu"
        if self.on_cpu:
            codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)  # [out, in / 2]
        self.weight_int4 = codes  # plain attributes, as Int8WeightOnlyLinear's
        self.bias = linear.bias

    def _cpu_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return _INT4_MM(rows, self.weight_int4, self.group_size, self.scale_zero)

    def _dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int4(self.weight_int4, self.scale_zero, self.group_size).to(dtype)


def quantize_weight_only(model: nn.Module, method: str, group_size: int = 32) -> int:
    """Replace every `nn.Linear` under `model` (projections and LM head) by its weight-only quantized form, in place:
    `method` "int8" (`Int8WeightOnlyLinear`) or "int4" (`Int4WeightOnlyLinear` with `group_size`). A module that
    holds its weights otherwise (the stacked experts of `engine.models.moe.SparseMoE`) has a
    `quantize_weight_only(make)` method and quantizes what it chooses with `make` (nn.Linear -> quantized module).
    Returns how many linears were made. Embeddings and norms stay as they are.

    Raises:
        ValueError: an unknown method, or as the layer classes (a model not in bf16 / fp16, shapes int4 cannot
            pack).
    """
    if method not in ("int8", "int4"):
        raise ValueError(f"unknown weight-only quantization {method!r}; expected 'int8' or 'int4'")

    def make(linear: nn.Linear) -> nn.Module:
        return Int8WeightOnlyLinear(linear) if method == "int8" else Int4WeightOnlyLinear(linear, group_size)

    return _quantize(model, make)


def _quantize(module: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    if hasattr(module, "quantize_weight_only"):  # it holds its weights otherwise: it chooses what to quantize
        return module.quantize_weight_only(make)
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child))
            count += 1
        else:
            count += _quantize(child, make)
    return count
