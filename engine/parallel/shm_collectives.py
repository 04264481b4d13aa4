"""Collectives through shared memory between the tensor-parallel ranks of one host (what vLLM's CPU backend does
instead of gloo): all-reduce, all-gather and rank 0's broadcast of each step's inputs. Each rank copies its data
into its slot, publishes a sequence number, waits until every rank has published it, and reads the slots (the sums
with the same op on every rank, so every rank gets the same bits).

Why: gloo's all-reduce of one decode token's hidden state took 1.6 ms between two processes on the 2-core CI
machine (`bench/tensor_parallel.py`), and a TP decode step makes two per layer; copying a few KiB through shared
memory and spinning on a flag took 20-30 us. A step's pickled inputs broadcast by gloo took about 1 ms, and its
logits' all-gather 1.1 ms at batch 1 and 12 ms at batch 64.

Ordering: a rank writes its data, then its flag; readers read the flags, then the data. x86-64's memory model (TSO)
keeps stores in order and loads in order, so no fence is needed there; elsewhere `usable()` is False and gloo is
used. Two buffers alternate by sequence parity. Every operation ends with every rank having published its number,
and a rank publishes only after it has read what it needs of that operation; so when any rank writes into the
buffer of sequence s + 2, every rank has finished reading s (it published s + 1).
"""
from __future__ import annotations

import ctypes
import os
import platform
import time

import torch


def usable() -> bool:
    """True on x86-64 (see the module docstring for why the architecture matters)."""
    return platform.machine().lower() in ("x86_64", "amd64")


class ShmCollectives:
    """One rank's handle on the group's shared buffers. Every rank calls the same operations in the same order
    (each is a collective).

    Args:
        buffers: [2, size, max_bytes] uint8 in shared memory (`allocate`), the same tensor in every rank.
        flags: [size] int64 in shared memory, zeros at start.
        rank: this rank.
    """

    SPINS_BEFORE_YIELD = 64  # then give the core away between checks: ranks may outnumber cores
    PATIENT_YIELD_S = 0.01  # `recv_bytes` yields this long (longer than a busy gap between steps), then sleeps
    PATIENT_SLEEP_MAX_S = 0.01  # the longest sleep between checks there (the first step after idle may wait that)

    def __init__(self, buffers: torch.Tensor, flags: torch.Tensor, rank: int):
        self.buffers, self.flags, self.rank = buffers, flags, rank
        self.size, self.max_bytes = buffers.shape[1], buffers.shape[2]
        self._flags = flags.numpy()
        self._seq = 0
        self._typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # (parity, dtype) -> [size, elements] view

    @staticmethod
    def allocate(size: int, max_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(buffers, flags) for a group of `size` ranks whose largest operation moves `max_bytes` per rank, in
        shared memory (they cross to the rank processes as shared-memory handles)."""
        return (torch.zeros(2, size, max_bytes, dtype=torch.uint8).share_memory_(),
                torch.zeros(size, dtype=torch.int64).share_memory_())

    def all_reduce(self, x: torch.Tensor) -> bool:
        """Sum `x` over the ranks in place, every rank calling it in the same order with the same shape. Returns
        False, doing nothing, when `x` does not `_fits` (the caller then uses another all-reduce; every rank
        decides alike, as the shapes are the same).

        A handful of host operations, each a few microseconds of Python and dispatch on a small CPU: the copy in is
        a memmove, the sum one torch op over a cached typed view of the slots."""
        if not self._fits(x):
            return False
        slots = self._exchange(x)
        torch.sum(slots[:, :x.numel()], dim=0, out=x.view(-1))  # the same op on the same bits in every rank
        return True

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` ([..., n], the same shape on all) concatenated along the last dim in rank order, a new
        tensor [..., size * n]; None, doing nothing, when `x` does not `_fits` (every rank decides alike)."""
        if not self._fits(x):
            return None
        slots = self._exchange(x)
        return torch.cat([slots[r, :x.numel()].view(x.shape) for r in range(self.size)], dim=-1)

    def send_bytes(self, data: bytes) -> bool:
        """Rank 0's side of a broadcast: publish `data` to the other ranks (`recv_bytes`). Returns False when it
        does not fit (the others are told so and expect it by another route; send it there)."""
        fits = 8 + len(data) <= self.max_bytes
        self._seq += 1
        slot = self.buffers[self._seq % 2, 0].numpy()
        slot[:8].view("<i8")[0] = len(data) if fits else -1
        if fits:
            slot[8:8 + len(data)] = memoryview(data)
        self._flags[self.rank] = self._seq  # after the data
        self._wait_all(self._seq)
        return fits

    def recv_bytes(self) -> bytes | None:
        """The other ranks' side of `send_bytes`: rank 0's bytes, or None when they did not fit (receive them by the
        route rank 0 sends them). Waits patiently: between requests rank 0 sends nothing for as long as it is
        idle, so after a short spin this sleeps between checks (`PATIENT_*`) instead of holding a core."""
        self._seq += 1
        seq = self._seq
        spins, start, pause = 0, time.monotonic(), 1e-4
        while self._flags[0] < seq:
            spins += 1
            if spins <= self.SPINS_BEFORE_YIELD:
                continue
            if time.monotonic() - start < self.PATIENT_YIELD_S:
                os.sched_yield()
            else:
                time.sleep(pause)
                pause = min(pause * 2, self.PATIENT_SLEEP_MAX_S)
        slot = self.buffers[seq % 2, 0].numpy()
        n = int(slot[:8].view("<i8")[0])
        data = None if n < 0 else slot[8:8 + n].tobytes()  # a copy, before publishing
        self._flags[self.rank] = seq
        self._wait_all(seq)
        return data

    def _fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.max_bytes and x.device.type == "cpu" and x.is_contiguous()

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """Copy `x` into this rank's slot of the next sequence's buffer, publish, wait for every rank; the buffer's
        slots typed as x's dtype ([size, max_bytes / itemsize]), safe to read until this rank's next operation
        publishes (module docstring)."""
        self._seq += 1
        seq, parity = self._seq, self._seq % 2
        slots = self._typed.get((parity, x.dtype))
        if slots is None:
            slots = self._typed[(parity, x.dtype)] = self.buffers[parity].view(x.dtype)
        ctypes.memmove(slots[self.rank].data_ptr(), x.data_ptr(), x.numel() * x.element_size())
        self._flags[self.rank] = seq  # after the data (program order; x86 keeps stores in order)
        self._wait_all(seq)
        return slots

    def _wait_all(self, seq: int) -> None:
        spins = 0
        while (self._flags < seq).any():
            spins += 1
            if spins > self.SPINS_BEFORE_YIELD:
                os.sched_yield()
