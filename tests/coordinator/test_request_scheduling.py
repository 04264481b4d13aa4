"""The front end of the scheduling policy, without servers or a model: the public fields reach the
workers' SchedulingHints and the engine's SchedulingParams; the tenant is the key, else the tenant field, else the
peer; per-caller limits answer RESOURCE_EXHAUSTED with a retry hint and the queued-token count is freed on every
exit; a request whose first token cannot come in time is refused before any worker is called."""
import asyncio
import math
import time

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from prometheus_client import CollectorRegistry

from pdserve_server.coordinator import flow as flows
from pdserve_server.coordinator.config import CoordinatorConfig
from pdserve_server.coordinator.errors import RequestError
from pdserve_server.coordinator.membership import Cluster
from pdserve_server.coordinator.metrics import CoordinatorMetrics
from pdserve_server.coordinator.router import Router, WorkerHandle
from pdserve_server.coordinator.scheduling import (MAX_TENANT_CHARS, RequestScheduling, SchedulingAsk,
                                                   check_first_token_deadline, first_token_due, grant_priority, hints,
                                                   read_tenants, resolve_tenant, without_deadline, Tenant)
from pdserve_server.coordinator.admission import CAPACITY_RETRY_S
from pdserve_server.coordinator.doors import grpc_call
from pdserve_server.coordinator.doors.generation import GenerationServicer
from pdserve_server.coordinator.request_path import RequestPath
from pdserve_server.engine.errors import EngineError, ErrorKind
from pdserve.client import build_request
from pdserve.v1 import generate_pb2, worker_pb2
from pdserve_server.server_common.errors import CommandError
from pdserve_server.server_common.security import key_id
from pdserve_server.worker_common.convert import scheduling_from_proto
from pdserve_server.worker_common.errors import STATUS_FOR_KIND


# ---- worker side: hints -> SchedulingParams -------------------------------------------------------------------------
def test_hints_become_the_engines_scheduling_params():
    msg = worker_pb2.SchedulingHints(priority=-3, tenant="batch", weight=2.5, ttft_deadline_ms=250)
    got = scheduling_from_proto(msg, now=1000.0)
    assert (got.priority, got.tenant, got.weight, got.deadline) == (-3, "batch", 2.5, 1000.25)
    # A remote-KV decode request keeps everything but the deadline (the prefill worker gives its first token).
    remote = scheduling_from_proto(msg, now=1000.0, with_deadline=False)
    assert (remote.priority, remote.tenant, remote.weight, remote.deadline) == (-3, "batch", 2.5, None)


def test_missing_hints_are_the_defaults():
    """A caller that sends no hints (an older coordinator, a test calling a worker directly) is scheduled as before:
    in particular an unset weight is 1, not proto3's 0 (which the engine would refuse)."""
    for msg in (None, worker_pb2.SchedulingHints()):
        got = scheduling_from_proto(msg, now=5.0)
        assert (got.priority, got.tenant, got.weight, got.deadline) == (0, "", 1.0, None)


@pytest.mark.parametrize("weight", [0.0, -1.0, math.nan, math.inf])
def test_a_weight_that_is_not_positive_is_invalid_argument(weight):
    with pytest.raises(EngineError) as e:
        scheduling_from_proto(worker_pb2.SchedulingHints(weight=weight), now=0.0)
    assert e.value.kind == ErrorKind.INVALID_REQUEST and "weight" in e.value.message
    assert STATUS_FOR_KIND[e.value.kind] == grpc.StatusCode.INVALID_ARGUMENT


class Aborted(Exception):
    """What a fake context's abort raises (grpc's raises too)."""

    def __init__(self, code, details="", trailing_metadata=()):
        super().__init__(details)
        self.code, self.details, self.trailing = code, details, trailing_metadata


CALLER = "peer:ipv4:10.0.0.1"  # grpc_call.caller of FakeContext's default peer


