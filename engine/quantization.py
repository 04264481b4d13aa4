"""Weight-only int8 quantization of the decoder's linear layers, for the memory-bound small-batch decode regime.

A batch-1 decode step reads every weight once per token, so its time is the weights' bytes over memory bandwidth:
int8 weights halve bf16's bytes. The matmul is torch's own packed-weight op, `aten._weight_int8pack_mm`
(int8 weights, one scale per output channel, activations in bf16/fp16; CPU kernel in ATen), not a kernel of ours.
Scales are symmetric per output channel with round-to-nearest, the scheme of gpt-fast's and torchao's
int8 weight-only; they divide the absmax by 127.5 and clamp to [-128, 127], we divide by 127 so that no weight
clamps.

At larger batches the op loses to the dense bf16 GEMM (one thread, SmolLM2's 1536 x 576 gate/up projection:
at M = 1 about 160 us against 470 us dense bf16; at M = 64 about 4.3 ms against 0.9 ms), so this is a lever for
low concurrency, chosen per worker with `--quantization int8` and measured in bench/step_profile.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

INT8_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)


class Int8WeightOnlyLinear(nn.Module):
    """y = x @ (W_q * s[:, None])^T + b, with W_q int8 [out, in] and s [out] in the activation dtype.

    Each weight is off by at most s / 2 from the original (round to nearest against the stored scale s; the
    largest may clamp at 127 by a hair more). x: [..., in] in bf16 or fp16 ->
    [..., out] in the same dtype. On CPU this runs `aten._weight_int8pack_mm`; elsewhere it dequantizes and
    runs a dense matmul (the same numbers, none of the speed: unverified on GPU).

    Args:
        linear: the layer to quantize (its weight is [out, in]; its bias, if any, is kept as it is).

    Raises:
        ValueError: the layer's dtype is not bf16 or fp16 (the op's fp32 path is a slow reference kernel).
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.weight.dtype not in INT8_ACTIVATION_DTYPES:
            raise ValueError(f"int8 weight-only quantization needs bf16 or fp16 weights and activations, got "
                             f"{linear.weight.dtype}; use --dtype bfloat16 (or auto on a CPU with bf16 units)")
        w = linear.weight.detach().float()
        # Rounded to the activation dtype first, and the weights quantized with that scale: rounding against the
        # fp32 scale and then storing it in bf16 nearly doubled the worst error (127 steps x bf16's 2^-8).
        scale = (w.abs().amax(dim=1).clamp(min=1e-12) / 127.0).to(linear.weight.dtype)  # [out]
        q = torch.round(w / scale.float()[:, None]).clamp(-128, 127)
        self.register_buffer("weight_int8", q.to(torch.int8))
        self.register_buffer("scale", scale)
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.device.type == "cpu":
            y = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), self.weight_int8, self.scale)
        else:
            y = F.linear(rows, self.weight_int8.to(rows.dtype) * self.scale[:, None])
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def quantize_int8_weight_only(model: nn.Module) -> int:
    """Replace every `nn.Linear` under `model` (projections and LM head) by an `Int8WeightOnlyLinear`, in place.
    Returns how many were replaced. Embeddings and norms stay as they are.

    Raises:
        ValueError: as `Int8WeightOnlyLinear` (a model not in bf16 / fp16).
    """
    count = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8WeightOnlyLinear(child))
            count += 1
        else:
            count += quantize_int8_weight_only(child)
    return count
