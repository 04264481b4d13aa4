"""The deployment files hold together: Kubernetes manifests pass the API schema (kubernetes-validate, strict, the
newest bundled Kubernetes version), and compose.yaml, the Dockerfile and the manifests start processes with flags
the CLI accepts. Building images and bringing compose up is scripts/compose-test.sh (docs/deploy.md)."""
from pathlib import Path

import pytest
import yaml

from cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
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


def commands():
    """(where, argv) of every pdserve process the deployment files start."""
    out = []
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    gpu = yaml.safe_load((ROOT / "deploy" / "compose.gpu.yaml").read_text())
    for name, service in [*compose["services"].items(), *gpu["services"].items()]:
        if "command" in service:
            out.append((f"compose {name}", [str(a) for a in service["command"]]))
    for doc in k8s_documents():
        if doc["kind"] == "Deployment":
            for c in doc["spec"]["template"]["spec"]["containers"]:
                out.append((f"k8s {c['name']}", [a.replace("$(POD_IP)", "10.0.0.1") for a in c["args"]]))
    return out


@pytest.mark.parametrize("where,argv", commands(), ids=[w for w, _ in commands()])
def test_deployment_commands_parse(where, argv):
    build_parser(argv[0]).parse_args(argv[1:])


def test_container_healthcheck_uses_the_grpc_health_protocol():
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    healthcheck = next(line for line in dockerfile.splitlines() if line.strip().startswith("CMD [\"python\""))
    assert "cli.healthcheck" in healthcheck
    from cli.healthcheck import main
    assert main(["--ready-file", "/nonexistent/ready"]) == 1  # not serving yet: unhealthy, no traceback
    assert "\nUSER pdserve\n" in dockerfile  # runs as a non-root user
