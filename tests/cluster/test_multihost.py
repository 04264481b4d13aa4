"""Across hosts: coordinator, prefill and decode each in its own Linux network namespace with its own IP, joined by
a bridge (as three machines on one LAN). Workers bind 0.0.0.0 and advertise what they detect; the KV moves over
the decode worker's advertised address and fixed --kv-port. Needs root and iproute2; skipped with the reason
otherwise."""
import os
import shutil
import subprocess

import grpc
import pytest

from pdserve_server.cli.launcher import wait_ready
from conftest import hf_greedy
from pdserve import Client, SamplingParams
from pdserve.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.e2e
ROLES = {"c": 1, "p": 2, "d": 3}  # namespace tag -> last octet


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture
def lan():
    """Three namespaces on a bridge; yields (namespace names by tag, subnet prefix). Removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (ip)")
    tag = f"{os.getpid() % 10000}"
    subnet = f"10.213.{os.getpid() % 250}"
    bridge, names = f"pdbr{tag}", {t: f"pd{tag}{t}" for t in ROLES}
    try:
        sh("ip", "link", "add", bridge, "type", "bridge")
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create a bridge here: {e.stderr.decode().strip()}")
    # A host running dockerd has FORWARD policy DROP with bridge netfilter on: let our bridge's frames through.
    accept = ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]
    iptables = shutil.which("iptables")
    try:
        if iptables:
            subprocess.run([iptables, "-I", *accept], capture_output=True)
        sh("ip", "addr", "add", f"{subnet}.254/24", "dev", bridge)
        sh("ip", "link", "set", bridge, "up")
        for t, ns in names.items():
            outside, inside = f"v{tag}{t}", f"e{tag}{t}"
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            sh("ip", "link", "set", inside, "netns", ns)
            sh("ip", "link", "set", outside, "master", bridge)
            sh("ip", "link", "set", outside, "up")
            for cmd in (["ip", "addr", "add", f"{subnet}.{ROLES[t]}/24", "dev", inside],
                        ["ip", "link", "set", inside, "up"], ["ip", "link", "set", "lo", "up"],
                        ["ip", "route", "add", "default", "via", f"{subnet}.254"]):
                sh("ip", "netns", "exec", ns, *cmd)
        yield names, subnet
    finally:
        for ns in names.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
        if iptables:
            subprocess.run([iptables, "-D", *accept], capture_output=True)


def test_three_hosts_greedy_equals_single_host(lan, tiny_model_dir, tmp_path):
    names, subnet = lan
    ip = {t: f"{subnet}.{n}" for t, n in ROLES.items()}
    secret = tmp_path / "cluster.secret"
    secret.write_text("multi-host-secret")
    common = ["--model", str(tiny_model_dir), "--host", "0.0.0.0", "--cluster-secret-file", str(secret),
              "--log-level", "INFO"]
    worker = ["--dtype", "float32", "--kv-tokens", "1024", "--max-model-len", "256", "--connector", "tcp"]
    plan = [("p", ["prefill", "--port", "7101", *worker]),
            ("d", ["decode", "--port", "7102", "--kv-port", "7103", *worker]),
            ("c", ["coordinator", "--port", "7100", "--prefill", f"{ip['p']}:7101", "--decode", f"{ip['d']}:7102"])]
    procs = []
    try:
        for t, args in plan:
            ready = tmp_path / f"{t}.ready"
            log = open(tmp_path / f"{t}.log", "w")
            proc = subprocess.Popen(["ip", "netns", "exec", names[t], os.sys.executable, "-m",
                                     "pdserve_server.cli.main", *args, *common, "--ready-file", str(ready)], stdout=log, stderr=subprocess.STDOUT)
            procs.append(proc)
            info = wait_ready([(t, proc, ready)], 180)[0]
            assert info["address"] == f"{ip[t]}:{args[args.index('--port') + 1]}", info  # advertised, not 0.0.0.0
        with grpc.insecure_channel(f"{ip['d']}:7102") as ch:
            kv = worker_pb2_grpc.WorkerStub(ch).GetInfo(
                worker_pb2.WorkerInfoRequest(), timeout=10,
                metadata=(("authorization", "Bearer multi-host-secret"),)).kv_address
        assert kv == f"tcp://{ip['d']}:7103"
        prompts = [[5, 6, 7, 8], list(range(100, 140)), [9] * 17]
        with Client(f"{ip['c']}:7100") as c:
            for prompt in prompts:
                out = c.complete(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
                assert out.token_ids == hf_greedy(tiny_model_dir, prompt, 6)
                assert out.timings["transfer_ms"] > 0  # the KV crossed from the prefill host to the decode host
    finally:  # the processes' logs stay in tmp_path
        for proc in procs:
            proc.kill()
            proc.wait()
