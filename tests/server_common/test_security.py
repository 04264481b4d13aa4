"""Strangers are kept out: API keys and TLS (and mTLS) on the public port, the cluster secret on worker APIs and on
the KV channel, per-key rate limits with a retry hint."""
import asyncio
import contextlib
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from pdserve_server.cli.launcher import _spawn, wait_ready
from pdserve_server.coordinator.ratelimit import RateLimiter
from pdserve_server.engine.errors import ErrorKind
from pdserve_server.kv_transfer import get_backend
from pdserve_server.kv_transfer.receiver import KvReceiver
from pdserve_server.kv_transfer.sender import KvSender, TransferError
from pdserve_server.kv_transfer.wire import PROTOCOL_VERSION
from helpers import scrape_when, total
from pdserve import Client, SamplingParams, tls_credentials
from pdserve.client import build_request
from pdserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc
from pdserve_server.server_common.security import BearerTokenInterceptor, presented_token, read_api_keys

KEY = "sk-test-0123456789"


# ---- units ---------------------------------------------------------------------------------------------------------
def test_bearer_tokens_are_parsed_and_checked():
    assert presented_token([("authorization", "Bearer abc ")]) == "abc"
    assert presented_token([("x-api-key", "abc")]) == "abc"
    assert presented_token([("authorization", "Basic abc")]) is None
    check = BearerTokenInterceptor(["k1", "k2"], "API key")
    assert check.accepts("k2") and not check.accepts("k3") and not check.accepts(None)


def test_api_keys_from_file_and_environment(tmp_path, monkeypatch):
    path = tmp_path / "keys"
    path.write_text("# ops team\nk1\n\n  k2  \n")
    monkeypatch.setenv("PDSERVE_API_KEYS", "k3, k4")
    assert read_api_keys(str(path)) == ["k1", "k2", "k3", "k4"]


def test_rate_limiter_refills_and_hints_the_wait():
    now = [0.0]
    limiter = RateLimiter(requests_per_s=2, tokens_per_s=100, burst_s=1, clock=lambda: now[0])
    assert limiter.admit("a", "requests", 1) == 0 and limiter.admit("a", "requests", 1) == 0
    assert limiter.admit("a", "requests", 1) == pytest.approx(0.5)  # third within the second: wait half a second
    assert limiter.admit("b", "requests", 1) == 0  # per caller
    assert limiter.admit("a", "tokens", 150) == float("inf")  # larger than the burst: never
    assert limiter.admit("a", "tokens", 80) == 0 and limiter.admit("a", "tokens", 80) == pytest.approx(0.6)
    now[0] = 0.5
    assert limiter.admit("a", "requests", 1) == 0
    assert not RateLimiter(0, 0).enabled and RateLimiter(0, 0).admit("x", "tokens", 10 ** 9) == 0


class Sink:
    def __init__(self, reserved):
        self.reserved, self.ended = reserved, {}

    def begin_receive(self, rid, first_block, num_blocks, num_tokens, trace_context):
        if rid not in self.reserved:
            raise LookupError(f"no reservation for {rid}")
        return self.reserved[rid]

    def end_receive(self, rid, first_token, error):
        self.ended[rid] = (first_token, error)


@pytest.mark.parametrize("sender_secret,ok", [("s3cret", True), (None, False), ("wrong", False)])
def test_kv_handshake_proves_the_cluster_secret(sender_secret, ok):
    """A stranger could fill another request's reserved blocks; now the hello must carry HMAC(secret, nonce)."""
    import torch

    async def main():
        src = [torch.full((64,), i, dtype=torch.uint8) for i in range(2)]
        dst = [torch.zeros(64, dtype=torch.uint8) for _ in range(2)]
        sink = Sink({"r": [1]})
        receiver = KvReceiver(get_backend("tcp"), "h", lambda b: [dst[b]], sink, timeout_s=5, secret="s3cret")
        address = await receiver.start("127.0.0.1")
        sender = KvSender("h", lambda b: [src[b]], timeout_s=5, secret=sender_secret)
        try:
            if ok:
                await sender.send(address, "r", 7, [0], num_tokens=3)
                assert (dst[1] == 0).all() and sink.ended["r"] == (7, None)
            else:
                with pytest.raises(TransferError) as e:
                    await sender.send(address, "r", 7, [0], num_tokens=3)
                assert e.value.kind == ErrorKind.INCOMPATIBLE_PEER and "authentication" in e.value.message
                assert "r" not in sink.ended and (dst[1] == 0).all()
        finally:
            sender.close()
            receiver.close()
    asyncio.run(main())


