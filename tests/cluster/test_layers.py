"""The layers of docs/architecture.md hold: what each entry point loads in a fresh interpreter."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "triton", "transformers", "numpy")
OURS = ("engine", "kernels", "kv_transfer", "worker_common", "prefill_worker", "decode_worker", "coordinator", "cli",
        "server_common")


def loaded_after(code: str) -> set[str]:
    """Package names in sys.modules after running `code` in a fresh interpreter: ours by their folder
    (`pdserve_server.engine.x` -> "engine"), others by their top level. Run outside the repository, so only what
    is installed imports; a module of ours loaded under a bare top-level name fails the probe."""
    probe = code + "\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd="/")
    names = json.loads(out.stdout.splitlines()[-1])
    bare = [m for m in names if m.split(".")[0] in OURS]
    assert not bare, f"loaded outside the pdserve_server namespace: {bare}"
    return {m.split(".")[1] if m.startswith("pdserve_server.") else m.split(".")[0] for m in names}


def test_coordinator_process_loads_no_torch_and_no_engine():
    loaded = loaded_after("import pdserve_server.coordinator.app")
    assert not loaded & {*HEAVY, "engine", "kernels", "worker_common", "prefill_worker", "decode_worker"}


def test_coordinator_command_loads_no_torch_and_no_engine():
    """`pdserve coordinator` parses its flags and reaches its process module without the engine."""
    loaded = loaded_after("from pdserve_server.cli.main import build_parser\n"
                          "build_parser('coordinator').parse_args([])\nimport pdserve_server.coordinator.app")
    assert not loaded & {*HEAVY, "engine", "kernels", "worker_common", "prefill_worker", "decode_worker"}


def test_sdk_loads_only_grpc_and_protobuf():
    loaded = loaded_after("import pdserve\nfrom pdserve import AsyncClient, Client, SamplingParams")
    assert not loaded & {*HEAVY, *OURS}
    assert {"grpc", "google"} <= loaded


@pytest.mark.parametrize("command", ["serve", "prefill", "decode", "colocated"])
def test_other_commands_parse_without_torch(command):
    """Flags come from torch-free config dataclasses, so `--help` and `serve`'s parent process stay light."""
    loaded = loaded_after(f"from pdserve_server.cli.main import build_parser\nbuild_parser({command!r}).parse_args([])")
    assert not loaded & {"torch", "triton", "transformers"}


def test_engine_imports_no_grpc_and_no_kv_transfer():
    """The engine exposes its KV cache's blocks; moving them between workers is `kv_transfer`'s, which the workers
    use."""
    loaded = loaded_after("from pdserve_server.engine import builder\n"
                          "from pdserve_server.engine.core import async_engine, process_engine")
    assert not loaded & {"grpc", "pdserve", "coordinator", "worker_common", "cli", "server_common", "kv_transfer"}


def test_kv_transfer_sits_between_the_engine_and_the_workers():
    """kv_transfer takes the engine's error and layer-progress types (`engine.errors`, `engine.kv_stream`), never a
    worker, a server or gRPC."""
    loaded = loaded_after("from pdserve_server.kv_transfer import sender, receiver, choice, backends")
    assert not loaded & {"grpc", "pdserve", "kernels", "coordinator", "worker_common", "prefill_worker",
                         "decode_worker", "cli", "server_common"}


def test_the_install_puts_no_generic_top_level_package():
    """Everything the servers install is under pdserve_server (the SDK is `pdserve`): outside the repository, none
    of the folders' bare names imports as ours, so another distribution's `kernels` (Hugging Face's, which
    transformers probes) or `cli` is never shadowed."""
    probe = ("import importlib.util, json, sys\n"
             f"names = {list(OURS)!r}\n"
             "specs = {n: importlib.util.find_spec(n) for n in names}\n"
             "print(json.dumps({n: s.origin if s else None for n, s in specs.items()}))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd="/")
    repo = str(Path(__file__).resolve().parents[2])
    found = json.loads(out.stdout)
    assert not {n: o for n, o in found.items() if o and Path(o).parent == Path(repo) / n}, found
    assert loaded_after("import pdserve_server.kernels, pdserve_server.engine.mock") >= {"kernels", "engine"}


def test_the_repository_root_shadows_no_installed_package():
    """A process started in the repository's root has that root first on sys.path (`python -m pytest`, `python -c`),
    so a folder there that is a regular package would win over an installed module of its name: `kernels/` did, and
    transformers (>= 5, which imports Hugging Face's `kernels`) failed to load any model. So no regular package in
    the root may share a name with an installed module, and `kernels/` is a namespace portion (setup.py)."""
    repo = Path(__file__).resolve().parents[2]
    regular = sorted(d.name for d in repo.iterdir() if (d / "__init__.py").is_file())
    probe = ("import importlib.util, json\n"
             f"print(json.dumps({{n: bool(importlib.util.find_spec(n)) for n in {regular!r}}}))\n")
    installed = json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                          check=True, cwd="/").stdout)
    assert not [n for n, found in installed.items() if found], installed
    probe = "import importlib.util; s = importlib.util.find_spec('kernels'); print(s and s.origin)"
    origin = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                            cwd=repo).stdout.strip()
    assert origin == "None" or Path(origin).parent != repo / "kernels", origin