class FakeContext:
    def __init__(self, peer="ipv4:10.0.0.1:5555", metadata=(), remaining=None):
        self._peer, self._metadata, self.remaining = peer, metadata, remaining

    def invocation_metadata(self):
        return self._metadata

    def peer(self):
        return self._peer

    def time_remaining(self):
        return self.remaining

    async def abort(self, code, details="", trailing_metadata=()):
        raise Aborted(code, details, trailing_metadata)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_worker_edge_answers_a_bad_weight_with_invalid_argument(role):
    """The engine's INVALID_REQUEST is turned into INVALID_ARGUMENT before any engine work."""
    from pdserve_server.decode_worker.server import DecodeServicer
    from pdserve_server.prefill_worker.server import PrefillServicer

    hints_msg = worker_pb2.SchedulingHints(weight=-2)
    sampling = generate_pb2.SamplingParams(max_tokens=1)
    if role == "prefill":
        call = PrefillServicer(worker=None, sender=None).Prefill(worker_pb2.PrefillRequest(
            request_id="r", prompt_token_ids=[1], sampling=sampling, scheduling=hints_msg), FakeContext())
    else:
        call = DecodeServicer(worker=None, reservations=None, kv_timeout_s=1.0).Decode(worker_pb2.DecodeRequest(
            request_id="r", prompt_token_ids=[1], sampling=sampling, kv_source=worker_pb2.KV_SOURCE_LOCAL,
            scheduling=hints_msg), FakeContext())
    with pytest.raises(Aborted) as e:
        asyncio.run(call.__anext__())
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "weight" in e.value.details


# ---- coordinator: tenant, weights, hints ----------------------------------------------------------------------------
def test_the_tenant_is_the_key_else_the_field_else_the_peer():
    assert resolve_tenant("key:ab12cd34", "alice", keys_required=True) == "key:ab12cd34"  # the key decides
    assert resolve_tenant(CALLER, "alice", keys_required=False) == "alice"
    assert resolve_tenant(CALLER, "", keys_required=False) == CALLER


@pytest.mark.parametrize("tenant, needle", [("x" * (MAX_TENANT_CHARS + 1), "at most 128"),
                                            ("a\nb", "control")])
def test_a_bad_tenant_field_is_invalid_argument(tenant, needle):
    with pytest.raises(RequestError) as e:
        SchedulingAsk.from_request(generate_pb2.GenerateRequest(tenant=tenant))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.message


def test_the_sdk_sends_the_scheduling_fields():
    req = build_request([1, 2], None, "r", "", priority=-2, tenant="batch", ttft_slo_ms=300)
    assert SchedulingAsk.from_request(req) == SchedulingAsk(priority=-2, tenant="batch", ttft_slo_ms=300)


def test_tenant_weights_file(tmp_path):
    path = tmp_path / "weights"
    path.write_text("# tenant weight [floor]\nalice 2\n\nkey:ab12cd34   0.5 -10  # a key's id\npeer:10.0.0.9 3 +2\n")
    assert read_tenants(str(path)) == {"alice": Tenant(2.0), "key:ab12cd34": Tenant(0.5, -10),
                                       "peer:10.0.0.9": Tenant(3.0, 2)}
    assert read_tenants(None) == {}
    for text, needle in (("alice\n", "line 1: expected 'NAME WEIGHT"), ("a 1\nb 0\n", "line 2: weight must be"),
                         ("a nan\n", "must be a number in"), ("a 1e-9\n", "must be a number in"),
                         ("a 1\na 2\n", "listed twice"), ("a b c\n", "weight must be a number in .* got b"),
                         ("a 1 -1.5\n", "priority floor must be an integer"),
                         ("a 1 3000000000\n", "priority floor must be an integer in"), ("a 1 2 3\n", "expected")):
        path.write_text(text)
        with pytest.raises(CommandError, match=needle):
            read_tenants(str(path))
    with pytest.raises(CommandError, match="--tenant-weights"):
        read_tenants(str(tmp_path / "missing"))