async def assert_still_serving(address: str, secret: str | None = None) -> None:
    """The KV port still answers a well-formed sender (an offer for an unknown request: TRANSFER_REJECTED)."""
    sender = KvSender("h", lambda b: None, timeout_s=30, secret=secret)
    try:
        with pytest.raises(TransferError) as e:
            await sender.send(address, "ghost", 1, [], num_tokens=1)
        assert e.value.kind == ErrorKind.TRANSFER_REJECTED
    finally:
        sender.close()


def test_kv_port_survives_huge_length_headers_and_garbage_offers():
    """A 4-byte header of 1 GiB used to allocate 1 GiB up front; a malformed offer is dropped, not crashed on."""
    import struct

    async def main():
        sink = Sink({})
        receiver = KvReceiver(get_backend("tcp"), "h", lambda b: None, sink, timeout_s=5)
        address = await receiver.start("127.0.0.1")
        port = int(address.rsplit(":", 1)[1])
        try:
            for payload in (struct.pack("!I", 1 << 30) + b"x" * 16,
                            struct.pack("!I", 2) + b"[]",
                            None):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                await reader.readexactly(struct.unpack("!I", await reader.readexactly(4))[0])  # the challenge
                if payload is None:  # a valid hello, then a malformed offer
                    for msg in (b'{"version": 2, "compat_hash": "h"}', b'{"type": "offer", "request_id": 5}'):
                        writer.write(struct.pack("!I", len(msg)) + msg)
                    await reader.readexactly(struct.unpack("!I", await reader.readexactly(4))[0])  # hello_ack
                else:
                    writer.write(payload)
                await writer.drain()
                try:  # the receiver hangs up on us: EOF, or a reset when our bytes were still unread
                    assert await asyncio.wait_for(reader.read(), 5) == b""
                except ConnectionResetError:
                    pass
                writer.close()
            await assert_still_serving(address)
        finally:
            receiver.close()
    asyncio.run(main())


