"""The SDK is its own distribution: installed alone into an empty venv (no torch, no servers), it streams a
completion from a running cluster."""
import subprocess
import venv
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e

CLIENT = """
import importlib.util, sys
from pdserve import Client, SamplingParams
assert importlib.util.find_spec("torch") is None and importlib.util.find_spec("engine") is None
with Client(sys.argv[1]) as c:
    chunks = list(c.generate([5, 6, 7, 8], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)))
final = chunks[-1].final
assert final.finish_reason == "length" and final.completion_tokens == 5, final
print("OK", sum(len(ch.token_ids) for ch in chunks))
"""


def test_sdk_installed_alone_streams_a_completion(tiny_model_dir, tmp_path, launch):
    env_dir = tmp_path / "sdk-venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", str(ROOT / "sdk")],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-4000:]
    installed = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True)
    names = {line.split("==")[0].lower() for line in installed.stdout.split()}
    assert "pdserve-client" in names and not names & {"torch", "pdserve", "transformers", "numpy"}

    cluster = launch(tiny_model_dir, worker_args=["--dtype", "float32", "--kv-tokens", "1024", "--max-model-len",
                                                  "256", "--connector", "tcp"])
    run = subprocess.run([str(python), "-c", CLIENT, cluster.address], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)  # not the repository root: nothing importable by accident
    assert run.returncode == 0 and run.stdout.startswith("OK 5"), run.stdout + run.stderr
