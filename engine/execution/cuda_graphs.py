"""CUDA graphs of the all-decode step: the forward pass and LM head captured once per padded batch size, replayed.

Why: a decode step of a small model on a GPU is bound by kernel launches, not by the GPU. Measured on an H100
(bench/gpu_check.py, SmolLM2-135M shapes, bf16): about 950 launches and 4-5 ms of device time per step took
25-45 ms of wall time eagerly, and 2.3-3.1 ms replayed from a captured graph (docs/history/benchmarks.md). vLLM captures
its decode forward per batch size for the same reason (its `--enforce-eager` turns that off, as ours does).

How (vLLM's scheme): static device buffers hold the step's inputs (token ids, positions, slot mapping, block
tables, context lengths); a step of n decodes is padded to the smallest captured size >= n. Padded rows write their
K/V into a scratch slot no request owns (`KVCache.scratch_slot`) and attend over one token of block 0, so they
change nothing a request can read. Block tables are as wide as the longest allowed context. The graphs share one
memory pool and are captured largest first, as torch's documentation recommends.

Steps with prefill chunks, n-gram drafts, layer-wise KV streaming (a host callback per layer) or more decodes than
the largest size run eagerly.

Off a GPU, `capture=False` runs the same padded static-buffer step without a graph; the tests use it to check the
padding on CPU, since the capture itself needs CUDA (verified on an H100, bench/gpu_check.py).
"""
from __future__ import annotations

import torch

from pdserve_server.engine.attention import AttentionMetadata, fill_block_tables


def capture_sizes(max_num_seqs: int, largest: int = 256) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 16 up to min(max_num_seqs, largest) (vLLM's
    default list is 1, 2, 4 and multiples of 8; 16 halves the captures for a padding of at most 15 rows)."""
    top = max(1, min(max_num_seqs, largest))
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 16))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


class DecodeGraphs:
    """Captured all-decode steps of one model and KV cache.

    Args:
        model: the `DecoderModel` (forward + compute_logits are captured).
        kv_layers: the cache's per-layer (k_cache, v_cache) views.
        sizes: batch sizes to capture (`capture_sizes`).
        max_blocks: block-table width, ceil(max_model_len / block_size).
        scratch_slot: a KV slot no request owns, for padded rows.
        device: the model's device.
        capture: record CUDA graphs (needs CUDA); False runs the padded step eagerly (tests).
    """

    def __init__(self, model: torch.nn.Module, kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
                 sizes: list[int], max_blocks: int, scratch_slot: int, device: torch.device, capture: bool = True):
        self.model, self.kv_layers, self.sizes = model, kv_layers, sorted(sizes)
        self.max_blocks, self.scratch_slot, self.capture = max_blocks, scratch_slot, capture
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), scratch_slot, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        # The block tables' host side, filled in place (`fill_block_tables`). Pinned on CUDA so the upload is a
        # true async copy; the step ends with a sync (the sampler reads its token ids) before the next one
        # rewrites it.
        self._host_tables = torch.zeros(n, max_blocks, dtype=torch.int32,
                                        pin_memory=torch.device(device).type == "cuda")
        self._host_rows = self._host_tables.numpy()
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self._no_prefill = (torch.zeros(1, dtype=torch.int32, device=device),
                            torch.zeros(0, dtype=torch.int32, device=device),
                            torch.zeros(0, 1, dtype=torch.int32, device=device))
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def _step(self, size: int) -> torch.Tensor:
        """The padded step on the static buffers: [size, vocab] logits in the model's dtype."""
        cu, ctx, tables = self._no_prefill
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:size], num_decodes=size,
                                 decode_block_tables=self.block_tables[:size],
                                 decode_context_lens=self.context_lens[:size], prefill_cu_seqlens=cu,
                                 prefill_context_lens=ctx, prefill_block_tables=tables, prefill_max_query_len=0)
        hidden = self.model(self.input_ids[:size], self.positions[:size], meta, self.kv_layers)
        return self.model.compute_logits(hidden)

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture: Triton compiles, cuBLAS picks its kernels
            for size in self.sizes:
                self._step(size)
        torch.cuda.current_stream().wait_stream(side)
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[size] = self._step(size)
            self._graphs[size] = graph
        torch.cuda.synchronize()

    def size_for(self, num_decodes: int, longest_table: int) -> int | None:
        """The captured size a step of num_decodes runs at, or None when it must run eagerly (too many decodes,
        or a block table wider than the captured width)."""
        if longest_table > self.max_blocks:
            return None
        return next((s for s in self.sizes if s >= num_decodes), None)

    def run(self, size: int, input_ids: list[int], positions: list[int], slots: list[int],
            block_tables: list[list[int]], context_lens: list[int]) -> torch.Tensor:
        """One all-decode step of n = len(input_ids) <= size requests. Returns [n, vocab] logits (model dtype) on the
        device, a view of the graph's output: read it before the next run."""
        n = len(input_ids)
        pad = size - n
        fill_block_tables(self._host_rows[:size], block_tables)
        # One host->device copy per buffer; the padded rows point at the scratch slot and one token of block 0.
        self.input_ids[:size].copy_(torch.tensor(input_ids + [0] * pad, dtype=torch.long), non_blocking=True)
        self.positions[:size].copy_(torch.tensor(positions + [0] * pad, dtype=torch.long), non_blocking=True)
        self.slot_mapping[:size].copy_(torch.tensor(slots + [self.scratch_slot] * pad, dtype=torch.long),
                                       non_blocking=True)
        self.block_tables[:size].copy_(self._host_tables[:size], non_blocking=True)
        self.context_lens[:size].copy_(torch.tensor(context_lens + [1] * pad, dtype=torch.int32), non_blocking=True)
        if not self.capture:
            return self._step(size)[:n]
        self._graphs[size].replay()
        return self._logits[size][:n]
