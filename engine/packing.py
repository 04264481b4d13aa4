"""Prepacked bf16 linear layers on CPU: the weights reordered once, at load, into oneDNN's blocked layout.

A plain `F.linear` on bf16 CPU tensors hands oneDNN the weights in PyTorch's [out, in] layout on every call, so
each call either reorders them or runs a kernel for the plain layout. Reordering once at load is what PyTorch's
own inductor does for CPU inference with freezing (`torch.ops.mkldnn._reorder_linear_weight` and
`torch.ops.mkldnn._linear_pointwise`, the ops used here).
Measured on this machine kind (1 thread, SmolLM2's seven projection shapes per layer, `bench/step_profile.py`'s
GEMM baseline): bf16 F.linear reaches 5.9 / 22.8 / 96 / 189 GFLOP/s at M = 1 / 4 / 16 / 64 rows, the packed op
10.5-11 / 41-46 / 150-165 / 290-440 (fp32 F.linear: 9.1 / 19.3 / 42 / 75; a packed fp32 weight did not pay).

CPU only, bf16 only; anything else keeps `nn.Linear`. Unverified on GPU by construction: never applied there.
"""
from __future__ import annotations

import torch
from torch import nn


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """True where `PackedLinear` applies: CPU, bf16, and a oneDNN build with bf16 support on this CPU."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """y = x @ W^T + b with W held in oneDNN's blocked layout. x: [..., in] bf16 -> [..., out] bf16.

    The packed weight is an opaque oneDNN tensor (not a state-dict entry): pack after the weights are loaded.
    Numerics are oneDNN's bf16 GEMM (fp32 accumulation, one rounding to bf16), as `F.linear` on CPU.

    Args:
        linear: a loaded bf16 `nn.Linear` on CPU (weight [out, in]).

    Raises:
        ValueError: the layer is not bf16 on CPU.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        if not packing_supported(w.device, w.dtype):
            raise ValueError(f"packed linears need bf16 weights on CPU with oneDNN bf16 support, got {w.dtype} on "
                             f"{w.device}")
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Replace every bf16 CPU `nn.Linear` under `model` (projections and LM head) by a `PackedLinear`, in place.
    Returns how many were replaced; layers where packing does not apply are left as they are."""
    count = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear) and packing_supported(child.weight.device, child.weight.dtype):
            setattr(model, name, PackedLinear(child))
            count += 1
        else:
            count += pack_linears(child)
    return count
