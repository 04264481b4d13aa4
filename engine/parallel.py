"""Tensor parallelism inside a worker (Megatron-LM, Shoeybi et al. 2019): N ranks, one process each, every one
holding 1/N of the attention heads, of the MLP's (and each expert's) intermediate features and of the vocabulary;
an all-reduce after each row-parallel projection (o_proj, down_proj) and after the vocab-parallel embedding, an
all-gather of the vocab-parallel logits. torch.distributed carries the collectives (gloo on CPU), except the
all-reduces, which go through shared memory where they fit (`engine.shm_allreduce`).

`TensorParallel` is what the model sees; `engine.models.sharding` cuts the checkpoint's tensors to a rank's share;
`engine.tp_ranks` runs the ranks other than 0 and feeds them each step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.shm_allreduce import ShmAllReduce


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place in its tensor-parallel group.

    Attributes:
        rank: 0 .. size - 1; rank 0 is the engine process (it schedules and samples).
        size: ranks in the group (1 = no tensor parallelism: every collective is the identity).
        group: the torch.distributed process group (None when size is 1).
        shm: the group's shared-memory all-reduce (`engine.shm_allreduce`), or None to all-reduce with gloo.
    """

    rank: int = 0
    size: int = 1
    group: Any = None
    shm: ShmAllReduce | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it. Through shared memory when the group has it and `x` fits
        (every rank decides alike), else gloo."""
        if self.size > 1 and not (self.shm is not None and self.shm.all_reduce(x)):
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` ([..., n], the same shape on all) along the last dim, rank order:
        [..., size * n]."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` equal parts (heads, features).

        Raises:
            ValueError: `total` is not divisible by the group size (the message names `what`).
        """
        if total % self.size:
            raise ValueError(f"--tensor-parallel-size {self.size} must divide {what} ({total})")
        return total // self.size


SINGLE = TensorParallel()


def init_group(rank: int, size: int, init_method: str,
               shm_buffers: tuple[torch.Tensor, torch.Tensor] | None = None) -> TensorParallel:
    """Join (or form) the gloo group of `size` ranks at `init_method` (a `file://` path all ranks share) and return
    this rank's `TensorParallel`, all-reducing through `shm_buffers` (`ShmAllReduce.allocate`, the same in every
    rank) when given. Blocks until every rank has joined.

    Raises:
        RuntimeError: from torch.distributed when the rendezvous fails or times out.
    """
    import datetime

    torch.distributed.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size,
                                         timeout=datetime.timedelta(minutes=5))
    shm = ShmAllReduce(*shm_buffers, rank) if shm_buffers is not None else None
    return TensorParallel(rank, size, torch.distributed.group.WORLD, shm)
