"""The tensor-parallel ranks 1..N-1 of an engine process (rank 0 is the engine process itself,
`engine.core.core_process`): one process each, spawned by the engine process, each holding its share of the model and
its shard of the KV cache on its own device (`engine.parallel.tensor_parallel.rank_device`), which it shares with the
worker (`engine.execution.kv_cache.export_shard`, passed on by rank 0 unopened). They run whatever step rank 0
broadcasts (`ModelRunner.follow`) until rank 0 tells them to stop.

Lifetimes: a rank dies with the engine process (PR_SET_PDEATHSIG), and the engine process stops the moment a rank
dies (`RankProcesses.start`'s watcher: the other ranks would block in their next collective), so its worker sees its
engine die and fails the requests in flight with UNAVAILABLE. Scheduling, sampling and the KV connectors stay with rank
0 and the worker; a rank only runs forwards.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import torch

from pdserve_server.engine.args import EngineArgs
from pdserve_server.engine.config import CacheConfig, SchedulerConfig
from pdserve_server.engine.models.config import ModelConfig
from pdserve_server.engine.hardware import set_threads
from pdserve_server.engine.execution.kv_cache import export_shard, share
from pdserve_server.engine.core.lifetime import die_with_parent, exit_now
from pdserve_server.engine.models.sharding import vocab_per_rank
from pdserve_server.engine.parallel.tensor_parallel import TensorParallel, init_group, rank_device
from pdserve_server.engine.parallel.shm_collectives import ShmCollectives
from pdserve_server.engine.parallel.shm_collectives import usable as shm_usable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSpec:
    """What a rank process starts with (pickled across the spawn).

    Attributes:
        args: the engine's arguments (model, dtype, backend, device).
        model_config, cache_config, max_model_len: resolved by rank 0, so every rank builds the same shapes.
        shard_out: where the rank sends its KV shard, once built (`engine.execution.kv_cache.export_shard` bytes).
        rank, size: this rank and the group size.
        init_method: the `file://` rendezvous of the group.
        shm_buffers: the group's shared-memory collectives' buffers (`ShmCollectives.allocate`), or None for gloo.
        threads: torch intra-op threads of this rank.
        log_setup: configures logging like the worker's (picklable), or None.
    """

    args: EngineArgs
    model_config: ModelConfig
    cache_config: CacheConfig
    max_model_len: int
    shard_out: Connection
    rank: int
    size: int
    init_method: str
    threads: int
    shm_buffers: tuple[torch.Tensor, torch.Tensor] | None
    log_setup: Callable[[], None] | None = None


def run_rank(spec: RankSpec) -> None:
    """A rank process's entry point: join the group, build this rank's runner, send its KV shard to rank 0, meet the
    others at a barrier (rank 0 passes it once every rank is built), then follow rank 0's steps. Exits 0 when told
    to stop, 1 on any error (logged; rank 0's watcher then stops the engine)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if spec.log_setup is not None:
        spec.log_setup()
    set_threads(spec.threads)
    from pdserve_server.engine.builder import build_runner

    try:
        tp = init_group(spec.rank, spec.size, spec.init_method, spec.shm_buffers,
                        rank_device(spec.args.device, spec.rank))
        runner = build_runner(spec.args, spec.model_config, spec.cache_config, spec.max_model_len, tp)
        spec.shard_out.send_bytes(export_shard(share(runner.kv_cache.kv)))  # the runner keeps it alive
        spec.shard_out.close()
        torch.distributed.barrier(group=tp.group)
        runner.follow()
    except Exception:  # noqa: BLE001 - logged here; the engine process sees this process exit
        log.exception("tensor-parallel rank %d failed", spec.rank)
        sys.exit(1)
    log.info("tensor-parallel rank %d stopped", spec.rank)
    exit_now(0)


class RankProcesses:
    """Ranks 1..size-1 of an engine process, and rank 0's membership of their group.

    `start` spawns them and returns rank 0's `TensorParallel` once every rank has joined the group; the engine
    process then builds its own share (`engine.builder.build_engine` with that group) and calls `wait_built`, which
    returns the other ranks' KV shards.

    Args:
        args, model_config, cache_config, scheduler_config: the engine being built.
        threads: torch intra-op threads of each rank (rank 0's included).
        log_setup: as `RankSpec.log_setup`.
    """

    def __init__(self, args: EngineArgs, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, threads: int, log_setup: Callable[[], None] | None):
        self.size = args.tensor_parallel_size
        self._device = args.device
        self._dir = tempfile.mkdtemp(prefix="pdserve-tp-")
        self._init_method = f"file://{self._dir}/rendezvous"
        itemsize = torch.empty((), dtype=model_config.torch_dtype).element_size()
        # Shared-memory collectives move host tensors; GPU ranks' tensors go through NCCL.
        self._shm = (ShmCollectives.allocate(self.size, shm_slot_bytes(model_config, scheduler_config, self.size,
                                                                        itemsize))
                     if shm_usable() and torch.device(args.device).type == "cpu" else None)
        ctx = multiprocessing.get_context("spawn")
        pipes = [ctx.Pipe(duplex=False) for _ in range(1, self.size)]
        self._shard_in = [receive for receive, _ in pipes]
        self._specs = [RankSpec(args, model_config, cache_config, scheduler_config.max_model_len, send, rank,
                                self.size, self._init_method, threads, self._shm, log_setup)
                       for rank, (_, send) in zip(range(1, self.size), pipes)]
        self._processes: list[multiprocessing.process.BaseProcess] = []
        self._stopping = threading.Event()
        self.tp: TensorParallel | None = None

    def start(self, on_death: Callable[[str], None]) -> TensorParallel:
        """Spawn the ranks, watch them (`on_death(why)` runs, on a thread of its own, if one exits before `stop`;
        it must end this process, since the remaining ranks would block in their next collective), and join their
        group as rank 0 (blocks until all have joined).

        Raises:
            RuntimeError: the rendezvous failed (torch.distributed's message).
        """
        # The engine process is daemonic (multiprocessing ends it with the worker), and multiprocessing refuses
        # children to daemonic processes lest they be orphaned; these cannot be: they die with this process
        # (PR_SET_PDEATHSIG) and it with them (`watch`).
        multiprocessing.current_process().daemon = False
        ctx = multiprocessing.get_context("spawn")
        for spec in self._specs:
            p = ctx.Process(target=run_rank, args=(spec,), name=f"pdserve-tp-rank-{spec.rank}", daemon=True)
            p.start()
            self._processes.append(p)
        for spec in self._specs:
            spec.shard_out.close()  # the rank holds its own end; EOF here if it dies before sending
        self._watch(on_death)
        self.tp = init_group(0, self.size, self._init_method, self._shm, rank_device(self._device, 0))
        return self.tp

    def wait_built(self) -> list[bytes]:
        """Rank 0 is built: receive every other rank's KV shard, rank order (`engine.execution.kv_cache.export_shard`
        bytes, for the worker to open), then wait at the barrier until every rank is built (a rank that fails
        exits, and `watch` ends this process).

        Raises:
            RuntimeError: a rank exited before sending its shard, or did not send it in time (`receive_shards`).
        """
        shards = receive_shards(self._shard_in, self._processes)
        torch.distributed.barrier(group=self.tp.group)
        shutil.rmtree(self._dir, ignore_errors=True)  # the file store is only read at rendezvous
        return shards

    def _watch(self, on_death: Callable[[str], None]) -> None:
        def run() -> None:
            sentinels = {p.sentinel: p for p in self._processes}
            ready = wait(list(sentinels))
            if not self._stopping.is_set():
                p = sentinels[ready[0]]
                p.join(0)
                on_death(f"tensor-parallel rank process {p.name} (pid {p.pid}) exited with code {p.exitcode}")

        threading.Thread(target=run, name="tp-rank-watch", daemon=True).start()

    def stop(self, close: Callable[[], None], timeout_s: float = 10.0) -> None:
        """Stop the ranks: `close` (rank 0's `ModelRunner.close`) tells them to leave their loop, after the watcher
        knows to expect their exit; wait for them, kill those that do not exit."""
        self._stopping.set()
        close()
        for p in self._processes:
            p.join(timeout_s)
            if p.is_alive():
                log.warning("tensor-parallel rank %s did not stop; killing it", p.name)
                p.kill()
                p.join(1)
        shutil.rmtree(self._dir, ignore_errors=True)


SHARD_TIMEOUT_S = 300.0  # as the group's rendezvous: a rank neither built nor dead by then is stuck


def receive_shards(pipes: list[Connection], processes: list[multiprocessing.process.BaseProcess],
                   timeout_s: float = SHARD_TIMEOUT_S) -> list[bytes]:
    """Each rank's KV shard bytes (ranks 1.., in order) from its pipe, closing the pipes; every wait is bounded.

    Raises:
        RuntimeError: a rank exited before sending (its pid and exit code named), or sent nothing within
            `timeout_s` seconds of the call (a rank stuck while building).
    """
    deadline = time.monotonic() + timeout_s
    shards = []
    try:
        for rank, (pipe, p) in enumerate(zip(pipes, processes), start=1):
            ready = wait([pipe, p.sentinel], timeout=max(0.0, deadline - time.monotonic()))
            closed = p.sentinel in ready
            try:
                if pipe.poll(0):  # sent, or closed by its death (EOF)
                    shards.append(pipe.recv_bytes())
                    continue
            except EOFError:
                closed = True
            if closed or not p.is_alive():
                # The pipe's EOF and the sentinel come as the rank dies, a moment before its exit status is there.
                p.join(max(1.0, deadline - time.monotonic()))
                how = f"exited with code {p.exitcode}" if p.exitcode is not None else "closed its pipe"
                raise RuntimeError(f"tensor-parallel rank {rank} (pid {p.pid}) {how} before sending its KV shard; "
                                   "see its log")
            raise RuntimeError(f"tensor-parallel rank {rank} (pid {p.pid}) did not send its KV shard within "
                               f"{timeout_s:.0f} s of rank 0 being built")
    finally:
        for pipe in pipes:
            pipe.close()
    return shards


SHM_SLOT_MAX_BYTES = 32 << 20  # per rank and buffer; a larger collective (huge vocabularies) goes through gloo


def shm_slot_bytes(model: ModelConfig, scheduler: SchedulerConfig, size: int, itemsize: int) -> int:
    """Bytes of each rank's shared-memory slot: the larger of a full step's hidden states ([max_step_tokens, hidden],
    the largest all-reduce) and a decode step's vocab-parallel logits
    ([max_num_seqs, vocab / size], the all-gather), in the model dtype's `itemsize`, at most SHM_SLOT_MAX_BYTES. A
    step's inputs (msgpack, a few bytes a token and a block) fit in it too; what does not fit goes through gloo."""
    hidden = scheduler.max_step_tokens * model.hidden_size
    logits = scheduler.max_num_seqs * vocab_per_rank(model.vocab_size, size)
    return min(max(hidden, logits) * itemsize, SHM_SLOT_MAX_BYTES)


def rank_threads(total: int | None, size: int) -> int:
    """Torch intra-op threads per rank: the worker's `total` (None or 0 = every CPU this process may use) split
    evenly among `size` ranks, at least 1."""
    if not total:
        total = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, total // size)