@pytest.mark.parametrize("policy, keys_required, entry, asked, granted", [
    ("fcfs", False, Tenant(), 0, 0),
    ("fcfs", True, Tenant(1.0, -100), 0, 0),
    ("priority", False, Tenant(), -2**31, -2**31),  # an open port trusts its callers
    ("priority", False, Tenant(1.0, -3), -5, -3),  # a floor still bounds a named tenant
    ("priority", True, Tenant(), -2**31, 0),  # a key without a grant cannot run ahead of the default
    ("priority", True, Tenant(), 7, 7),  # asking to run later is always allowed
    ("priority", True, Tenant(1.0, -10), -5, -5),
    ("priority", True, Tenant(1.0, -10), -50, -10),
    ("priority", True, Tenant(1.0, 4), 0, 4),  # a floor above 0 demotes the tenant's every request
])
def test_priority_is_granted_by_the_operator(policy, keys_required, entry, asked, granted):
    ask = SchedulingAsk(priority=asked, tenant="t", ttft_slo_ms=5)
    assert grant_priority(ask, entry, policy, keys_required) == SchedulingAsk(granted, "t", 5)


def test_a_priority_under_fcfs_is_refused_naming_the_flag():
    with pytest.raises(RequestError) as e:
        grant_priority(SchedulingAsk(priority=-1), Tenant(), "fcfs", keys_required=False)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "--scheduling-policy priority" in e.value.message


def test_hints_carry_what_is_left_of_the_ttft_objective():
    ask = SchedulingAsk(priority=4, tenant="t", ttft_slo_ms=500)
    msg = hints(ask, "t", 2.0, arrival=100.0, first_token_sent=False, now=100.2)
    assert (msg.priority, msg.tenant, msg.weight, msg.ttft_deadline_ms) == (4, "t", 2.0, 300)
    assert hints(ask, "t", 1.0, arrival=100.0, first_token_sent=False, now=107.0).ttft_deadline_ms == 1  # missed
    assert hints(ask, "t", 1.0, arrival=100.0, first_token_sent=True, now=100.1).ttft_deadline_ms == 0  # resumed
    assert hints(SchedulingAsk(), "t", 1.0, arrival=100.0, first_token_sent=False).ttft_deadline_ms == 0
    assert without_deadline(msg).ttft_deadline_ms == 0 and without_deadline(msg).priority == 4


def test_the_first_token_is_due_at_the_earlier_of_the_objective_and_the_deadline():
    ask = SchedulingAsk(ttft_slo_ms=2000)
    assert first_token_due(ask, arrival=10.0, request_deadline=20.0, first_token_sent=False) == (12.0,
                                                                                                  "ttft_slo_ms=2000")
    assert first_token_due(ask, arrival=10.0, request_deadline=11.0, first_token_sent=False) == (
        11.0, "the call's deadline")
    assert first_token_due(ask, arrival=10.0, request_deadline=20.0, first_token_sent=True)[0] == 20.0


def test_a_first_token_predicted_too_late_is_refused_with_both_times():
    check_first_token_deadline("p0", None, due=1.0, why="x", now=5.0)  # no prediction yet: never refused
    check_first_token_deadline("p0", 0.5, due=10.0, why="x", now=9.0)  # 0.5 s < 1 s left
    with pytest.raises(RequestError) as e:
        check_first_token_deadline("p0", 2.5, due=10.0, why="ttft_slo_ms=1000", now=9.0)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "p0" in e.value.message and "2.500 s" in e.value.message and "1.000 s are left" in e.value.message
    assert "ttft_slo_ms=1000" in e.value.message


# ---- coordinator: refused before any worker call ------------------------------------------------------------------
class Stop(Exception):
    pass


class FakeCall:
    """A worker call: answers `responses`, then waits (until cancelled)."""

    def __init__(self, responses=()):
        self.responses, self.cancelled = list(responses), False

    def __aiter__(self):
        async def gen():
            for r in self.responses:
                yield r
            await asyncio.Event().wait()
        return gen()

    def cancel(self):
        self.cancelled = True


class Stubs:
    """A worker's Decode and Prefill stubs, recording each request."""

    def __init__(self, decode_responses=()):
        self.requests, self.decode_responses = [], decode_responses

    def Decode(self, request, timeout=None):
        self.requests.append(request)
        return FakeCall(self.decode_responses)

    def Prefill(self, request, timeout=None):
        self.requests.append(request)
        raise Stop  # enough: the request was seen


