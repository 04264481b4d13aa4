"""Tensor parallelism inside a worker (Megatron-LM, Shoeybi et al. 2019): N ranks, one process each, every one
holding 1/N of the attention heads, of the MLP's (and each expert's) intermediate features and of the vocabulary;
an all-reduce after each row-parallel projection (o_proj, down_proj) and after the vocab-parallel embedding, an
all-gather of the vocab-parallel logits, and rank 0's broadcast of each step's inputs. On CPU they go through shared
memory where they fit (`engine.parallel.shm_collectives`), else torch.distributed (gloo); on GPUs, one per rank
(`rank_device`), through NCCL (the step's inputs through gloo).

`TensorParallel` is what the model sees; `engine.models.sharding` cuts the checkpoint's tensors to a rank's share;
`engine.core.ranks` runs the ranks other than 0 and feeds them each step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pdserve_server.engine.parallel.shm_collectives import ShmCollectives


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place in its tensor-parallel group.

    Attributes:
        rank: 0 .. size - 1; rank 0 is the engine process (it schedules and samples).
        size: ranks in the group (1 = no tensor parallelism: every collective is the identity).
        group: the torch.distributed process group (None when size is 1).
        shm: the group's shared-memory collectives (`engine.parallel.shm_collectives`), or None for torch.distributed
        only
            (always on GPUs).
    """

    rank: int = 0
    size: int = 1
    group: Any = None
    shm: ShmCollectives | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it. Through shared memory when the group has it and `x` fits
        (every rank decides alike), else torch.distributed (gloo on CPU, NCCL for CUDA tensors)."""
        if self.size > 1 and not (self.shm is not None and self.shm.all_reduce(x)):
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` ([..., n], the same shape on all) along the last dim, rank order:
        [..., size * n]. Through shared memory when the group has it and `x` fits (every rank decides alike), else
        torch.distributed (gloo on CPU, NCCL for CUDA tensors)."""
        if self.size == 1:
            return x
        if self.shm is not None:
            out = self.shm.all_gather_last(x)
            if out is not None:
                return out
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast_bytes(self, data: bytes = b"") -> bytes:
        """Rank 0 sends `data` to every other rank; returns it on every rank (the other ranks' `data` is ignored).
        Through shared memory when it fits (the others wait for it without holding a core while rank 0 is idle),
        else gloo. A collective: every rank calls it at the same point."""
        if self.size == 1:
            return data
        if self.rank == 0:
            if self.shm is None or not self.shm.send_bytes(data):
                torch.distributed.broadcast_object_list([data], src=0, group=self.group)
            return data
        got = self.shm.recv_bytes() if self.shm is not None else None
        if got is None:
            box: list[Any] = [None]
            torch.distributed.broadcast_object_list(box, src=0, group=self.group)
            got = box[0]
        return got

    def heads(self, num_heads: int, num_kv_heads: int) -> "HeadSplit":
        """This rank's attention heads (`head_split`). Raises ValueError where `head_split` does."""
        return head_split(num_heads, num_kv_heads, self.size, self.rank)

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` equal parts (MLP and expert features; heads follow `head_split`).

        Raises:
            ValueError: `total` is not divisible by the group size (the message names `what`).
        """
        if total % self.size:
            raise ValueError(f"--tensor-parallel-size {self.size} must divide {what} ({total})")
        return total // self.size


SINGLE = TensorParallel()


@dataclass(frozen=True)
class HeadSplit:
    """The attention heads one tensor-parallel rank computes, as global head indices in the order the rank holds
    them; None marks a padding head (all-zero weights, so it contributes exactly nothing). Every rank of a group
    holds the same number of each, so the paged KV cache keeps one shape per rank (`engine.execution.kv_cache`).

    Attributes:
        q_heads: the query heads; each uses the kv head its GQA group names (q // (num_heads / num_kv_heads)).
        kv_heads: the key/value heads, which the rank stores in its shard of the KV cache.
    """

    q_heads: tuple[int | None, ...]
    kv_heads: tuple[int | None, ...]


def head_split(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadSplit:
    """Rank `rank`'s heads out of `size`:

    - kv heads >= ranks: each rank takes ceil(num_kv_heads / size) consecutive kv heads with every query head of
      their GQA groups; when `size` does not divide the kv heads the last ranks are padded with whole zero groups
      (SGLang pads heads the same way for its vision encoders' `num_dummy_heads`). Padding costs the padded ranks
      arithmetic but no wall time: rank 0, which holds only real heads, is as busy.
    - kv heads < ranks: each kv head is replicated on size / num_kv_heads ranks, which split its query heads
      (vLLM's rule for GQA under large TP).

    Raises:
        ValueError: num_kv_heads does not divide num_heads (not GQA), or kv heads are fewer than ranks and either
            the ranks are not a multiple of them or a group's query heads do not split evenly across its ranks;
            the message names the quantities and the flag.
    """
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_key_value_heads ({num_kv_heads}) must divide num_attention_heads ({num_heads})")
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        per = -(-num_kv_heads // size)
        kv = tuple(h if h < num_kv_heads else None for h in range(rank * per, (rank + 1) * per))
        return HeadSplit(tuple(None if k is None else k * group + j for k in kv for j in range(group)), kv)
    if size % num_kv_heads or group % (size // num_kv_heads):
        raise ValueError(f"--tensor-parallel-size {size} is larger than num_key_value_heads ({num_kv_heads}), so "
                         f"each kv head is replicated on size / kv heads ranks: that must be a whole number that "
                         f"divides the {group} query heads of each kv head")
    replicas = size // num_kv_heads
    per = group // replicas
    return HeadSplit(tuple(range(rank * per, (rank + 1) * per)), (rank // replicas,))


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """KV heads each rank stores, padding or replicas included (`head_split`): ceil(num_kv_heads / size), the
    [..., kv_heads_per_rank, head_dim] of its shard of every block."""
    return -(-num_kv_heads // size)


def rank_device(device: str, rank: int) -> str:
    """The device tensor-parallel rank `rank` computes on, for a worker given `device`: the CPU for every rank of a
    CPU worker; for "cuda:k" ("cuda" = "cuda:0") rank r's GPU is k + r, one GPU per rank (vLLM places a worker's
    ranks on consecutive visible GPUs the same way). Any other device as given."""
    d = torch.device(device)
    if d.type != "cuda":
        return str(d)
    return f"cuda:{(d.index or 0) + rank}"


def check_devices(device: str, size: int) -> None:
    """Refuse a tensor-parallel group this machine cannot place (`rank_device`), before anything is spawned.

    Raises:
        ValueError: ranks on a device type other than cpu or cuda, or more GPUs asked for than there are; the
            message names the flag, the GPUs asked for and those present.
    """
    if size == 1:
        return
    kind = torch.device(device).type
    if kind == "cpu":
        return
    if kind != "cuda":
        raise ValueError(f"--tensor-parallel-size {size} runs on cpu or cuda, not {device}")
    first, last = rank_device(device, 0), rank_device(device, size - 1)
    have = torch.cuda.device_count()
    if torch.device(last).index >= have:
        raise ValueError(f"--tensor-parallel-size {size} on {device} puts one rank on each of GPUs {first} .. {last}; "
                         f"this machine has {have} GPU(s) (CUDA_VISIBLE_DEVICES narrows them)")


def init_group(rank: int, size: int, init_method: str,
               shm_buffers: tuple[torch.Tensor, torch.Tensor] | None = None, device: str = "cpu") -> TensorParallel:
    """Join (or form) the group of `size` ranks at `init_method` (a `file://` path all ranks share) and return
    this rank's `TensorParallel`, with collectives through `shm_buffers` (`ShmCollectives.allocate`, the same in every
    rank) when given. Blocks until every rank has joined. `device`: this rank's (`rank_device`): gloo moves CPU
    tensors; on a GPU, NCCL moves CUDA tensors and gloo the step's inputs (torch's "cpu:gloo,cuda:nccl"; objects go
    through the CPU backend). The CUDA path is unverified: the lent machines have one GPU each.

    Raises:
        RuntimeError: from torch.distributed when the rendezvous fails or times out.
    """
    import datetime

    backend = "gloo"
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))  # NCCL's communicator binds to the current device
        backend = "cpu:gloo,cuda:nccl"
    torch.distributed.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                         timeout=datetime.timedelta(minutes=5))
    shm = ShmCollectives(*shm_buffers, rank) if shm_buffers is not None else None
    return TensorParallel(rank, size, torch.distributed.group.WORLD, shm)
