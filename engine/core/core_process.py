"""The engine-core process: builds the engine (model, KV cache, scheduler), then runs `EngineCore`'s loop on its
main thread, fed by a thread that reads commands off a ZMQ socket. Outputs go out on another socket, all sent from
the loop's thread (ZMQ sockets are not thread-safe; the reader thread only calls `EngineCore.submit`).

The KV cache is allocated here (under tensor parallelism, each rank's shard by its rank, on its device) and shared
before `Ready` is sent: the worker's KV connectors read and write its blocks in place (CPU shared memory; on CUDA
the tensor crosses as a CUDA IPC handle, checked on an H100 on 2026-11-26 without tensor parallelism: clusters on
tcp, tcp + layer-wise and colocated returned HF fp32's tokens; ranks on several GPUs are unverified).
So the data path of a transfer never takes this process's GIL, and the step loop never takes the worker's.

The process dies with its parent (PR_SET_PDEATHSIG on Linux), ignores SIGINT (a terminal's Ctrl-C reaches the
whole process group; the worker decides how its engine stops) and exits 0 on `Shutdown`.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import torch

from pdserve_server.engine.args import EngineArgs
from pdserve_server.engine.core.commands import Abort, AddRequest, Call, KvArrived, Pause
from pdserve_server.engine.core.engine_core import EngineCore
from pdserve_server.engine.core.ipc import (BuildFailed, Codec, Fault, LayerBegin, LayerWritten, NewRequest, Outputs,
                                            Query,
                                       QueryResult, Ready, Shutdown, StatsUpdate)
from pdserve_server.engine.execution.kv_cache import export_shard, share
from pdserve_server.engine.core.lifetime import die_with_parent, exit_now
from pdserve_server.engine.request import Request
from pdserve_server.engine.core.ranks import RankProcesses, rank_threads

if TYPE_CHECKING:
    from pdserve_server.engine.builder import EngineParts

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class EngineProcessSpec:
    """What the engine process is started with (pickled across the spawn).

    Attributes:
        args: the engine to build.
        threads: torch intra-op threads of the loop (`engine.hardware.set_threads`); None = torch's default.
        command_address / output_address: the ZMQ endpoints the worker bound (ipc://...).
        parent_pid: the worker's pid (an engine whose parent is already gone exits at once).
        log_setup: configures this process's logging like the worker's (a picklable callable), or None.
    """

    args: EngineArgs
    threads: int | None
    command_address: str
    output_address: str
    parent_pid: int
    log_setup: Callable[[], None] | None = None


class _LayerProgressProxy:
    """Stands in for the worker's `KvLayerProgress` on this side: sends `begin`/`layer_written` as messages at once
    (the sender overlaps each layer's send with the rest of the forward)."""

    def __init__(self, request_id: str, send: Callable[[object], None]):
        self.request_id, self._send = request_id, send

    def begin(self, block_ids: list[int], num_tokens: int) -> None:
        self._send(LayerBegin(self.request_id, list(block_ids), num_tokens))

    def layer_written(self, layer: int, device: torch.device) -> None:
        if device.type == "cuda":  # another process reads the layer: it must be in memory, not just enqueued
            torch.cuda.current_stream(device).synchronize()
        self._send(LayerWritten(self.request_id, layer))


def run_engine_process(spec: EngineProcessSpec, handshake: Connection) -> None:
    """The process's entry point (multiprocessing, spawn). Exits 0 after `Shutdown`, 1 if the build failed (the
    error is sent on `handshake` as `BuildFailed` first)."""
    die_with_parent()
    if os.getppid() != spec.parent_pid:  # died before the prctl took effect
        sys.exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if spec.log_setup is not None:
        spec.log_setup()
    import zmq

    try:
        parts, ranks, shards = _build(spec)
    except Exception as e:  # noqa: BLE001 - reported to the worker, which turns it into its own one-line error
        handshake.send(BuildFailed(type(e).__name__, str(e)))
        handshake.close()
        sys.exit(1)

    context = zmq.Context()
    out_sock = context.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.LINGER, 1000)
    out_sock.connect(spec.output_address)
    cmd_sock = context.socket(zmq.PULL)
    cmd_sock.connect(spec.command_address)
    codec = Codec()

    def send(msg) -> None:  # the loop's thread only
        out_sock.send(codec.encode(msg), copy=False)

    threads = spec.threads if ranks is None else rank_threads(spec.threads, ranks.size)
    core = EngineCore(parts.scheduler, parts.runner, emit=lambda events: send(Outputs(events)),
                      on_fault=lambda message: send(Fault(message)), threads=threads,
                      on_stats=lambda stats: send(StatsUpdate(stats)))
    handshake.send(Ready(parts.model_config, parts.cache_config, parts.scheduler_config, shards, core.stats))
    handshake.close()
    reader = threading.Thread(target=_read_commands, args=(cmd_sock, codec, core, send), name="engine-commands",
                              daemon=True)
    reader.start()
    log.info("engine core running (pid %d)", os.getpid())
    core.run()
    if ranks is not None:
        ranks.stop(parts.runner.close)  # the other tensor-parallel ranks leave their loop and exit
    reader.join(5)  # it closes its socket as it returns, after `Shutdown`
    out_sock.close(linger=1000)  # outputs already queued still go out
    if not reader.is_alive():  # else term() would wait for the reader's socket forever
        context.term()
    exit_now(0)


def _read_commands(sock, codec: Codec, core: EngineCore, send: Callable[[object], None]) -> None:
    """Reader thread: decode each command and queue it for the loop until `Shutdown`; closes its socket."""
    try:
        while True:
            try:
                cmd = codec.decode_command(sock.recv())
            except Exception:  # noqa: BLE001 - a malformed message is a bug on our side: stop rather than guess
                log.exception("engine process: unreadable command; stopping")
                return
            if isinstance(cmd, Shutdown):
                return
            core.submit(_to_core_command(cmd, core, send))
    finally:
        core.request_stop()
        sock.close(linger=0)


def _to_core_command(cmd, core: EngineCore, send: Callable[[object], None]):
    if isinstance(cmd, NewRequest):
        return AddRequest(Request(
            cmd.request_id, cmd.prompt_token_ids, cmd.sampling, eos_token_ids=cmd.eos_token_ids,
            prefill_only=cmd.prefill_only, remote_kv=cmd.remote_kv, arrival_time=cmd.arrival_time,
            output_token_ids=cmd.output_token_ids, scheduling=cmd.scheduling,
            kv_layers=_LayerProgressProxy(cmd.request_id, send) if cmd.stream_layers else None))
    if isinstance(cmd, (Abort, KvArrived, Pause)):
        return cmd  # the same command on both sides (`engine.core.commands`)
    assert isinstance(cmd, Query)
    future: Future = Future()
    future.add_done_callback(lambda f: send(_answer(cmd, f)))  # runs where the result is set: the loop's thread
    if cmd.name == "snapshot":
        return Call(lambda s: core.snapshot(), future)
    return Call(lambda s: core.abortable(cmd.request_id), future)


def _answer(query: Query, future: Future) -> QueryResult:
    if (error := future.exception()) is not None:
        return QueryResult(query.call_id, error=f"{type(error).__name__}: {error}")
    result = future.result()
    if query.name == "snapshot":
        stats, ok = result
        return QueryResult(query.call_id, stats=stats, flag=ok)
    return QueryResult(query.call_id, flag=result)


def _build(spec: EngineProcessSpec) -> tuple[EngineParts, RankProcesses | None, list[bytes]]:
    """Build the engine; under tensor parallelism, with its other ranks: they are spawned and joined, this process
    builds rank 0, and each rank sends the shard of the KV cache it allocated on its device. Returns the parts, the
    ranks (None without TP) and every rank's shard for the worker (`engine.execution.kv_cache.export_shard`, rank order;
    this process's own moved into shared memory first on CPU).

    Raises:
        whatever building raised (the caller reports it as `BuildFailed`).
    """
    from pdserve_server.engine.builder import build_engine, resolve_configs

    args = spec.args
    ranks = None
    if args.tensor_parallel_size == 1:
        parts = build_engine(args)
    else:
        configs = resolve_configs(args)
        ranks = RankProcesses(args, *configs, rank_threads(spec.threads, args.tensor_parallel_size), spec.log_setup)
        tp = ranks.start(on_death=_rank_died)
        parts = build_engine(args, tp=tp, configs=configs)
    own = export_shard(share(parts.runner.kv_cache.kv))  # the runner keeps it alive
    return parts, ranks, [own] + (ranks.wait_built() if ranks is not None else [])


def _rank_died(why: str) -> None:
    """A tensor-parallel rank is gone: the others would block in their next collective, so this process ends at
    once; its worker sees the engine die and fails the requests in flight (UNAVAILABLE), and the remaining ranks
    die with it."""
    log.error("%s; the engine process stops", why)
    os._exit(1)
