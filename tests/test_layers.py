"""The layers of docs/architecture.md hold: what each entry point loads in a fresh interpreter."""
import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "triton", "transformers", "numpy")
OURS = ("engine", "kernels", "kv_transfer", "worker_common", "prefill_worker", "decode_worker", "coordinator", "cli",
        "server_common")


def loaded_after(code: str) -> set[str]:
    """Top-level package names in sys.modules after running `code` in a fresh interpreter."""
    probe = code + "\nimport sys, json\nprint(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_coordinator_process_loads_no_torch_and_no_engine():
    loaded = loaded_after("import coordinator.app")
    assert not loaded & {*HEAVY, "engine", "kernels", "worker_common", "prefill_worker", "decode_worker"}


def test_coordinator_command_loads_no_torch_and_no_engine():
    """`pdserve coordinator` parses its flags and reaches its process module without the engine."""
    loaded = loaded_after("from cli.main import build_parser\nbuild_parser('coordinator').parse_args([])\n"
                          "import coordinator.app")
    assert not loaded & {*HEAVY, "engine", "kernels", "worker_common", "prefill_worker", "decode_worker"}


def test_sdk_loads_only_grpc_and_protobuf():
    loaded = loaded_after("import pdserve\nfrom pdserve import AsyncClient, Client, SamplingParams")
    assert not loaded & {*HEAVY, *OURS}
    assert {"grpc", "google"} <= loaded


@pytest.mark.parametrize("command", ["serve", "prefill", "decode", "colocated"])
def test_other_commands_parse_without_torch(command):
    """Flags come from torch-free config dataclasses, so `--help` and `serve`'s parent process stay light."""
    loaded = loaded_after(f"from cli.main import build_parser\nbuild_parser({command!r}).parse_args([])")
    assert not loaded & {"torch", "triton", "transformers"}


def test_engine_imports_no_grpc_and_no_kv_transfer():
    """The engine exposes its KV cache's blocks; moving them between workers is `kv_transfer`'s, which the workers
    use."""
    loaded = loaded_after("import engine.builder, engine.async_engine, engine.process_engine")
    assert not loaded & {"grpc", "pdserve", "coordinator", "worker_common", "cli", "server_common", "kv_transfer"}


def test_kv_transfer_sits_between_the_engine_and_the_workers():
    """kv_transfer takes the engine's error and layer-progress types (`engine.errors`, `engine.kv_stream`), never a
    worker, a server or gRPC."""
    loaded = loaded_after("import kv_transfer.sender, kv_transfer.receiver, kv_transfer.choice, kv_transfer.backends")
    assert not loaded & {"grpc", "pdserve", "kernels", "coordinator", "worker_common", "prefill_worker",
                         "decode_worker", "cli", "server_common"}