def handle(name, role, stubs):
    info = worker_pb2.WorkerInfo(role=role, num_blocks=100, block_size=16, kv_address=f"{name}:kv")
    return WorkerHandle(name, None, None, stubs, stubs, info=info, live=True)


def slow(worker: WorkerHandle) -> WorkerHandle:
    """A worker that has measured 100 prompt tokens/s and has 900 queued: a 100-token prompt waits 10 s."""
    worker.prefill_queue.tokens_per_s, worker.prefill_queue.pending_tokens = 100.0, 900
    return worker


PROMPT = list(range(1000, 1100))
SAMPLING = generate_pb2.SamplingParams(max_tokens=4)
HINTS = worker_pb2.SchedulingHints(priority=-1, tenant="t", weight=2.0, ttft_deadline_ms=900)


async def first_item(gen):
    try:
        return await gen.__anext__()
    finally:
        await gen.aclose()


def test_disaggregated_request_that_cannot_meet_its_deadline_calls_no_worker():
    prefill_stubs, decode_stubs = Stubs(), Stubs()
    router = Router([slow(handle("p0", "prefill", prefill_stubs))], [handle("d0", "decode", decode_stubs)])
    due = (time.monotonic() + 1.0, "ttft_slo_ms=1000")
    with pytest.raises(RequestError) as e:
        asyncio.run(first_item(flows.run_disaggregated(router, flows.Flow("r"), "r", PROMPT, [], SAMPLING, 0.0, 5.0,
                                                       HINTS, due)))
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and "10.000 s" in e.value.message
    assert prefill_stubs.requests == decode_stubs.requests == []  # nothing was sent
    p0, d0 = router.prefill[0], router.decode[0]
    assert p0.in_flight == d0.in_flight == 0 and p0.prefill_queue.pending_tokens == 900  # leases given back


def test_disaggregated_hints_reach_both_workers_the_decode_one_without_deadline():
    prefill_stubs = Stubs()
    decode_stubs = Stubs([worker_pb2.DecodeResponse(reserved=worker_pb2.DecodeReserved(num_blocks=7))])
    router = Router([handle("p0", "prefill", prefill_stubs)], [handle("d0", "decode", decode_stubs)])
    due = (time.monotonic() + 0.001, "ttft_slo_ms=1")  # no prediction yet (no rate): the workers decide
    with pytest.raises(Stop):
        asyncio.run(first_item(flows.run_disaggregated(router, flows.Flow("r"), "r", PROMPT, [], SAMPLING, 0.0, 5.0,
                                                       HINTS, due)))
    (decode_request,), (prefill_request,) = decode_stubs.requests, prefill_stubs.requests
    assert decode_request.kv_source == worker_pb2.KV_SOURCE_REMOTE
    assert decode_request.scheduling == without_deadline(HINTS)
    assert prefill_request.scheduling == HINTS


def test_colocated_request_that_cannot_meet_its_deadline_calls_no_worker():
    stubs = Stubs()
    router = Router([], [slow(handle("c0", "colocated", stubs))])
    with pytest.raises(RequestError) as e:
        asyncio.run(first_item(flows.run_colocated(router, flows.Flow("r"), "r", PROMPT, [], SAMPLING, 5.0, HINTS,
                                                   (time.monotonic() + 1.0, "the call's deadline"))))
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and "the call's deadline" in e.value.message
    assert stubs.requests == [] and router.decode[0].in_flight == 0
    router.decode[0].prefill_queue.tokens_per_s = None  # no prediction: the call goes out, with the hints
    with pytest.raises(TimeoutError):
        asyncio.run(asyncio.wait_for(first_item(flows.run_colocated(
            router, flows.Flow("r"), "r", PROMPT, [], SAMPLING, 5.0, HINTS, (time.monotonic() + 1.0, "x"))), 0.05))
    (request,) = stubs.requests
    assert request.kv_source == worker_pb2.KV_SOURCE_LOCAL and request.scheduling == HINTS


