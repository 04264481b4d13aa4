"""Live membership: which workers are behind this coordinator, right now.

Workers are found from the configured addresses (`--prefill` / `--decode`): literal "ip:port", DNS names
re-resolved every `discovery_interval_s` (a compose service or a Kubernetes headless Service resolves to every
replica: the platform's own discovery, no registry of ours), or "@FILE" lists re-read as often. Every endpoint is
polled every `stats_interval_s` (health of its role's service, then GetStats): a worker that fails
`MAX_FAILED_POLLS` polls in a row, reports NOT_SERVING (engine fault, draining) or disagrees with the cluster's KV
layout leaves the routing set; one that answers again rejoins, its GetInfo re-read when its instance_id changed
(a restart: new KV port). Requests in flight on a worker that leaves fail on their own calls (UNAVAILABLE); on one
that stopped answering its polls, membership cuts their calls (`Flow.abandon`), and they migrate.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve_server.coordinator.errors import RequestError
from pdserve_server.coordinator.flow import Flow
from pdserve_server.coordinator.kv_events import follow as follow_kv_events
from pdserve_server.coordinator.config import CoordinatorConfig
from pdserve_server.coordinator.router import LocalPrefillPolicy, Router, WorkerHandle
from pdserve_server.coordinator.validation import Limits
from pdserve.v1 import worker_pb2
from pdserve_server.server_common.addresses import expand
from pdserve_server.server_common.errors import CommandError
from pdserve_server.server_common.grpc_server import CLIENT_KEEPALIVE, MAX_MESSAGE_BYTES
from pdserve_server.server_common.security import internal_channel, read_secret

log = logging.getLogger(__name__)

MAX_FAILED_POLLS = 2
WAIT_NOTE_S = 10.0  # at start, say what is still missing this often
POLL_TIMEOUT_S = 5.0  # a health or stats poll's deadline (at least the poll interval)
ROLE_SERVICE = {"prefill": "pdserve.v1.Prefill", "decode": "pdserve.v1.Decode", "colocated": "pdserve.v1.Decode"}


@dataclass
class Cluster:
    """The workers behind this coordinator: the router over them, the requests in flight, and the reference
    every worker must agree with (the first compatible worker's GetInfo: model, KV layout, block size)."""

    router: Router
    colocated: bool
    local_prefill: LocalPrefillPolicy = LocalPrefillPolicy()  # when decode workers prefill (disaggregated mode)
    reference: worker_pb2.WorkerInfo | None = None
    flows: dict[str, Flow] = field(default_factory=dict)
    _limits: Limits | None = None

    @property
    def complete(self) -> bool:
        """Every configured role has a live worker (what the coordinator waits for at start)."""
        return bool(self.router.live("decode")) and (self.colocated or bool(self.router.live("prefill")))

    @property
    def ready(self) -> bool:
        """Requests can be served: every role is live, or decode workers are and may prefill in the prefill
        workers' absence (`LocalPrefillPolicy.fallback`)."""
        return self.complete or (self.local_prefill.fallback and bool(self.router.live("decode")))

    def missing_roles(self) -> list[str]:
        decode = "colocated" if self.colocated else "decode"
        return [role for role, kind in ((decode, "decode"), ("prefill", "prefill"))
                if not (kind == "prefill" and self.colocated) and not self.router.live(kind)]

    @property
    def limits(self) -> Limits:
        """What a request may ask for: the tightest context and KV capacity among live workers (the last known
        when none is live).

        Raises:
            RequestError: UNAVAILABLE before any worker has been seen.
        """
        live = [w for w in self.router.workers if w.live and w.info is not None]
        if live and self.reference is not None:
            self._limits = Limits(context_length=min(w.info.context_length for w in live),
                                  kv_capacity_tokens=min(w.info.max_request_tokens for w in live),
                                  vocab_size=self.reference.vocab_size)
        if self._limits is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "no worker has been seen yet; retry shortly")
        return self._limits

    @property
    def eos_token_id(self) -> int:
        return self.reference.eos_token_id if self.reference else 0

    @property
    def block_size(self) -> int:
        return self.reference.block_size if self.reference else 0

    @property
    def connector(self) -> str:
        """The KV connector decode workers listen on ("" when colocated or none is known)."""
        decode = [w for w in self.router.decode if w.info is not None]
        return "" if self.colocated or not decode else decode[0].info.kv_connector