def test_ucx_kv_port_refuses_a_huge_announced_size_before_allocating_it():
    """ucxx's recv_obj allocated whatever 8-byte length a stranger sent, before the hello was authenticated (1 GiB
    of RSS for 8 bytes). The channel now checks the length first and hangs up; the port keeps serving."""
    import array

    import ucxx

    from pdserve_server.kv_transfer.channel import ChannelClosed
    from pdserve_server.kv_transfer.ucx import UcxChannel

    def rss_bytes() -> int:
        """This process's resident set now (the receiver runs in it)."""
        status = Path("/proc/self/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024

    async def main():
        sink = Sink({})
        receiver = KvReceiver(get_backend("ucx"), "h", lambda b: None, sink, timeout_s=30, secret="s3cret")
        address = await receiver.start("127.0.0.1")
        port = int(address.rsplit(":", 1)[1])
        try:
            ep = await ucxx.create_endpoint("127.0.0.1", port)
            stranger = UcxChannel(ep)
            await asyncio.wait_for(stranger.recv_msg(), 30)  # the challenge
            before = rss_bytes()
            await ep.send(array.array("Q", [1 << 30]))  # "a 1 GiB hello follows"
            with pytest.raises(ChannelClosed):  # the receiver hangs up instead of allocating and waiting for it
                await asyncio.wait_for(stranger.recv_msg(), 30)
            assert rss_bytes() - before < 128 << 20  # the announced GiB was never allocated
            stranger.close()
            await assert_still_serving(address, secret="s3cret")
        finally:
            receiver.close()
            from pdserve_server.kv_transfer.ucx import reset
            reset()
    asyncio.run(main())


def test_kv_handshake_tells_a_stranger_nothing_and_survives_a_non_ascii_mac():
    """The secret is checked before the layout (a stranger used to be told the expected layout hash), and a
    non-ASCII mac (compare_digest raised TypeError on it) is refused like any wrong one."""
    import json
    import struct

    async def main():
        receiver = KvReceiver(get_backend("tcp"), "layout-h", lambda b: None, Sink({}), timeout_s=5, secret="s3cret")
        address = await receiver.start("127.0.0.1")
        port = int(address.rsplit(":", 1)[1])
        try:
            for hello in ({"type": "hello", "version": PROTOCOL_VERSION, "compat_hash": "other", "mac": "x"},
                          {"type": "hello", "version": PROTOCOL_VERSION, "compat_hash": "layout-h", "mac": "\u00e9\u00e9"}):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                await reader.readexactly(struct.unpack("!I", await reader.readexactly(4))[0])  # the challenge
                msg = json.dumps(hello).encode()
                writer.write(struct.pack("!I", len(msg)) + msg)
                await writer.drain()
                ack = json.loads(await reader.readexactly(struct.unpack("!I", await reader.readexactly(4))[0]))
                assert ack["ok"] is False and "authentication failed" in ack["error"]
                assert "layout-h" not in ack["error"]
                writer.close()
        finally:
            receiver.close()
    asyncio.run(main())


# ---- a cluster with a locked front door ---------------------------------------------------------------------------
def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, signed by the CA (openssl)."""
    d = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=test-ca", cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
                      ("client", "extendedKeyUsage=clientAuth")):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    (d / "keys").write_text(f"{KEY}\nanother-key\n")
    return d


@pytest.fixture(scope="module")
def workers(tiny_model_dir, launch_module):
    c = launch_module(tiny_model_dir, worker_args=["--dtype", "float32", "--kv-tokens", "1024", "--max-model-len",
                                                   "256", "--connector", "tcp"])
    yield c
    for p in getattr(c, "extra", []):
        p.terminate()


def start_coordinator(workers, tiny_model_dir, name, *flags) -> dict:
    """Start another coordinator in front of the same workers, with `flags`; returns its ready file's contents
    ("address", and "metrics_url" with --metrics-port)."""
    secret_file = Path(workers.workdir) / "cluster.secret"
    args = ["coordinator", "--model", str(tiny_model_dir), "--served-model-name", "tiny", "--cluster-secret-file",
            str(secret_file), "--prefill", workers.worker_addresses["prefill-0"],
            "--decode", workers.worker_addresses["decode-0"], *flags]
    proc, ready, _ = _spawn(args, name, Path(workers.workdir), Path(workers.workdir), dict(__import__("os").environ))
    workers.extra = [*getattr(workers, "extra", []), proc]
    return wait_ready([(name, proc, ready)], 120)[0]


def coordinator(workers, tiny_model_dir, name, *flags) -> str:
    """start_coordinator's address."""
    return start_coordinator(workers, tiny_model_dir, name, *flags)["address"]


GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@contextlib.contextmanager
def one_request_held(client: Client, decode: subprocess.Popen, metrics_url: str, request_id: str = ""):
    """One request of `client` (GREEDY, 4 tokens) in flight until the block resumes `decode` (SIGCONT) or ends,
    whatever the machine's speed; yields its gRPC call. The decode worker is paused (SIGSTOP) before the request is
    sent, so the request cannot end; the block starts once the coordinator counts it in flight (its
    pdserve:num_requests_in_flight gauge, raised in the same step as the slot and the id are taken). Pausing after
    the first token raced: on a loaded machine the worker had sent every token before the signal. At the block's
    end the worker is resumed and the call cancelled (nothing if it already ended)."""
    decode.send_signal(signal.SIGSTOP)
    call = client.stub.Generate(build_request([5, 6, 7], GREEDY, request_id, ""), metadata=client.metadata)
    try:
        held = scrape_when(metrics_url, "pdserve:num_requests_in_flight", 1, timeout_s=120)
        assert total(held, "pdserve:num_requests_in_flight") == 1, "the held request never reached the coordinator"
        yield call
    finally:
        decode.send_signal(signal.SIGCONT)
        call.cancel()


def test_tls_and_api_key_on_the_public_port(workers, tiny_model_dir, pki):
    address = coordinator(workers, tiny_model_dir, "tls-coordinator", "--tls-cert", str(pki / "server.pem"),
                          "--tls-key", str(pki / "server.key"), "--api-keys-file", str(pki / "keys"))
    creds = tls_credentials(ca_file=str(pki / "ca.pem"))
    with Client(address, credentials=creds, api_key=KEY) as c:
        assert c.complete([5, 6, 7], GREEDY).completion_tokens == 4
    for key, needle in ((None, "missing API key"), ("nope", "invalid API key")):
        with Client(address, credentials=creds, api_key=key) as c, pytest.raises(grpc.RpcError) as e:
            c.complete([5, 6, 7], GREEDY)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and needle in e.value.details()
    with Client(address, api_key=KEY) as c, pytest.raises(grpc.RpcError) as e:  # plaintext to a TLS port
        c.complete([5, 6, 7], GREEDY, timeout=5)
    assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    with grpc.secure_channel(address, creds) as ch:  # probes need no key
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_a_client_built_only_from_reflection_works_with_tls_and_key(workers, tiny_model_dir, pki):
    """The grpcurl path (reflection + TLS + an authorization header), with grpcio's reflection client: grpcurl
    itself cannot be installed here (no Debian, PyPI or npm package; GitHub is unreachable)."""
    from google.protobuf import descriptor_pool, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    address = coordinator(workers, tiny_model_dir, "reflect-coordinator", "--tls-cert", str(pki / "server.pem"),
                          "--tls-key", str(pki / "server.key"), "--api-keys-file", str(pki / "keys"))
    with grpc.secure_channel(address, tls_credentials(ca_file=str(pki / "ca.pem"))) as ch:
        auth = (("authorization", f"Bearer {KEY}"),)

        class AuthedChannel:  # the reflection client takes a channel; it must send the key too

            def stream_stream(self, *a, **k):
                call = ch.stream_stream(*a, **k)
                return lambda requests, **kw: call(requests, metadata=auth, **kw)

        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(AuthedChannel()))
        method = pool.FindServiceByName("pdserve.v1.Generation").methods_by_name["Generate"]
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        request = request_cls()
        request.token_ids.ids.extend([5, 6, 7])
        request.sampling.max_tokens, request.sampling.temperature, request.sampling.ignore_eos = 3, 0.0, True
        call = ch.unary_stream("/pdserve.v1.Generation/Generate", request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=response_cls.FromString)
        responses = list(call(request, metadata=auth, timeout=30))
    assert sum(len(r.chunk.token_ids) for r in responses) == 3 and responses[-1].HasField("final")


