"""All-reduce through shared memory between the tensor-parallel ranks of one host (what vLLM's CPU backend does
instead of gloo): each rank copies its tensor into its slot, publishes a sequence number, waits until every rank has
published it, and sums the slots with the same op (so every rank gets the same bits).

Why: gloo's all-reduce of one decode token's hidden state took 1.6 ms between two processes on the 2-core CI
machine (`bench/tensor_parallel.py`), and a TP decode step makes two per layer; copying a few KiB through shared
memory and spinning on a flag took 20-30 us (`bench/tensor_parallel.py` prints both).

Ordering: a rank writes its data, then its flag; readers read the flags, then the data. x86-64's memory model (TSO)
keeps stores in order and loads in order, so no fence is needed there; elsewhere `usable()` is False and gloo is
used. Two buffers alternate by sequence parity: a rank can only write into the buffer of sequence s + 2 after every
rank published s + 1, which each does only once it has finished reading s.
"""
from __future__ import annotations

import ctypes
import os
import platform

import torch


def usable() -> bool:
    """True on x86-64 (see the module docstring for why the architecture matters)."""
    return platform.machine().lower() in ("x86_64", "amd64")


class ShmAllReduce:
    """One rank's handle on the group's shared all-reduce buffers.

    Args:
        buffers: [2, size, max_bytes] uint8 in shared memory (`allocate`), the same tensor in every rank.
        flags: [size] int64 in shared memory, zeros at start.
        rank: this rank.
    """

    SPINS_BEFORE_YIELD = 64  # then give the core away between checks: ranks may outnumber cores

    def __init__(self, buffers: torch.Tensor, flags: torch.Tensor, rank: int):
        self.buffers, self.flags, self.rank = buffers, flags, rank
        self.size, self.max_bytes = buffers.shape[1], buffers.shape[2]
        self._flags = flags.numpy()
        self._seq = 0
        self._typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # (parity, dtype) -> [size, elements] view

    @staticmethod
    def allocate(size: int, max_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(buffers, flags) for a group of `size` ranks whose largest all-reduce is `max_bytes`, in shared memory
        (they cross to the rank processes as shared-memory handles)."""
        return (torch.zeros(2, size, max_bytes, dtype=torch.uint8).share_memory_(),
                torch.zeros(size, dtype=torch.int64).share_memory_())

    def all_reduce(self, x: torch.Tensor) -> bool:
        """Sum `x` over the ranks in place, every rank calling it in the same order with the same shape. Returns
        False, doing nothing, when `x` is not a contiguous CPU tensor of at most `max_bytes` (the caller then uses
        another all-reduce; every rank decides alike, as the shapes are the same).

        A handful of host operations, each a few microseconds of Python and dispatch on a small CPU: the copy in is
        a memmove, the sum one torch op over a cached typed view of the slots."""
        nbytes = x.numel() * x.element_size()
        if nbytes > self.max_bytes or x.device.type != "cpu" or not x.is_contiguous():
            return False
        self._seq += 1
        seq, parity = self._seq, self._seq % 2
        slots = self._typed.get((parity, x.dtype))
        if slots is None:
            slots = self._typed[(parity, x.dtype)] = self.buffers[parity].view(x.dtype)
        ctypes.memmove(slots[self.rank].data_ptr(), x.data_ptr(), nbytes)
        self._flags[self.rank] = seq  # after the data (program order; x86 keeps stores in order)
        spins = 0
        while (self._flags < seq).any():
            spins += 1
            if spins > self.SPINS_BEFORE_YIELD:
                os.sched_yield()
        torch.sum(slots[:, :x.numel()], dim=0, out=x.view(-1))  # the same op on the same bits in every rank
        return True
