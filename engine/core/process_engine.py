"""An `Engine` (`engine.core.async_engine`) with the engine core in a process of its own (vLLM V1's split): this process
keeps gRPC, KV transfer control and streaming; the engine process (`engine.core.core_process`) owns the scheduler, the
model and the KV cache memory. Commands and outputs cross as typed messages (`engine.core.ipc`).

Supervision: the engine process is watched through its sentinel. If it dies (kill -9, a segfault in a kernel),
every request in flight fails at once with ENGINE_DIED (gRPC UNAVAILABLE: the coordinator retries or migrates it)
and the fault listeners hear why, as after a faulted step (the worker then stops taking traffic). `stop` ends it
cleanly; a worker killed outright takes it along (`engine.core.lifetime.die_with_parent`).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
from collections.abc import Callable

import torch

from pdserve_server.engine.args import DEFAULT_MAX_UNREAD_TOKENS, EngineArgs
from pdserve_server.engine.core.async_engine import EngineStreams, RequestStreams
from pdserve_server.engine.config import CacheConfig, SchedulerConfig
from pdserve_server.engine.models.config import ModelConfig
from pdserve_server.engine.core.core_process import EngineProcessSpec, run_engine_process
from pdserve_server.engine.core.commands import Abort, AddRequest, KvArrived, Pause
from pdserve_server.engine.errors import EngineError, ErrorKind
from pdserve_server.engine.core.ipc import (BuildFailed, Codec, Fault, LayerBegin, LayerWritten, NewRequest, Outputs,
                                            Query,
                                       QueryResult, Ready, Shutdown, StatsUpdate)
from pdserve_server.engine.execution.kv_cache import KvShards, import_shard
from pdserve_server.engine.kv_stream import KvLayerProgress
from pdserve_server.engine.outputs import SchedulerStats

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0  # a clean stop waits this long for the current step, then kills


class EngineBuildError(RuntimeError):
    """The engine process could not build the engine; `error_type` names the exception it raised there."""

    def __init__(self, error_type: str, message: str):
        super().__init__(message)
        self.error_type = error_type


class ProcessEngine(EngineStreams):
    """An engine core in a child process, behind the `Engine` interface. `await start()` before use.

    After start: `model_config`, `cache_config`, `scheduler_config` describe the engine, and `kv` is its KV cache,
    every rank's shard mapped into this process (`engine.execution.kv_cache.KvShards`; see `engine.core.ipc.Ready`).

    Args:
        args: the engine to build there.
        threads: torch intra-op threads of the engine's loop (None: torch's default).
        log_setup: configures the engine process's logging (picklable), or None.
        max_unread_tokens: as `RequestStreams`'.
    """

    def __init__(self, args: EngineArgs, threads: int | None = None, log_setup: Callable[[], None] | None = None,
                 max_unread_tokens: int = DEFAULT_MAX_UNREAD_TOKENS):
        self.requests = RequestStreams(self.submit, max_unread_tokens, before_open=self._check_alive,
                                       after_close=self._forget)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.args, self.threads, self.log_setup = args, threads, log_setup
        self.model_config: ModelConfig | None = None
        self.cache_config: CacheConfig | None = None
        self.scheduler_config: SchedulerConfig | None = None
        self.kv: KvShards | None = None
        self.pid: int | None = None
        self.died: str | None = None  # why the engine process is gone, once it is
        self._codec = Codec()
        self._stats = SchedulerStats()
        self._layers: dict[str, KvLayerProgress] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._stopping = False
        self._dir: str | None = None
        self._zmq = self._commands = self._outputs = None

    # ---- lifecycle -------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn the engine process and wait until its engine is built.

        Raises:
            EngineBuildError: the build failed there (its error type and message).
            RuntimeError: the process exited before answering.
        """
        import zmq

        self._loop = asyncio.get_running_loop()
        self._dir = tempfile.mkdtemp(prefix="pdserve-engine-")
        self._zmq = zmq.Context()
        self._commands = self._zmq.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, 0)  # never block the event loop: commands are few and small
        self._commands.setsockopt(zmq.LINGER, 0)
        self._commands.bind(f"ipc://{self._dir}/commands")
        # A plain socket the loop watches (`_on_outputs`): zmq.asyncio's recv costs a future, a poll registration
        # and a getpid a message, which at batch 1 was half this process's CPU per token.
        self._outputs = self._zmq.socket(zmq.PULL)
        self._outputs.setsockopt(zmq.RCVHWM, 0)
        self._outputs.setsockopt(zmq.LINGER, 0)
        self._outputs.bind(f"ipc://{self._dir}/outputs")
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with gRPC and OpenMP threads
        parent_end, child_end = ctx.Pipe(duplex=False)
        spec = EngineProcessSpec(self.args, self.threads, f"ipc://{self._dir}/commands",
                                 f"ipc://{self._dir}/outputs", os.getpid(), self.log_setup)
        self._process = ctx.Process(target=run_engine_process, args=(spec, child_end), name="pdserve-engine",
                                    daemon=True)
        self._process.start()
        child_end.close()
        self.pid = self._process.pid
        try:
            answer = await asyncio.to_thread(_receive_answer, parent_end, self._process)
        except BaseException:
            self._release()
            raise
        finally:
            parent_end.close()
        if isinstance(answer, BuildFailed):
            # Sockets and contexts too: a ZMQ context left to the garbage collector blocks in term() on its open
            # sockets, wherever the collection happens to run.
            self._release()
            raise EngineBuildError(answer.error_type, answer.message)
        assert isinstance(answer, Ready)
        self.model_config, self.cache_config = answer.model_config, answer.cache_config
        self.scheduler_config = answer.scheduler_config
        try:  # off the loop: a CPU shard is fetched from its rank's process, a CUDA one opens a context per GPU
            self.kv = await asyncio.to_thread(_open_kv, answer)
        except Exception as e:  # noqa: BLE001 - a shard that does not open here: nothing to serve with
            self._release()
            raise RuntimeError(f"the engine's KV cache could not be mapped into the worker: "
                               f"{type(e).__name__}: {e}") from e
        self._stats = answer.stats
        self._loop.add_reader(self._process.sentinel, self._on_exit)
        self._loop.add_reader(self._outputs.FD, self._on_outputs)
        self._loop.call_soon(self._on_outputs)  # what came before the reader (its FD may have signalled already)
        log.info("engine process %d started", self.pid)

    async def restart(self) -> None:
        """Start a fresh engine process after this one died (a new, empty KV cache: `kv` is new memory; requests
        in flight failed when it died).

        Raises:
            as `start`.
        """
        assert self.died is not None, "restart() is for an engine process that died"
        self._release()
        self.requests.clear_stale()
        self._layers.clear()
        self._calls.clear()
        self.kv = None
        self.died = None
        await self.start()

    def stop(self) -> None:
        """Stop the engine process: ask it to finish its step and exit, kill it after STOP_TIMEOUT_S."""
        self._stopping = True
        process = self._process
        if process is not None:
            if self._loop is not None:
                self._loop.remove_reader(process.sentinel)
            if process.is_alive() and self._commands is not None:
                self._commands.send(self._codec.encode(Shutdown()))
                process.join(STOP_TIMEOUT_S)
        self._release()

    def _release(self) -> None:
        """Kill the process if it still runs, and close the sockets and their directory."""
        self._kill()
        self._stop_reading()
        for sock in (self._commands, self._outputs):
            if sock is not None:
                sock.close(linger=0)
        if self._zmq is not None:
            self._zmq.term()
        self._zmq = self._commands = self._outputs = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _kill(self) -> None:
        process = self._process
        if process is not None and process.is_alive():
            process.kill()
            process.join(5)

    # ---- commands --------------------------------------------------------------------------------------------
    def submit(self, command: AddRequest | Abort | KvArrived | Pause) -> None:
        """Send a command to the engine process (event loop thread). Dropped once the process is gone: its
        requests have failed already."""
        if self.died is not None or self._stopping:
            return
        if isinstance(command, AddRequest):
            r = command.request
            msg = NewRequest(r.request_id, r.prompt_token_ids, r.sampling, tuple(r.eos_token_ids), r.prefill_only,
                             r.remote_kv, r.arrival_time, r.output_token_ids, r.kv_layers is not None, r.scheduling)
            if r.kv_layers is not None:
                self._layers[r.request_id] = r.kv_layers
        elif isinstance(command, (Abort, KvArrived, Pause)):
            msg = command  # crosses as it is
        else:
            raise TypeError(f"{type(command).__name__} cannot cross to an engine process")
        self._commands.send(self._codec.encode(msg))

    @property
    def stats(self) -> SchedulerStats:
        return self._stats

    async def snapshot(self) -> tuple[SchedulerStats, bool]:
        result = await self._query("snapshot")
        assert result.stats is not None
        return result.stats, result.flag

    async def abortable(self, request_id: str) -> bool:
        return (await self._query("abortable", request_id)).flag

    async def _query(self, name: str, request_id: str = "") -> QueryResult:
        """Raises: EngineError(ENGINE_DIED) when the engine process is gone; RuntimeError when the query raised."""
        if self.died is not None:
            raise EngineError(ErrorKind.ENGINE_DIED, self.died)
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            self._commands.send(self._codec.encode(Query(call_id, name, request_id)))
            result = await future
        finally:
            self._calls.pop(call_id, None)
        if result.error is not None:
            raise RuntimeError(f"engine query {name} failed: {result.error}")
        return result

    def _check_alive(self) -> None:
        """A request may enter: raises EngineError(ENGINE_DIED) once the engine process is gone."""
        if self.died is not None:
            raise EngineError(ErrorKind.ENGINE_DIED, self.died)

    def _forget(self, request_id: str) -> None:
        self._layers.pop(request_id, None)

    # ---- outputs ---------------------------------------------------------------------------------------------
    def _on_outputs(self) -> None:
        """The loop's reader on the outputs socket (event loop thread): handle every message queued. ZMQ's FD
        signals on edges, so this reads until the socket says it is empty (`zmq.Again`), whatever one message's
        handling raised: a message left unread would not wake the loop again."""
        import zmq

        while self._outputs is not None:
            try:
                frame = self._outputs.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle_output(self._codec.decode_output(frame))
            except Exception:  # noqa: BLE001 - a bug in one message's handling must not stop the others'
                log.exception("engine process output could not be handled; reading on")

    def _handle_output(self, msg) -> None:
        if isinstance(msg, Outputs):
            self.requests.dispatch(msg.events)
        elif isinstance(msg, StatsUpdate):
            self._stats = msg.stats
        elif isinstance(msg, (LayerBegin, LayerWritten)):
            progress = None if self.requests.is_stale(msg.request_id) else self._layers.get(msg.request_id)
            if progress is None:
                return
            if isinstance(msg, LayerBegin):
                progress.begin(msg.block_ids, msg.num_tokens)
            else:
                progress.layer_written(msg.layer, torch.device("cpu"))  # synchronized over there
        elif isinstance(msg, QueryResult):
            future = self._calls.get(msg.call_id)
            if future is not None and not future.done():
                future.set_result(msg)
        elif isinstance(msg, Fault):
            self.requests.fault(msg.message)

    def _stop_reading(self) -> None:
        """Stop watching the outputs socket (a no-op when it is not watched, or the loop has closed)."""
        if self._loop is not None and self._outputs is not None:
            self._loop.remove_reader(self._outputs.FD)

    def _on_exit(self) -> None:
        """The engine process is gone without being asked: fail everything in flight and tell the listeners."""
        process = self._process
        assert process is not None and self._loop is not None
        self._loop.remove_reader(process.sentinel)
        if self._stopping:
            return
        process.join(1)
        self.died = f"the engine process died ({_describe_exit(process.exitcode)})"
        log.error("%s; failing %d request(s) in flight", self.died, len(self.requests.owners))
        self._stop_reading()
        self.requests.fail_all(ErrorKind.ENGINE_DIED, self.died)
        for progress in self._layers.values():
            progress.fail(self.died)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineError(ErrorKind.ENGINE_DIED, self.died))
        self.requests.fault(self.died)


def _receive_answer(conn, process) -> Ready | BuildFailed:
    """Worker thread: the engine process's first message; RuntimeError if it exits without one."""
    try:
        while not conn.poll(0.5):
            if not process.is_alive():
                break
        else:
            return conn.recv()
    except EOFError:
        pass
    process.join(5)
    raise RuntimeError(f"the engine process exited ({_describe_exit(process.exitcode)}) before its engine was "
                       "built; see the log above")


def _open_kv(answer: Ready) -> KvShards:
    """Map every rank's KV shard of `answer` into this process (`engine.execution.kv_cache.import_shard`)."""
    return KvShards(answer.model_config, answer.cache_config, [import_shard(b) for b in answer.kv])


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