def test_mutual_tls_requires_a_client_certificate(workers, tiny_model_dir, pki):
    address = coordinator(workers, tiny_model_dir, "mtls-coordinator", "--tls-cert", str(pki / "server.pem"),
                          "--tls-key", str(pki / "server.key"), "--tls-client-ca", str(pki / "ca.pem"))
    with Client(address, credentials=tls_credentials(str(pki / "ca.pem"), str(pki / "client.pem"),
                                                     str(pki / "client.key"))) as c:
        assert c.complete([5, 6, 7], GREEDY).completion_tokens == 4
    with Client(address, credentials=tls_credentials(str(pki / "ca.pem"))) as c, pytest.raises(grpc.RpcError) as e:
        c.complete([5, 6, 7], GREEDY, timeout=5)
    assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    # The container health check reads TLS from the ready file and needs the probe's own client certificate.
    from pdserve_server.cli import healthcheck

    ready = str(Path(workers.workdir) / "mtls-coordinator.ready")
    client = ["--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(pki / "client.pem"), "--tls-key",
              str(pki / "client.key")]
    assert healthcheck.main(["--ready-file", ready, *client]) == 0
    assert healthcheck.main(["--address", address, *client, "--tls-server-name", "localhost"]) == 0
    assert healthcheck.main(["--ready-file", ready, "--tls-ca", str(pki / "ca.pem")]) == 1  # no client cert
    assert healthcheck.main(["--ready-file", ready]) == 1  # the system's roots do not know the test CA


