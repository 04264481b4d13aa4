"""Routed mixture-of-experts MLP (Mixtral, Qwen3-MoE): a linear router, softmax, top-k, and SiLU-gated experts run
grouped: the step's (token, expert) assignments are sorted by expert so each active expert does one GEMM over all
of its tokens, not one per token.

Numerics follow HF transformers' `MixtralSparseMoeBlock` / `Qwen3MoeSparseMoeBlock` (softmax in fp32, top-k, optional
renormalisation, each expert's output scaled by its weight and summed per token in ascending expert order), so greedy
output equals HF's in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.interface import MoEConfig
from engine.parallel import SINGLE, TensorParallel
from kernels import AttentionOps


class Experts(nn.Module):
    """The experts' weights, stacked as HF >= 5 keeps them in memory (so they can be split across ranks along the
    expert or the intermediate dimension): gate_up_proj [E, 2 * I, hidden] (gate rows first, then up) and
    down_proj [E, hidden, I], in the model dtype."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        for p in (self.gate_up_proj, self.down_proj):
            nn.init.normal_(p, std=0.02)  # random-weight engines (tests) need finite values


class SparseMoE(nn.Module):
    """Router (`gate`: hidden -> num_experts, no bias) plus `experts`. x: [T, hidden] -> [T, hidden].

    Raises (constructor): ValueError when tp.size does not divide the experts' intermediate size.

    The grouping reads the per-expert token counts on the host (one sync a layer): cheap on a CPU, a stall on a
    GPU, where a fused MoE kernel (vLLM's `fused_moe`) would take over; decode steps of an MoE model are therefore
    not captured in CUDA graphs (`engine.model_runner`).
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
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        start = 0
        for e, n in enumerate(counts):
            if n:
                h = self.ops.silu_and_mul(F.linear(rows[start:start + n], gate_up[e]))
                out_rows[start:start + n] = F.linear(h, down[e])
            start += n
        out_rows *= weights.flatten()[order].unsqueeze(1)
        # One index_add over expert-sorted rows: each token's contributions are summed in ascending expert order,
        # as HF's per-expert loop does.
        return self.tp.all_reduce(torch.zeros_like(x).index_add_(0, tokens, out_rows))
