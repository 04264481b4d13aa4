"""What a worker does when its engine process dies and `--engine-restart` is on: restart the engine in place."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

from pdserve_server.engine.execution.kv_cache import KvShards
from pdserve_server.engine.core.process_engine import ProcessEngine

log = logging.getLogger(__name__)


class EngineRestarter:
    """Restarts a worker's dead engine process with a bounded backoff, then serves again.

    While it restarts, readiness is NOT_SERVING (requests that arrive are refused with UNAVAILABLE by the engine,
    `ErrorKind.ENGINE_DIED`); liveness stays SERVING, as the worker process itself is sound. After a restart the
    worker has a new, empty KV cache (`set_kv_cache`) and a new instance id (`new_instance`), so the coordinator's
    membership takes it for a restarted worker and re-reads it. An attempt that fails is retried after twice the
    delay, up to max_delay_s; a death within stable_s of the last restart doubles the delay too (a crash loop
    backs off), otherwise the delay starts again at min_delay_s.

    Args:
        engine: the worker's engine process.
        set_serving: the server's readiness (`RunningServer.set_serving`).
        set_kv_cache: gives the worker the restarted engine's KV cache (None while it restarts).
        new_instance: gives the worker a new instance id.
        stopping: True once the worker is shutting down (a restart then leaves readiness alone).
        min_delay_s / max_delay_s / stable_s: the backoff, seconds.
    """

    def __init__(self, engine: ProcessEngine, set_serving: Callable, set_kv_cache: Callable[[KvShards | None], None],
                 new_instance: Callable[[str], None], stopping: Callable[[], bool], min_delay_s: float = 1.0,
                 max_delay_s: float = 30.0, stable_s: float = 60.0):
        self.engine, self.set_serving, self.set_kv_cache = engine, set_serving, set_kv_cache
        self.new_instance, self.stopping = new_instance, stopping
        self.min_delay_s, self.max_delay_s, self.stable_s = min_delay_s, max_delay_s, stable_s
        self.num_restarts = 0
        self._delay = min_delay_s
        self._last_restart = float("-inf")
        self._task: asyncio.Task | None = None

    def restart(self, reason: str) -> None:
        """Start restarting (event loop); a restart already under way carries on."""
        if self._task is not None and not self._task.done():
            return
        if time.monotonic() - self._last_restart >= self.stable_s:
            self._delay = self.min_delay_s
        log.error("%s; restarting it in %.1f s", reason, self._delay)
        self._task = asyncio.get_running_loop().create_task(self._run())

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        await self.set_serving(False)
        self.set_kv_cache(None)  # the dead engine's shards: unmapped once transfers still reading them end
        while True:
            await asyncio.sleep(self._delay)
            self._delay = min(self._delay * 2, self.max_delay_s)
            try:
                await self.engine.restart()
                break
            except Exception as e:  # noqa: BLE001 - logged, retried after the backoff
                log.error("engine restart failed (%s); retrying in %.1f s", e, self._delay)
                self.engine.died = self.engine.died or str(e)
        self.num_restarts += 1
        self._last_restart = time.monotonic()
        assert self.engine.kv is not None
        self.set_kv_cache(self.engine.kv)
        self.new_instance(uuid.uuid4().hex)
        if not self.stopping():
            await self.set_serving(True)
        log.info("engine process restarted (pid %s, restart %d)", self.engine.pid, self.num_restarts)