# ---- coordinator: the request path with a scripted worker --------------------------------------------------------
class FakeTokenizer:
    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


class Script:
    """The worker side of one attempt, driven by the test: `started` is set when the attempt begins; it then waits
    for `first` before the first token and for `finish` before the finish. `fail` raises instead, once."""

    def __init__(self):
        self.started, self.first, self.finish = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.fail: RequestError | None = None
        self.attempts: list[flows.Flow] = []

    def __call__(self, flow, prompt, sampling, arrival_wall, p):
        return self.run(flow)

    async def run(self, flow):
        self.attempts.append(flow)
        call = FakeCall()
        flow.calls.append(call)  # Abort cancels it; the worker call then ends with CancelledError (WorkerCall.next)
        self.started.set()
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error
        while not self.first.is_set():
            if call.cancelled:
                raise asyncio.CancelledError
            await asyncio.sleep(0.001)
        yield flows.Tokens([worker_pb2.SampledToken(token_id=1)])
        await self.finish.wait()
        yield flows.WorkerFinish(generate_pb2.FINISH_REASON_LENGTH, None)


def servicer(keys_required=False, tenants=None, **config) -> RequestPath:
    """The request path of a colocated coordinator with no workers (tests set its `_attempt`)."""
    s = RequestPath(CoordinatorConfig(model_dir="m", model_name="n", colocated=True, **config),
                    Cluster(router=None, colocated=True), tokenizer=FakeTokenizer(),
                    metrics=CoordinatorMetrics(CollectorRegistry(), "n"), keys_required=keys_required,
                    tenants=tenants)
    s.lost = []
    s.on_worker_lost = lambda address, why: s.lost.append(address)
    return s


class DoorRequest:
    """A door's request (`request_path.DoorRequest`): `prepare` given, messages kept in `sent`."""

    operation = "text_completion"

    def __init__(self, rid: str, prepare, ask: SchedulingAsk | None = None):
        self.request_id, self._prepare, self.ask, self.sent = rid, prepare, ask, []

    async def prepare(self):
        return await self._prepare()

    def scheduling(self) -> SchedulingAsk:
        return self.ask if self.ask is not None else SchedulingAsk()

    async def send(self, msg):
        self.sent.append(msg)


def serve(s: RequestPath, rid: str, num_tokens: int, context=None, ask=None, n=1, max_tokens=4, prepare=None):
    """One request through the path as a gRPC door runs it (`grpc_call.run`: a RequestError aborts the call);
    returns the messages sent."""
    async def prompt_and_sampling():
        return list(range(num_tokens)), generate_pb2.SamplingParams(max_tokens=max_tokens, n=n)

    request = DoorRequest(rid, prepare or prompt_and_sampling, ask)

    async def run():
        await grpc_call.run(s, context or FakeContext(), request)
        return request.sent
    return run()


def retry_delay_s(trailing) -> float:
    status = status_pb2.Status.FromString(dict(trailing)["grpc-status-details-bin"])
    info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info)
    return info.retry_delay.ToTimedelta().total_seconds()


def test_queued_tokens_limit_counts_until_the_first_token():
    async def main():
        s = servicer(max_queued_tokens_per_caller=10)
        first_script = Script()
        s._attempt = first_script
        first = asyncio.create_task(serve(s, "a", 6))
        await first_script.started.wait()
        assert s.admission.queued_tokens(CALLER) == 6
        with pytest.raises(Aborted) as e:  # 6 + 6 > 10
            await serve(s, "b", 6)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "10" in e.value.details
        assert retry_delay_s(e.value.trailing) == CAPACITY_RETRY_S
        other = FakeContext(peer="ipv4:10.0.0.2:1")  # another caller has its own budget
        s._attempt = other_script = Script()
        other_script.first.set(), other_script.finish.set()
        await serve(s, "b", 6, other)
        first_script.first.set()  # the first request has its first token: its prompt no longer counts
        while s.admission.queued_tokens(CALLER):
            await asyncio.sleep(0.001)
        s._attempt = again = Script()
        again.first.set(), again.finish.set()
        sent = await serve(s, "c", 10)
        assert sent[-1].final.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        first_script.finish.set()
        await first
        with pytest.raises(Aborted) as e:  # can never fit: retrying cannot help
            await serve(s, "d", 11)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "--max-queued-tokens-per-caller" in e.value.details
    asyncio.run(main())