class Membership:
    """Keeps `cluster.router`'s worker lists equal to the live workers (see the module docstring).

    Args:
        config: addresses, intervals, credentials.
        cluster: the router and reference this instance maintains (it is the only writer).
        on_change: called after every poll round in which some worker joined or left.
        interceptors: client interceptors for every worker channel (tracing's).
    """

    def __init__(self, config: CoordinatorConfig, cluster: Cluster, on_change: Callable[[], None] = lambda: None,
                 interceptors: list | None = None):
        self.config, self.cluster, self.on_change = config, cluster, on_change
        self.interceptors = interceptors or []
        self.secret = read_secret(config.server.cluster_secret_file)
        self._last_discovery = float("-inf")
        self._changed = False
        self._followers: dict[str, asyncio.Task] = {}  # worker address -> its KV event follower (`kv_events`)

    # ---- discovery ----------------------------------------------------------------------------------------------
    def _discover(self) -> None:
        """Re-expand the configured addresses; open handles for new endpoints, drop vanished idle ones."""
        router = self.cluster.router
        for role, entries, handles in (("prefill", self.config.prefill, router.prefill),
                                       ("decode", self.config.decode, router.decode)):
            found: list[str] = []
            for entry in entries:
                try:
                    found += [e for e in expand(entry) if e not in found]
                except (ValueError, OSError) as e:
                    log.error("cannot expand %s address %r: %s", role, entry, e)
            known = {h.address for h in handles}
            for address in found:
                if address not in known:
                    channel = internal_channel(address, self.config.worker_tls_ca, self.secret,
                                               options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                                        *CLIENT_KEEPALIVE, *self._reconnect_backoff()],
                                               interceptors=self.interceptors)
                    handle = WorkerHandle.connect(address, channel)
                    handles.append(handle)
                    self._followers[address] = asyncio.get_running_loop().create_task(
                        follow_kv_events(handle, router.prefixes, max(1.0, self.config.stats_interval_s)))
                    log.info("%s endpoint %s discovered", role, address)
            for h in [h for h in handles if h.address not in found]:
                h.live = False  # gone from discovery: no new requests; the channel closes once idle
                if h.in_flight == 0:
                    handles.remove(h)
                    if (follower := self._followers.pop(h.address, None)) is not None:
                        follower.cancel()
                    self.cluster.router.prefixes.unfollow(h.address)
                    asyncio.get_running_loop().create_task(h.channel.close())
                    log.info("%s endpoint %s removed (no longer discovered)", role, h.address)

    def _reconnect_backoff(self) -> list[tuple[str, int]]:
        """Channel options that keep gRPC's reconnect backoff near the poll interval: by default it grows to
        120 s, and a restarted worker rejoined 26-65 s after it was serving again."""
        ms = int(max(1.0, self.config.stats_interval_s) * 1000)
        return [("grpc.initial_reconnect_backoff_ms", ms), ("grpc.min_reconnect_backoff_ms", ms),
                ("grpc.max_reconnect_backoff_ms", 2 * ms)]

    # ---- polling ------------------------------------------------------------------------------------------------
    async def _poll(self, w: WorkerHandle, role: str) -> None:
        """One health + stats poll of a worker; updates its info, stats, failures and live flag. A poll may take
        POLL_TIMEOUT_S (at least the interval): with 1 s, idle workers on a busy host flapped out of routing."""
        timeout = max(self.config.stats_interval_s, POLL_TIMEOUT_S)
        try:
            health = await health_pb2_grpc.HealthStub(w.channel).Check(
                health_pb2.HealthCheckRequest(service=ROLE_SERVICE[role]), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            w.failures += 1
            if w.failures >= MAX_FAILED_POLLS:
                why = f"unreachable ({e.code().name})"
                self._set_live(w, False, why)
                # Its requests migrate now: a frozen worker's calls stay open (no error comes) until keepalive or
                # their deadlines end them. A draining worker (NOT_SERVING, below) keeps its requests.
                for flow in list(self.cluster.flows.values()):
                    flow.abandon(w.address, f"stopped answering health checks, {why}")
            return
        w.failures = 0  # it answers: a busy worker is alive, whatever its stats take
        if health.status != health_pb2.HealthCheckResponse.SERVING:
            self._set_live(w, False, "reports NOT_SERVING (draining or engine fault)")
            return
        routed_before = w.blocks_routed  # blocks routed while the poll runs may be missing from the report
        try:
            stats = await w.worker.GetStats(worker_pb2.WorkerStatsRequest(), timeout=timeout)
            if w.info is None or stats.instance_id != w.info.instance_id:
                w.info = await w.worker.GetInfo(worker_pb2.WorkerInfoRequest(), timeout=timeout)
                w.blocks_routed = 0
                self.cluster.router.prefixes.forget(w.address)  # a new process: an empty prefix cache
                log.info("%s worker %s: instance %s, KV %s", role, w.address, w.info.instance_id,
                         w.info.kv_address or "-")
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                self._set_live(w, False, f"refused our credentials: {e.details()}")
            elif w.info is None:
                log.info("%s worker %s not ready: %s", role, w.address, e.code().name)
            return  # keep its last stats and membership until its health says otherwise
        w.stats = stats
        w.blocks_routed -= min(routed_before, w.blocks_routed)
        problem = self._incompatibility(w, role)
        self._set_live(w, problem is None, problem or "")

    def _incompatibility(self, w: WorkerHandle, role: str) -> str | None:
        """Why this worker cannot serve in the cluster, or None. The first compatible worker sets the reference."""
        want = "colocated" if self.cluster.colocated and role == "decode" else role
        if w.info.role != want:
            return f"is a {w.info.role} worker, listed as {want}"
        reference = self.cluster.reference
        if reference is None:
            self.cluster.reference = w.info
            return None
        tp, want_tp = w.info.tensor_parallel_size or 1, reference.tensor_parallel_size or 1
        if tp != want_tp:
            return (f"has --tensor-parallel-size {tp}, the cluster uses {want_tp} (each KV block is split across the "
                    "ranks; resharding between sizes is not implemented: start every worker with the same size)")
        if w.info.compat_hash != reference.compat_hash:
            return (f"has KV layout {w.info.compat_hash}, the cluster uses {reference.compat_hash} "
                    "(same model, dtype and block size?)")
        return None

    def _set_live(self, w: WorkerHandle, live: bool, why: str) -> None:
        if w.live != live:
            self._changed = True
            if live:
                log.info("worker %s joined the routing set", w.address)
            else:
                log.warning("worker %s left the routing set: %s", w.address, why)
        w.live = live

    def report_lost(self, address: str, why: str) -> None:
        """A request's call to this worker failed as if it were gone (UNAVAILABLE): take it out of routing now,
        as a failed poll would, rather than wait for the next polls (passive health checking). Readiness follows
        at once (`on_change`): health said SERVING for 47 s while every request was refused, because the request
        path took the worker out behind membership's back and no poll ever saw a change. The next poll that
        finds it answering brings it back."""
        for w in self.cluster.router.workers:
            if w.address == address and w.live:
                self._set_live(w, False, f"a request's call failed: {why}")
                self.on_change()

    async def refresh(self) -> None:
        """One round: discovery when due, then poll every endpoint concurrently."""
        self._changed = False
        now = time.monotonic()
        if now - self._last_discovery >= self.config.discovery_interval_s:
            self._last_discovery = now
            self._discover()
        router = self.cluster.router
        await asyncio.gather(*(self._poll(w, "prefill") for w in router.prefill),
                             *(self._poll(w, "decode") for w in router.decode))
        if self._changed:
            self.on_change()

    async def wait_ready(self, timeout_s: float) -> None:
        """Poll until every configured role has a live worker (`Cluster.complete`: a fallback is for losing a role,
        not for starting without one).

        Raises:
            CommandError: naming the roles still missing after timeout_s, and the addresses tried.
        """
        start = time.monotonic()
        deadline, note = start + timeout_s, start + WAIT_NOTE_S
        while True:
            await self.refresh()
            if self.cluster.complete:
                self.cluster.limits  # noqa: B018 - taken now, so they are known even if every worker flaps later
                return
            if time.monotonic() >= note:  # an operator watching the log learns what it waits for
                note += WAIT_NOTE_S
                log.warning("waiting for a live %s worker (%.0f of %.0f s; prefill %s, decode %s)",
                            " and ".join(self.cluster.missing_roles()), time.monotonic() - start, timeout_s,
                            list(self.config.prefill), list(self.config.decode))
            if time.monotonic() > deadline:
                raise CommandError(f"no live {' or '.join(self.cluster.missing_roles())} worker after "
                                   f"{timeout_s:.0f}s (addresses: prefill {list(self.config.prefill)}, "
                                   f"decode {list(self.config.decode)})")
            self._last_discovery = float("-inf")  # keep resolving while we wait
            await asyncio.sleep(0.25)

    async def run(self) -> None:
        """Refresh every stats_interval_s until cancelled."""
        while True:
            await asyncio.sleep(self.config.stats_interval_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - one bad round must not end membership
                log.exception("membership refresh failed; retrying next interval")

    async def close(self) -> None:
        for follower in self._followers.values():
            follower.cancel()
        self._followers.clear()
        for w in self.cluster.router.workers:
            await w.channel.close()
