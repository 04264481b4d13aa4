"""Routed mixture-of-experts MLP (Mixtral, Qwen3-MoE): a linear router, softmax, top-k, and SiLU-gated experts run
grouped: the step's (token, expert) assignments are sorted by expert so each active expert does one GEMM over all
of its tokens, not one per token.

Numerics follow HF transformers' `MixtralSparseMoeBlock` / `Qwen3MoeSparseMoeBlock` (softmax in fp32, top-k, optional
renormalisation, each expert's output scaled by its weight and summed per token in ascending expert order), so greedy
output equals HF's in fp32.

Weight-only int8 / int4 (`engine.execution.quantization`): each expert's two projections become quantized linears of
their own (`Experts.quantize`); the router stays in the model dtype (its choices are discrete, a rounding can flip them;
vLLM leaves the gate unquantized as well).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve_server.engine.models.interface import MoEConfig
from pdserve_server.engine.parallel.tensor_parallel import SINGLE, TensorParallel
from pdserve_server.kernels.backends import AttentionOps


class Experts(nn.Module):
    """The experts' weights, stacked as HF >= 5 keeps them in memory (so they can be split across ranks along the
    expert or the intermediate dimension): gate_up_proj [E, 2 * I, hidden] (gate rows first, then up) and
    down_proj [E, hidden, I], in the model dtype; after `quantize`, one quantized linear per expert and projection
    instead. `gate_up` and `down` apply expert e either way."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        for p in (self.gate_up_proj, self.down_proj):
            nn.init.normal_(p, std=0.02)  # random-weight engines (tests) need finite values
        self.quantized: nn.ModuleList | None = None  # [E] of ModuleList([gate_up, down]) after `quantize`

    def gate_up(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] -> [n, 2 * I] (gate, then up), expert e; x's dtype."""
        return self.quantized[e][0](x) if self.quantized is not None else F.linear(x, self.gate_up_proj[e])

    def down(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """h [n, I] -> [n, hidden], expert e; h's dtype."""
        return self.quantized[e][1](h) if self.quantized is not None else F.linear(h, self.down_proj[e])

    def quantize(self, make: Callable[[nn.Linear], nn.Module]) -> int:
        """Replace the stacked weights by `make(linear)` of each expert's gate_up and down projection (weight-only
        int8 / int4 from `engine.execution.quantization`); the stacked tensors are dropped. Returns the linears made (2
        E).

        Raises:
            ValueError: from `make` (a float32 model, shapes int4 cannot pack).
        """
        def linear(weight: torch.Tensor) -> nn.Linear:
            out_features, in_features = weight.shape
            layer = nn.Linear(in_features, out_features, bias=False, device="meta")
            layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
            return layer

        self.quantized = nn.ModuleList(nn.ModuleList([make(linear(gu)), make(linear(d))])
                                       for gu, d in zip(self.gate_up_proj, self.down_proj))
        del self.gate_up_proj, self.down_proj
        return 2 * len(self.quantized)


class SparseMoE(nn.Module):
    """Router (`gate`: hidden -> num_experts, no bias) plus `experts`. x: [T, hidden] -> [T, hidden].

    Raises (constructor): ValueError when tp.size does not divide the experts' intermediate size.

    The grouping reads the per-expert token counts on the host (one sync a layer): cheap on a CPU, a stall on a
    GPU, where a fused MoE kernel (vLLM's `fused_moe`) would take over; decode steps of an MoE model are therefore
    not captured in CUDA graphs (`engine.execution.model_runner`).
    """

    def __init__(self, hidden_size: int, moe: MoEConfig, ops: AttentionOps, tp: TensorParallel = SINGLE):
        super().__init__()
        self.ops, self.tp = ops, tp
        self.num_experts, self.top_k, self.norm_topk_prob = moe.num_experts, moe.top_k, moe.norm_topk_prob
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)  # replicated: every rank routes alike
        # Tensor parallelism splits every expert's intermediate features (each rank runs every expert on its
        # share, then one all-reduce), not the experts themselves: the load stays even however tokens route.
        local = tp.split(moe.intermediate_size, "moe_intermediate_size")
        self.experts = Experts(moe.num_experts, hidden_size, local)

    def quantize_weight_only(self, make: Callable[[nn.Linear], nn.Module]) -> int:
        """`engine.execution.quantization.quantize_weight_only`'s hook: the experts are quantized, the router is not
        (see the module docstring). Returns the linears made."""
        return self.experts.quantize(make)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (weights [T, top_k] in x's dtype, experts [T, top_k] int64), HF's router: softmax of the
        router logits in fp32, the top_k, renormalised to sum 1 when `norm_topk_prob`."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        flat = experts.flatten()  # assignment a = token * top_k + slot
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, tokens ascending within
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        rows = x[tokens]  # [T * top_k, hidden]: each token once per expert it was routed to
        out_rows = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n:
                h = self.ops.silu_and_mul(self.experts.gate_up(e, rows[start:start + n]))
                out_rows[start:start + n] = self.experts.down(e, h)
            start += n
        out_rows *= weights.flatten()[order].unsqueeze(1)
        # One index_add over expert-sorted rows: each token's contributions are summed in ascending expert order,
        # as HF's per-expert loop does.
        return self.tp.all_reduce(torch.zeros_like(x).index_add_(0, tokens, out_rows))