@pytest.mark.parametrize("exit", ["error", "cancel", "abort", "migration", "finish"])
def test_queued_tokens_are_given_back_on_every_exit(exit):
    """A leaked count would lock the caller out for good: after each way a request can end before its first
    token, the caller may queue its whole limit again."""
    async def main():
        s = servicer(max_queued_tokens_per_caller=8, max_migrations=1)
        script = Script()
        s._attempt = script
        if exit == "error":
            script.fail = RequestError(grpc.StatusCode.INVALID_ARGUMENT, "bad")
        elif exit == "migration":
            script.fail = RequestError(grpc.StatusCode.UNAVAILABLE, "lost", worker="w0")
        task = asyncio.create_task(serve(s, "r", 8))
        await script.started.wait()
        if exit == "migration":  # resumed on another worker, still before its first token: still counted
            while len(script.attempts) < 2:
                await asyncio.sleep(0.001)
            assert s.admission.queued_tokens(CALLER) == 8 and s.lost == ["w0"]
            script.first.set(), script.finish.set()
            await task
        elif exit == "error":
            with pytest.raises(Aborted):
                await task
        elif exit == "cancel":
            await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        elif exit == "abort":
            assert s.abort(CALLER, "r")
            sent = await task
            assert sent[-1].final.finish_reason == generate_pb2.FINISH_REASON_ABORT
        else:
            script.first.set(), script.finish.set()
            await task
        assert s.admission.queued_tokens(CALLER) == 0 and not s.cluster.flows
        s._attempt = again = Script()
        again.first.set(), again.finish.set()
        assert (await serve(s, "next", 8))[-1].HasField("final")
    asyncio.run(main())


def test_in_flight_per_caller_limit_carries_a_retry_hint():
    async def main():
        s = servicer(max_in_flight_per_caller=1)
        s._attempt = script = Script()
        task = asyncio.create_task(serve(s, "a", 3))
        await script.started.wait()
        with pytest.raises(Aborted) as e:
            await serve(s, "b", 3)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "sequences in flight" in e.value.details
        assert retry_delay_s(e.value.trailing) == CAPACITY_RETRY_S
        script.first.set(), script.finish.set()
        await task
    asyncio.run(main())


def test_a_request_of_n_samples_takes_n_slots():
    async def main():
        s = servicer(max_in_flight=6, max_in_flight_per_caller=4)
        s._attempt = script = Script()
        task = asyncio.create_task(serve(s, "a", 3, n=3))
        await script.started.wait()
        with pytest.raises(Aborted) as e:  # 3 + 2 > 4 for this caller
            await serve(s, "b", 3, n=2)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "3 sequences in flight" in e.value.details
        assert retry_delay_s(e.value.trailing) == CAPACITY_RETRY_S
        with pytest.raises(Aborted) as e:  # more than one caller may ever have: retrying cannot help
            await serve(s, "c", 3, n=5)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "--max-in-flight-per-caller 4" in e.value.details
        assert sum(f.samples for f in s.cluster.flows.values()) == 3  # the refusals hold nothing
        other = asyncio.create_task(serve(s, "d", 3, FakeContext(peer="ipv4:10.0.0.2:5"), n=3))
        await asyncio.sleep(0)
        with pytest.raises(Aborted) as e:  # 3 + 3 of the server's 6
            await serve(s, "e", 3, FakeContext(peer="ipv4:10.0.0.3:5"))
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "server at capacity" in e.value.details
        task.cancel(), other.cancel()  # the scripted worker streams one sample only: the client goes instead
        await asyncio.gather(task, other, return_exceptions=True)
        assert not s.cluster.flows
    asyncio.run(main())


