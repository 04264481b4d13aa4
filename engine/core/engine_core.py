"""The engine loop: drain commands, reserve, schedule, execute, update, emit. It runs on a thread of its own,
either in the worker's process (`AsyncEngine`) or as the main loop of an engine-core process
(`engine.core.core_process`), so the asyncio loop (gRPC, KV transfers) stays responsive while torch computes.

Only the loop's thread touches the scheduler, block pool and model. Other threads talk to it through `submit`.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from pdserve_server.engine.core.commands import Abort, AddRequest, Call, Command, KvArrived, Pause
from pdserve_server.engine.errors import ErrorKind
from pdserve_server.engine.hardware import set_threads
from pdserve_server.engine.execution.model_runner import ModelRunner
from pdserve_server.engine.outputs import Forgotten, RequestFailed, SchedulerOutput, SchedulerStats, StepRecord
from pdserve_server.engine.request import RequestStatus
from pdserve_server.engine.scheduling.scheduler import Scheduler

log = logging.getLogger(__name__)


class EngineCore:
    """Single-threaded owner of scheduler + runner.

    Args:
        scheduler, runner: the engine's halves.
        emit: called on the engine thread with each batch of output events (Reserved, TokenOutput,
            RequestFailed). An Abort emits RequestFailed(ABORTED) only when it asks to notify.
        on_fault: called on the engine thread, once, when a step raises (a fault of the engine, not of one
            request): the step's requests fail, the others carry on, and the worker should report itself unhealthy.
        step_log_size: how many StepRecords to keep.
        threads: torch intra-op threads of the engine thread (`engine.hardware.set_threads`: 0 = one per CPU);
            None leaves torch's setting as the engine thread finds it.
        on_stats: called on the engine thread with each new `stats` (as a step starts, and after each loop
            iteration that changed them): an engine in another process publishes them this way.
    """

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, emit: Callable[[list], None],
                 on_fault: Callable[[str], None] = lambda message: None, step_log_size: int = 4096,
                 threads: int | None = None, on_stats: Callable[[SchedulerStats], None] | None = None):
        self.scheduler = scheduler
        self.threads = threads
        self.runner = runner
        self.emit = emit
        self.on_fault = on_fault
        self.fault: str | None = None  # set at the first step that raised: the worker should stop taking traffic
        self._commands: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_steps = 0
        self.on_stats = on_stats
        self.stats = scheduler.make_stats(0)  # replaced (never mutated) by the engine thread; any thread may read
        self.step_log: deque[StepRecord] = deque(maxlen=step_log_size)
        self._running: set[str] = set()

    def submit(self, command: Command) -> None:
        """Thread-safe: queue a command for the next loop iteration."""
        self._commands.put(command)

    def start(self) -> None:
        """Run the loop on a thread of its own."""
        self._thread = threading.Thread(target=self.run, name="engine-core", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Thread-safe: end the loop after its current iteration."""
        self._stop.set()
        self._commands.put(None)

    def stop(self) -> None:
        """End the loop and wait (30 s at most) for its thread."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def snapshot(self) -> tuple[SchedulerStats, bool]:
        """Engine thread (a `Call`): the stats and whether the block pool passes its integrity check, taken
        together."""
        return self.scheduler.make_stats(self.num_steps), not self.scheduler.kv.pool.integrity_errors()

    def abortable(self, request_id: str) -> bool:
        """Engine thread (a `Call`): whether an outside abort would drop the request (it is known and not HELD;
        see `Abort`)."""
        req = self.scheduler.requests.get(request_id)
        return (req is not None and req.status != RequestStatus.HELD) or self.scheduler.families.has_samples(request_id)

    def _publish_stats(self) -> None:
        stats = self.scheduler.make_stats(self.num_steps)
        if stats != self.stats:
            self.stats = stats
            if self.on_stats is not None:
                self.on_stats(stats)

    def run(self) -> None:
        """The loop, on the calling thread, until `request_stop`."""
        if self.threads is not None:
            set_threads(self.threads)  # per thread under OpenMP: the steps run here
        while not self._stop.is_set():
            events: list = []
            out: SchedulerOutput | None = None
            try:
                self._drain(block=not self.scheduler.has_work())
                events.extend(self.scheduler.reserve())
                out = self.scheduler.schedule()
                events.extend(out.failed)
                if not out.is_empty:
                    self._publish_stats()  # as the step starts: it may be long
                    start = time.perf_counter()
                    events.extend(self.scheduler.update(out, self.runner.execute(out)))
                    self.scheduler.observe_step(out, (time.perf_counter() - start) * 1e3)
                    self._record_step(out)
            except Exception as e:  # noqa: BLE001 - a fault must fail loudly, not wedge the loop
                events.extend(self._fail_step(out, e))
            self._publish_stats()
            events.extend(self.scheduler.kv.take_kv_events())  # what entered and left the prefix cache
            if events:
                self.emit(events)
        self.scheduler.kv.close()  # the offload tiers' queued writes land before the process ends

    def _fail_step(self, out: SchedulerOutput | None, error: Exception) -> list[RequestFailed]:
        """A step raised outside per-request sampling: fail the requests it ran (all of them when the scheduler
        itself raised, as its state is then unknown), keep serving the rest, and report the fault once."""
        victims = ([s.request.request_id for s in out.decodes + out.prefills] if out is not None
                   else list(self.scheduler.requests))
        log.exception("engine step failed; failing its %d request(s)", len(victims))
        failed = [RequestFailed(rid, ErrorKind.INTERNAL, f"engine step failed ({type(error).__name__}); "
                                                         "see the worker log") for rid in victims]
        for f in failed:
            self.scheduler.abort(f.request_id)
        if self.fault is None:
            self.fault = f"{type(error).__name__}: {error}"
            self.on_fault(self.fault)
        return failed

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while cmd is not None or not self._commands.empty():
            if cmd is not None:
                self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: Any) -> None:
        try:
            self._apply_one(cmd)
        except Exception as e:  # noqa: BLE001 - a command's bug fails that command's request, not the loop
            log.exception("engine command %s failed", type(cmd).__name__)
            if isinstance(cmd, AddRequest):
                self.scheduler.abort(cmd.request.request_id)
                self.emit([RequestFailed(cmd.request.request_id, ErrorKind.INTERNAL,
                                         f"engine rejected the request ({type(e).__name__}); see the worker log")])

    def _apply_one(self, cmd: Any) -> None:
        s = self.scheduler
        if isinstance(cmd, AddRequest):
            failure = s.add_request(cmd.request)
            if failure is not None:
                self.emit([failure])
        elif isinstance(cmd, Abort):
            if cmd.ack:
                self.emit([Forgotten(cmd.request_id)])  # first: emitted before anything the abort might emit
            req = s.requests.get(cmd.request_id)
            if cmd.notify and req is not None and req.status == RequestStatus.HELD:
                return
            if s.abort(cmd.request_id) and cmd.notify:
                self.emit([RequestFailed(cmd.request_id, ErrorKind.ABORTED, "aborted by Worker.Abort")])
        elif isinstance(cmd, KvArrived):
            if (failure := s.kv_arrived(cmd.request_id, cmd.first_token)) is not None:
                self.emit([failure])
        elif isinstance(cmd, Pause):
            (s.resume if cmd.resume else s.pause)(cmd.request_id)
        elif isinstance(cmd, Call):
            if not cmd.future.set_running_or_notify_cancel():
                return  # the caller gave up (its RPC was cancelled or timed out)
            try:
                cmd.future.set_result(cmd.fn(s))
            except Exception as e:  # surfaced to the caller, not the loop
                cmd.future.set_exception(e)

    def _record_step(self, out) -> None:
        """Log batch membership changes: joined = newly running this step, left = finished or preempted by it."""
        self.num_steps += 1
        batch = [s.request.request_id for s in out.decodes + out.prefills]
        running_after = {r.request_id for r in self.scheduler.running}
        joined = [r for r in batch if r not in self._running]
        left = [r for r in batch if r not in running_after] + list(out.preempted_ids)
        self.step_log.append(StepRecord(self.num_steps, out.num_tokens, batch, joined, left))
        if joined or left:
            log.info("step %d: batch=%d tokens=%d joined=%s left=%s", self.num_steps, len(batch), out.num_tokens,
                     joined, left)
        self._running = running_after

