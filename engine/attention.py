"""Per-step attention metadata: how the packed tokens of one step map onto sequences and KV slots."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def fill_block_tables(dst: np.ndarray, tables: list[list[int]]) -> None:
    """Write each request's block ids into a row of `dst` ([rows, width] int32 host memory, rows >= len(tables),
    width >= every table's length), zero-padded; rows past len(tables) are zeroed (padding rows). Row by row through
    numpy: building a nested list for torch.tensor() took 2.7 ms at 256 requests on a 2-core CPU, this 0.6 ms."""
    for i, t in enumerate(tables):
        dst[i, :len(t)] = t
        dst[i, len(t):] = 0
    dst[len(tables):] = 0


@dataclass
class AttentionMetadata:
    """Describes one packed step. Decode sequences (one query token each) come first, then prefill chunks.

    Attributes:
        slot_mapping: [num_tokens] int64, KV slot for every token of the step.
        num_decodes: sequences with a single query token; they own token rows [0, num_decodes).
        decode_block_tables: [num_decodes, max_blocks] int32.
        decode_context_lens: [num_decodes] int32, context length including the new token.
        prefill_cu_seqlens: [num_prefills + 1] int32, prefix sums of chunk lengths over rows [num_decodes, T).
        prefill_context_lens: [num_prefills] int32, context length including the chunk.
        prefill_block_tables: [num_prefills, max_blocks] int32.
        prefill_max_query_len: longest prefill chunk in tokens (sizes the prefill kernel's grid without a sync).
    """

    slot_mapping: torch.Tensor
    num_decodes: int
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor
    prefill_cu_seqlens: torch.Tensor
    prefill_context_lens: torch.Tensor
    prefill_block_tables: torch.Tensor
    prefill_max_query_len: int

    @property
    def num_prefills(self) -> int:
        return int(self.prefill_context_lens.shape[0])
