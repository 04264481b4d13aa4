"""A model's `ModelConfig`, read through transformers once and kept in a cache file.

Reading config.json goes through transformers (`AutoConfig`, then `ModelConfig.from_hf`), and importing a model's
config class costs about 1 s of CPU in transformers 5 (its config modules import the weight-loading machinery, and
with it torch.distributed.tensor) in every engine process, where the rest of the build takes a fraction of that
for a small model. The ModelConfig it gives is kept as JSON under the cache directory, keyed by everything it is
computed from: config.json's bytes, the transformers version, the source of `engine.models` (`from_hf` and the
architectures' flags), and the name, path and dtype; any change to one of them reads the model again. A cache that
cannot be read or written is only a slower start. The workers' command line puts it under pdserve's cache directory
(`EngineArgs.model_cache_dir`).
"""
from __future__ import annotations

import hashlib
import os
from importlib import metadata
from pathlib import Path

import msgspec

from pdserve_server.engine.models.config import ModelConfig

CACHE_VERSION = 1  # bump when the cache file's form changes


def _key(config_json: bytes, name: str, path: str, dtype: str) -> str:
    h = hashlib.sha256(config_json)
    h.update(f"|v{CACHE_VERSION}|transformers {metadata.version('transformers')}|{name}|{path}|{dtype}".encode())
    for source in sorted(Path(__file__).parent.glob("*.py")):  # from_hf and every architecture's flags
        h.update(source.read_bytes())
    return h.hexdigest()[:32]


def read_model_config(model_dir: Path, name: str, dtype: str, cache_dir: Path | None) -> ModelConfig:
    """The ModelConfig of the HF model in `model_dir` (`ModelConfig.from_hf` of transformers' `AutoConfig`), from
    the cache in `cache_dir` when it holds it, else read (and cached there; None: no cache).

    Raises:
        OSError / ValueError: from transformers and `ModelConfig.from_hf` (no config.json, an unsupported model or
            feature); a failed read is never cached.
    """
    try:
        config_json = (model_dir / "config.json").read_bytes()
    except OSError:
        config_json = None  # transformers says what is missing
    entry = None
    if config_json is not None and cache_dir is not None:
        entry = cache_dir / f"{_key(config_json, name, str(model_dir), dtype)}.json"
        try:
            return msgspec.json.decode(entry.read_bytes(), type=ModelConfig)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            pass
    from transformers import AutoConfig

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(str(model_dir)), name=name, path=str(model_dir),
                                 dtype=dtype)
    if entry is not None:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
            tmp.write_bytes(msgspec.json.encode(config))
            os.replace(tmp, entry)
        except OSError:
            pass  # a read-only home: no cache, nothing else changes
    return config
