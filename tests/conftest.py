"""Shared fixtures: a tiny random-weight Llama (built from a config, with the real tokenizer), the packaged model,
and clusters of real processes on ports chosen at run time."""
from __future__ import annotations

import inspect
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("UCX_TLS", "tcp,self")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def pytest_collection_modifyitems(items):
    """The test tiers (README): a test that takes the packaged model (`real_model_dir`) as an argument is marked
    `model` (it loads SmolLM2-135M's weights or files); `e2e` is set by the files that start processes. The fast
    tier is `-m "not e2e and not model"`. (The tiny random model's fixture copies the packaged tokenizer, but its
    tests stay in the fast tier: only a direct argument counts.)"""
    for item in items:
        function = getattr(item, "function", None)
        if function is not None and "real_model_dir" in inspect.signature(function).parameters:
            item.add_marker(pytest.mark.model)


@pytest.fixture
def redis_url(tmp_path):
    """A real Redis server for this test (Debian's redis-server, which scripts/test.sh installs where it can), on a
    free port, bounded and LRU as docs/deploy.md says to run it; skipped, saying why, without the binary."""
    import subprocess

    from helpers import free_port, wait_for

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no redis-server on PATH (Debian: apt-get install redis-server; scripts/test.sh tries)")
    import redis

    port = free_port()
    server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                               "--dir", str(tmp_path), "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"

    def answers() -> bool:
        try:
            with redis.Redis.from_url(url, socket_timeout=1) as client:
                return client.ping()
        except redis.ConnectionError:
            return server.poll() is not None  # it exited: stop waiting, the assert below says so

    wait_for(answers, 30, "redis-server to answer")
    assert server.poll() is None, f"redis-server exited with {server.returncode}"
    yield url
    server.terminate()
    server.wait(10)


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The packaged SmolLM2-135M-Instruct, converted once to safetensors."""
    from pdserve_server.cli.models import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, real_model_dir) -> Path:
    """A 2-layer random-weight Llama (GQA 4 q / 2 kv heads) saved in HF format with SmolLM2's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, pad_token_id=2)
    torch.manual_seed(0)
    return save_with_tokenizer(LlamaForCausalLM(cfg), out, real_model_dir)


def save_with_tokenizer(model, out: Path, real_model_dir: Path) -> Path:
    """Save a random-weight HF model in `out` with its LM head x8 (sharper logits: greedy choices far from ties) and
    the packaged model's tokenizer files, so a cluster can serve it; returns `out`."""
    import torch

    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (real_model_dir / name).exists():
            shutil.copy(real_model_dir / name, out / name)
    return out


class Launcher:
    """Starts local clusters (`pdserve_server.cli.launcher.start_cluster`) and stops every one it started when its
    fixture ends: the one way a test gets a cluster (`launch` for one test, `launch_module` for a module's tests)."""

    def __init__(self, tmp_path_factory):
        self._tmp = tmp_path_factory
        self._started = []

    def __call__(self, model_dir: Path, name: str = "tiny", *, colocated: bool = False,
                 worker_args: list[str] | None = None, coordinator_args: list[str] | None = None,
                 env: dict | None = None, **shape):
        """A running cluster serving `model_dir` as `name`; `shape`: ServeConfig's fields (log_dir defaults to a
        fresh directory: read a process's log at `cluster.log_files[process name]`)."""
        from pdserve_server.cli.launcher import ServeConfig, start_cluster

        shape.setdefault("log_dir", str(self._tmp.mktemp("logs")))
        cluster = start_cluster(str(model_dir), name, ServeConfig(**shape), colocated=colocated,
                                worker_args=worker_args, coordinator_args=coordinator_args, env=env)
        self._started.append(cluster)
        return cluster

    def stop(self) -> None:
        """Stop every cluster started here, the newest first."""
        while self._started:
            self._started.pop().stop()


@pytest.fixture
def launch(tmp_path_factory):
    """Start clusters for one test: `launch(model_dir, name, colocated=..., worker_args=[...], num_decode=2, ...)`;
    stopped when the test ends, whatever its outcome."""
    launcher = Launcher(tmp_path_factory)
    yield launcher
    launcher.stop()


@pytest.fixture(scope="module")
def launch_module(tmp_path_factory):
    """`launch` for a module-scoped cluster fixture: stopped after the module's last test."""
    launcher = Launcher(tmp_path_factory)
    yield launcher
    launcher.stop()


@pytest.fixture(scope="session")
def tokenizer(real_model_dir):
    """The packaged model's HF tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(real_model_dir))


def _hf_model(model_dir: Path, dtype, _cache: dict = {}):
    """HF transformers' model of `model_dir` in `dtype`, loaded once per directory and dtype."""
    from transformers import AutoModelForCausalLM

    key = (str(model_dir), dtype)
    if key not in _cache:
        _cache[key] = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    return _cache[key]


def hf_next_logits(model_dir: Path, ids: list[int]):
    """HF transformers' fp32 logits for the token after `ids`: [vocab] float32."""
    import torch

    with torch.no_grad():
        return _hf_model(model_dir, torch.float32)(torch.tensor([ids])).logits[0, -1]


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int, dtype=None) -> list[int]:
    """Reference greedy continuation from HF transformers on the same weights, in `dtype` (default fp32; models
    cached per directory and dtype). Stops at the model's EOS, as `generate()` does."""
    import torch

    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = _hf_model(model_dir, dtype or torch.float32).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=2)
    return out[0, len(prompt_ids):].tolist()