def test_rate_limit_answers_resource_exhausted_with_retry_info(workers, tiny_model_dir):
    address = coordinator(workers, tiny_model_dir, "limited-coordinator", "--rate-limit-requests-per-s", "0.2")
    with Client(address) as c:
        c.complete([5, 6, 7], GREEDY)
        with pytest.raises(grpc.RpcError) as e:
            c.complete([5, 6, 7], GREEDY)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry after" in e.value.details()
    status = rpc_status.from_call(e.value)
    info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info) and 0 < info.retry_delay.ToTimedelta().total_seconds() <= 5


def test_worker_apis_and_kv_port_refuse_callers_without_the_cluster_secret(workers):
    """The internal APIs were open: a lease of 2^32-1 ms or an out-of-vocab Decode from anyone."""
    address = workers.worker_addresses["decode-0"]
    with grpc.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.RpcError) as e:
                stub.GetStats(worker_pb2.WorkerStatsRequest(), timeout=5, metadata=metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            list(worker_pb2_grpc.DecodeStub(ch).Decode(worker_pb2.DecodeRequest(
                request_id="x", prompt_token_ids=[5], sampling=generate_pb2.SamplingParams(max_tokens=1)), timeout=5))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        info = stub.GetInfo(worker_pb2.WorkerInfoRequest(), timeout=5, metadata=workers.worker_metadata)
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING  # probes stay open

    async def stranger_sends_kv():
        sender = KvSender(info.compat_hash, lambda b: None, timeout_s=5)  # knows the layout, not the secret
        try:
            await sender.send(info.kv_address, "someone-else", 1, [], num_tokens=1)
        finally:
            sender.close()

    with pytest.raises(TransferError) as e:
        asyncio.run(stranger_sends_kv())
    assert e.value.kind == ErrorKind.INCOMPATIBLE_PEER and "authentication" in e.value.message


def test_one_caller_cannot_take_every_slot(workers, tiny_model_dir):
    """Sixty-four streams of one client used to fill every batch slot while other clients waited."""
    info = start_coordinator(workers, tiny_model_dir, "fair-coordinator", "--max-in-flight-per-caller", "1",
                             "--metrics-port", "0")
    with Client(info["address"]) as c:
        with one_request_held(c, workers.processes["decode-0"], info["metrics_url"]), \
                pytest.raises(grpc.RpcError) as e:
            c.complete([5, 6, 7], GREEDY)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "sequences in flight" in e.value.details()


def test_without_api_keys_a_presented_key_does_not_make_a_new_caller(workers, tiny_model_dir):
    """With no keys configured, any bearer token used to become a caller of its own: random keys bypassed
    --max-in-flight-per-caller (40 of 40 admitted where 10 should be). Without keys the caller is the peer."""
    info = start_coordinator(workers, tiny_model_dir, "keyless-coordinator", "--max-in-flight-per-caller", "1",
                             "--metrics-port", "0")
    address = info["address"]
    with Client(address, api_key="random-1") as first, Client(address, api_key="random-2") as second:
        with one_request_held(first, workers.processes["decode-0"], info["metrics_url"]), \
                pytest.raises(grpc.RpcError) as e:
            second.complete([5, 6, 7], GREEDY)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "sequences in flight" in e.value.details()


def test_request_ids_belong_to_their_caller(workers, tiny_model_dir, pki):
    """Any key could Abort another key's request, probe which ids were in flight, or hold an id so that another
    key got ALREADY_EXISTS. Ids are scoped to the caller now."""
    info = start_coordinator(workers, tiny_model_dir, "scoped-coordinator", "--api-keys-file", str(pki / "keys"),
                             "--metrics-port", "0")
    address, decode = info["address"], workers.processes["decode-0"]
    with Client(address, api_key=KEY) as owner, Client(address, api_key="another-key") as other:
        # The owner's request is held in flight (its decode worker paused) while the checks below are made: counting
        # on 250 tokens outlasting them is a race a fast or a loaded machine can lose.
        with one_request_held(owner, decode, info["metrics_url"], request_id="shared") as held:
            with pytest.raises(grpc.RpcError) as e:  # the owner's own id is taken while its request runs
                owner.complete([5, 6, 7], GREEDY, request_id="shared")
            assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert other.abort("shared") is False  # not its request: out of reach, and not even confirmed to exist
            decode.send_signal(signal.SIGCONT)
            assert other.complete([5, 6, 7], GREEDY, request_id="shared").completion_tokens == 4  # its own "shared"
            last = list(held)[-1]
            assert last.WhichOneof("response") == "final" and last.final.usage.completion_tokens == 4  # not aborted
        scrape_when(info["metrics_url"], "pdserve:num_requests_in_flight", 0)  # its Final is sent before it leaves
        assert owner.abort("shared") is False  # finished


def test_refusals_say_whether_a_retry_can_help(workers, tiny_model_dir, pki):
    """'Server at capacity' carries a RetryInfo; a request bigger than the key's whole token burst is
    INVALID_ARGUMENT (it can never pass, a retryable RESOURCE_EXHAUSTED said otherwise); a refused key is logged."""
    info = start_coordinator(workers, tiny_model_dir, "refusing-coordinator", "--max-in-flight", "1",
                             "--rate-limit-tokens-per-s", "20", "--rate-limit-burst-s", "5", "--api-keys-file",
                             str(pki / "keys"), "--metrics-port", "0")
    address = info["address"]
    with Client(address, api_key=KEY) as c:
        with one_request_held(c, workers.processes["decode-0"], info["metrics_url"]), \
                pytest.raises(grpc.RpcError) as e:
            c.complete([5, 6, 7], GREEDY)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "at capacity" in e.value.details()
        info = error_details_pb2.RetryInfo()
        assert rpc_status.from_call(e.value).details[0].Unpack(info) and info.retry_delay.ToTimedelta().seconds >= 1
        for _ in range(300):  # until the held request has left the coordinator (its cancel is asynchronous)
            with pytest.raises(grpc.RpcError) as e:  # 203 tokens: more than the key's whole burst of 100
                c.complete([5, 6, 7], SamplingParams(max_tokens=200, temperature=0))
            if "at capacity" not in e.value.details():
                break
            time.sleep(0.1)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token burst" in e.value.details()
    with Client(address, api_key="not-a-key") as c, pytest.raises(grpc.RpcError):
        c.complete([5, 6, 7], GREEDY)
    log = (Path(workers.workdir) / "refusing-coordinator.log").read_text()
    assert "refused /pdserve.v1.Generation/Generate: invalid API key (presented key id" in log


def test_deadlines_priorities_and_tenants_pass_through_and_refuse_early(workers, tiny_model_dir, tmp_path):
    """The scheduling front end on real processes: priority and tenant reach the engines without error; a TTFT objective
    the measured queue cannot meet is refused with DEADLINE_EXCEEDED before any worker sees the request; the
    per-caller queued-token limit refuses a prompt it can never admit."""
    weights = tmp_path / "weights"
    weights.write_text("# tenant weight\ninteractive 2\nbatch 0.5\n")
    address = coordinator(workers, tiny_model_dir, "scheduling-coordinator", "--tenant-weights", str(weights),
                          "--scheduling-policy", "priority",
                          "--max-queued-tokens-per-caller", "64")
    with Client(address) as c:
        for priority, tenant in ((-5, "interactive"), (3, "batch"), (0, "")):
            assert c.complete([5, 6, 7], GREEDY, priority=priority, tenant=tenant).completion_tokens == 4

        def looked_up() -> int:  # prompt tokens the prefill worker has scheduled, ever
            with grpc.insecure_channel(workers.worker_addresses["prefill-0"]) as ch:
                return worker_pb2_grpc.WorkerStub(ch).GetStats(worker_pb2.WorkerStatsRequest(), timeout=10,
                                                               metadata=workers.worker_metadata) \
                    .prefix_cache_query_tokens

        before = looked_up()
        # The first tokens above measured the prefill worker's rate: a 1 ms objective cannot be met.
        with pytest.raises(grpc.RpcError) as e:
            c.complete([5, 6, 7], GREEDY, ttft_slo_ms=1)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "predicted to take" in e.value.details() and "ttft_slo_ms=1" in e.value.details()
        assert looked_up() == before  # refused before any compute
        assert c.complete([5, 6, 7], GREEDY, ttft_slo_ms=60_000, priority=-1).completion_tokens == 4
        with pytest.raises(grpc.RpcError) as e:
            c.complete(list(range(5, 75)), GREEDY)  # 70 prompt tokens: more than the caller may ever queue
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "--max-queued-tokens-per-caller" in e.value.details()
