"""The deployment files hold together: Kubernetes manifests pass the API schema (kubernetes-validate, strict, the
newest bundled Kubernetes version), and compose.yaml, the Dockerfile and the manifests start processes with flags
the CLI accepts (and compose's smg gateway flags smg's own parser accepts). Building images and bringing compose up
is scripts/compose-test.sh (docs/deploy.md)."""
from pathlib import Path

import pytest
import yaml

from pdserve_server.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))


def k8s_documents():
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_kubernetes_manifests_pass_the_api_schema():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    from kubernetes_validate.utils import latest_version

    docs = k8s_documents()
    assert {d["kind"] for d in docs} == {"Deployment", "Service"}
    for doc in docs:
        kubernetes_validate.validate(doc, latest_version(), strict=True)


def compose_services() -> list[tuple[str, dict]]:
    """(name, service) of compose.yaml, then of the GPU override."""
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    gpu = yaml.safe_load((ROOT / "deploy" / "compose.gpu.yaml").read_text())
    return [*compose["services"].items(), *gpu["services"].items()]


def commands():
    """(where, argv) of every pdserve process the deployment files start. A compose service with its own
    entrypoint runs another program from the image (the smg gateway):
    test_compose_gateway_is_smg_in_front_of_the_coordinator checks it."""
    out = []
    for name, service in compose_services():
        if "command" in service and "entrypoint" not in service:  # the image's ENTRYPOINT: pdserve
            out.append((f"compose {name}", [str(a) for a in service["command"]]))
    for doc in k8s_documents():
        if doc["kind"] == "Deployment":
            for c in doc["spec"]["template"]["spec"]["containers"]:
                out.append((f"k8s {c['name']}", [a.replace("$(POD_IP)", "10.0.0.1") for a in c["args"]]))
    return out


@pytest.mark.parametrize("where,argv", commands(), ids=[w for w, _ in commands()])
def test_deployment_commands_parse(where, argv):
    build_parser(argv[0]).parse_args(argv[1:])


def test_compose_gateway_is_smg_in_front_of_the_coordinator():
    """The only non-pdserve service is the smg gateway: its flags are ones `smg launch` accepts (smg's own parser,
    from the `test` extra), it dials the coordinator's service port, stays off the hub, publishes the OpenAI port
    and waits for a healthy coordinator; the image installs smg."""
    others = {name: s for name, s in compose_services() if "entrypoint" in s}
    assert list(others) == ["gateway"]
    gateway = others["gateway"]
    assert gateway["entrypoint"] == ["smg"] and gateway["command"][0] == "launch"
    launch_router = pytest.importorskip("smg.launch_router")
    args = launch_router.parse_router_args([str(a) for a in gateway["command"][1:]])  # exits 2 on a bad flag
    coordinator = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["coordinator"]
    port = coordinator["command"][coordinator["command"].index("--port") + 1]
    assert args.worker_urls == [f"grpc://coordinator:{port}"] and args.host == "0.0.0.0"
    assert gateway["ports"] == [f"${{PDSERVE_OPENAI_PORT:-8000}}:{args.port}"]
    assert gateway["environment"]["HF_HUB_OFFLINE"] == "1"
    assert gateway["depends_on"] == {"coordinator": {"condition": "service_healthy"}}
    assert f":{args.port}/readiness" in " ".join(gateway["healthcheck"]["test"])
    assert '"smg==' in (ROOT / "deploy" / "Dockerfile").read_text()


def test_container_healthcheck_uses_the_grpc_health_protocol():
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    healthcheck = next(line for line in dockerfile.splitlines() if line.strip().startswith("CMD [\"python\""))
    assert "pdserve_server.cli.healthcheck" in healthcheck
    from pdserve_server.cli.healthcheck import main
    assert main(["--ready-file", "/nonexistent/ready"]) == 1  # not serving yet: unhealthy, no traceback
    assert "\nUSER pdserve\n" in dockerfile  # runs as a non-root user


@pytest.mark.parametrize("where,argv", commands(), ids=[w for w, _ in commands()])
def test_every_deployed_process_exports_metrics_and_logs_json(where, argv):
    """An operator's signals are on wherever pdserve is deployed: Prometheus metrics on a fixed port and JSON log
    lines for a log shipper (tracing waits for an OTLP endpoint, which only the operator knows)."""
    args = build_parser(argv[0]).parse_args(argv[1:])
    assert args.metrics_port and args.log_format == "json", where


def test_kubernetes_roles_have_probes_that_speak_grpc_health():
    """Every Deployment has a startup probe (a cold start loads a model: liveness must not kill it meanwhile), and
    liveness and readiness probes on the gRPC health protocol, liveness on `pdserve.liveness`."""
    deployments = [d for d in k8s_documents() if d["kind"] == "Deployment"]
    assert len(deployments) == 3
    for doc in deployments:
        (container,) = doc["spec"]["template"]["spec"]["containers"]
        name = doc["metadata"]["name"]
        assert container["startupProbe"]["grpc"]["service"] == "pdserve.liveness", name
        assert container["livenessProbe"]["grpc"]["service"] == "pdserve.liveness", name
        assert "grpc" in container["readinessProbe"], name
