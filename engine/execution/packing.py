"""The linear layers' CPU forms, chosen at load: bf16 prepacked for oneDNN, fp32 small batches through our kernel.

bf16 (`PackedLinear`): the weights reordered once, at load, into oneDNN's blocked layout.

A plain `F.linear` on bf16 CPU tensors hands oneDNN the weights in PyTorch's [out, in] layout on every call, so
each call either reorders them or runs a kernel for the plain layout. Reordering once at load is what PyTorch's
own inductor does for CPU inference with freezing (`torch.ops.mkldnn._reorder_linear_weight` and
`torch.ops.mkldnn._linear_pointwise`, the ops used here).
Measured on this machine kind (1 thread, SmolLM2's seven projection shapes per layer, `bench/step_profile.py`'s
GEMM baseline): bf16 F.linear reaches 5.9 / 22.8 / 96 / 189 GFLOP/s at M = 1 / 4 / 16 / 64 rows, the packed op
10.5-11 / 41-46 / 150-165 / 290-440 (fp32 F.linear: 9.1 / 19.3 / 42 / 75; a packed fp32 weight did not pay).

fp32 (`SmallBatchLinear`): torch's fp32 linear runs a decode step's few rows poorly (a GEMV at about a third of
the machine's read bandwidth at M = 1, and from M = 2 a GEMM slower than that GEMV: by its timing it packs the
weight on every call), so up to `SMALL_BATCH_ROWS` rows go through the cpu backend's own kernel
(`kernels/cpu_linear.c`) over the same weight tensor, and larger batches (prefill chunks) through torch's GEMM. The
crossover was measured on the 2-core AMD EPYC VM (AVX2, 2 threads, every linear of SmolLM2-135M once, distinct
weights streamed from DRAM, `bench/small_linear.py`): the kernel ran 1.3-2.8x torch's speed from M = 1 to 32,
1.2-1.3x at 64, about even at 128 (1.04x) and slower at 256 (0.86x), so up to 64 rows (a decode step's at the
default --max-num-seqs) take it.

CPU only; anything else keeps `nn.Linear`. Unverified on GPU by construction: never applied there.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

SMALL_BATCH_ROWS = 64  # most rows a SmallBatchLinear sends to its kernel (the crossover in the module docstring)


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


class SmallBatchLinear(nn.Module):
    """y = x @ W^T + b in fp32 on CPU: up to `SMALL_BATCH_ROWS` rows through `small_m` (the cpu backend's kernel),
    more through torch's GEMM, both on nn.Linear's own weight tensor (no copy). x: [..., in] fp32 -> [..., out] fp32.

    Numerics: fp32 with fp32 accumulation either way; the kernel sums in another order than torch's GEMM, so results
    differ from F.linear in the last bits.

    Args:
        linear: a loaded fp32 `nn.Linear` on CPU (weight [out, in]).
        small_m: (x [M, in], weight [out, in], bias [out] | None) -> [M, out]
        (`kernels.AttentionOps.small_batch_linear`).
    """

    def __init__(self, linear: nn.Linear, small_m: Callable[..., torch.Tensor]):
        super().__init__()
        # Plain attributes, not parameters (as PackedLinear's): read on every call, and never moved after load.
        self.weight = linear.weight.detach()
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._small_m = small_m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if rows.shape[0] <= SMALL_BATCH_ROWS:
            y = self._small_m(rows, self.weight, self.bias)
        else:
            y = F.linear(rows, self.weight, self.bias)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)


def pack_linears(model: nn.Module, small_batch_linear: Callable[..., torch.Tensor] | None = None) -> int:
    """Replace the CPU `nn.Linear`s under `model` (projections and LM head), in place: bf16 ones by a `PackedLinear`
    where oneDNN packs bf16, fp32 ones by a `SmallBatchLinear` over `small_batch_linear` when one is given (the cpu
    backend's). Returns how many were replaced; the others are left as they are."""
    count = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear) and packing_supported(child.weight.device, child.weight.dtype):
            setattr(model, name, PackedLinear(child))
            count += 1
        elif (isinstance(child, nn.Linear) and small_batch_linear is not None and child.weight.device.type == "cpu"
              and child.weight.dtype == torch.float32):
            setattr(model, name, SmallBatchLinear(child, small_batch_linear))
            count += 1
        else:
            count += pack_linears(child, small_batch_linear)
    return count