def test_the_token_rate_limit_charges_every_sample():
    async def main():
        s = servicer(rate_limit_tokens_per_s=100.0, rate_limit_burst_s=1.0)
        s._attempt = script = Script()
        script.first.set(), script.finish.set()
        with pytest.raises(Aborted) as e:  # 3 + 2 x 60 = 123 > a burst of 100
            await serve(s, "a", 3, n=2, max_tokens=60)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "123 tokens" in e.value.details
        await serve(s, "b", 3, n=1, max_tokens=60)  # 63 fits
    asyncio.run(main())


@pytest.mark.parametrize("keys_required, metadata, field, tenant, granted", [
    (False, (), "", CALLER, -7),
    (False, (), "alice", "alice", -7),
    (True, (("authorization", "Bearer sk-1"),), "alice", "key:" + key_id("sk-1"), -7),  # the key decides
    (True, (("authorization", "Bearer sk-2"),), "", "key:" + key_id("sk-2"), 0),  # no grant: cannot overtake
])
def test_the_request_path_resolves_tenant_weight_and_priority(keys_required, metadata, field, tenant, granted):
    async def main():
        tenants = {"alice": Tenant(3.0), "key:" + key_id("sk-1"): Tenant(0.5, -20)}
        s = servicer(keys_required=keys_required, tenants=tenants, scheduling_policy="priority")
        s._attempt = script = Script()
        script.first.set(), script.finish.set()
        await serve(s, "r", 3, FakeContext(metadata=metadata), SchedulingAsk(priority=-7, tenant=field,
                                                                            ttft_slo_ms=60_000))
        sched: RequestScheduling = script.attempts[0].scheduling
        assert sched.tenant == tenant and sched.weight == tenants.get(tenant, Tenant()).weight
        msg = sched.hints(first_token_sent=False)
        assert msg.priority == granted and msg.tenant == tenant and 0 < msg.ttft_deadline_ms <= 60_000
        # Per-caller limits and id scoping still use the caller, not the tenant field.
        assert script.attempts[0].caller == (tenant if keys_required else CALLER)
    asyncio.run(main())


def test_a_priority_through_a_fcfs_door_is_refused_before_any_worker_is_called():
    async def main():
        s = servicer()  # the default policy, fcfs
        s._attempt = script = Script()
        with pytest.raises(Aborted) as e:
            await serve(s, "r", 3, FakeContext(), SchedulingAsk(priority=-1))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "--scheduling-policy" in e.value.details
        assert not script.attempts
    asyncio.run(main())


def test_a_bad_tenant_through_the_public_door_is_invalid_argument():
    async def main():
        door = GenerationServicer(servicer())

        async def prepare(request):
            return [1, 2, 3], generate_pb2.SamplingParams(max_tokens=4)
        door._prepare = prepare
        with pytest.raises(Aborted) as e:
            await door.Generate(generate_pb2.GenerateRequest(request_id="r", tenant="x" * 200), FakeContext())
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "tenant" in e.value.details
        assert not door.cluster.flows
    asyncio.run(main())


# ---- KServe: Triton's priority parameter ---------------------------------------------------------------------------
def test_triton_priority_maps_to_ours():
    from pdserve_server.coordinator.doors.kserve import pb
    from pdserve_server.coordinator.doors.kserve_sampling import DEFAULT_PRIORITY_LEVEL, to_priority

    def params(**kw):
        r = pb.ModelInferRequest()
        for kind, value in kw.items():
            setattr(r.parameters["priority"], kind, value)
        return r.parameters

    assert to_priority(pb.ModelInferRequest().parameters) == 0
    assert to_priority(params(uint64_param=0)) == 0  # the default level
    assert to_priority(params(uint64_param=1)) == 1 - DEFAULT_PRIORITY_LEVEL < 0  # highest: sooner than default
    assert to_priority(params(uint64_param=DEFAULT_PRIORITY_LEVEL)) == 0
    assert to_priority(params(int64_param=DEFAULT_PRIORITY_LEVEL + 5)) == 5  # later than default
    assert to_priority(params(uint64_param=2**63)) == 2**31 - 1  # clamped to our int32
    for bad in (dict(int64_param=-1), dict(string_param="high"), dict(double_param=1.5), dict(bool_param=True)):
        with pytest.raises(RequestError) as e:
            to_priority(params(**bad))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "priority" in e.value.message


@pytest.mark.parametrize("rid", ["a\nrequest forged OK: 3 prompt", "\x1b[31mred", "tab\there", "nul\x00"])
def test_request_ids_with_control_characters_are_refused_and_logged_escaped(rid, caplog):
    """A client-chosen id with a newline and ANSI escapes was written raw into the access log, forging lines."""
    async def main():
        with pytest.raises(Aborted) as e:
            await serve(servicer(), rid, 3)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "control or unprintable" in e.value.details
    with caplog.at_level("INFO", logger="pdserve.access"):
        asyncio.run(main())
    (line,) = [r.getMessage() for r in caplog.records if r.name == "pdserve.access"]
    assert line.startswith(f"request {ascii(rid)} INVALID_ARGUMENT") and line.isprintable()


@pytest.mark.parametrize("fail_after_tokens", [False, True])
def test_n_samples_are_retried_elsewhere_while_none_has_streamed(fail_after_tokens):
    """After kill -9 of a decode worker an n=2 request with nothing sent failed with the worker's
    address and transport text. Now it runs again on another worker; once a sample has streamed it cannot (the
    samples sent different tokens) and fails with a message naming no internals."""
    lost = RequestError(grpc.StatusCode.UNAVAILABLE, "decode worker 10.0.0.5:7000: Stream removed (recvmsg:reset)",
                        worker="10.0.0.5:7000", public="the decode worker serving this request was lost (UNAVAILABLE)")
    attempts = []

    async def attempt(flow, prompt, sampling, arrival_wall, p):
        attempts.append(p.migrations)
        if len(attempts) == 1:
            if fail_after_tokens:
                yield flows.Tokens([worker_pb2.SampledToken(token_id=1)], index=1)
            raise lost
        for i in range(2):
            yield flows.Tokens([worker_pb2.SampledToken(token_id=2 + i)], index=i)
        for i in range(2):
            yield flows.WorkerFinish(generate_pb2.FINISH_REASON_LENGTH, None, index=i)

    async def main():
        s = servicer(max_migrations=2)
        s._attempt = attempt
        if fail_after_tokens:
            with pytest.raises(Aborted) as e:
                await serve(s, "r", 3, n=2, max_tokens=1)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE and "10.0.0.5" not in e.value.details
            assert "was lost" in e.value.details and attempts == [0]
        else:
            sent = await serve(s, "r", 3, n=2, max_tokens=1)
            finals = [m for m in sent if m.WhichOneof("response") == "final"]
            assert len(finals) == 2 and attempts == [0, 1]  # the retry has its own worker-side id
        assert s.lost == ["10.0.0.5:7000"]
    asyncio.run(main())


def test_the_access_log_tells_a_refused_prompt_size_and_a_cancelled_n_request_unfinished(caplog):
    """A refused 10,001-token prompt was logged with 0 prompt tokens, and a cancelled n = 2 request
    with sample 0's "finish length"."""
    import logging

    from pdserve_server.coordinator.stream import Progress, merged
    from pdserve_server.coordinator.validation import Limits, check_prompt_length

    caplog.set_level(logging.INFO, logger="pdserve.access")

    async def main():
        s = servicer()

        async def prepare():
            check_prompt_length(10_001, Limits(context_length=8192, kv_capacity_tokens=8192, vocab_size=100))
        with pytest.raises(Aborted):
            await serve(s, "long", 0, prepare=prepare)
    asyncio.run(main())
    (line,) = [r.access for r in caplog.records if r.access["request_id"] == "long"]
    assert line["prompt_tokens"] == 10_001 and line["error_code"] == "INVALID_ARGUMENT"

    done, running = Progress(), Progress()
    done.reason = generate_pb2.FINISH_REASON_LENGTH
    assert not merged([done, running]).ended and merged([done, done]).reason == generate_pb2.FINISH_REASON_LENGTH
