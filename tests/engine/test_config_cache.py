"""The ModelConfig cache (`engine.models.config_cache`): a model read through transformers once is read from the cache
afterwards, without importing transformers; a changed config.json, or a cache file that does not parse, reads the
model again; with no cache directory nothing is written."""
import json
import shutil
import subprocess
import sys

from pdserve_server.engine.models.config import ModelConfig
from pdserve_server.engine.models.config_cache import read_model_config


def fresh_read(model_dir, cache_dir) -> tuple[str, bool]:
    """read_model_config in a new interpreter: (the config's repr, whether transformers got imported)."""
    code = ("import sys; from pathlib import Path\n"
            "from pdserve_server.engine.models.config_cache import read_model_config\n"
            f"c = read_model_config(Path({str(model_dir)!r}), 'tiny', 'float32', Path({str(cache_dir)!r}))\n"
            "print(repr(c)); print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    config, imported = out.stdout.strip().rsplit("\n", 1)
    return config, imported == "True"


def test_a_cached_config_is_read_without_transformers_and_a_changed_one_again(tiny_model_dir, tmp_path):
    from transformers import AutoConfig

    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(tiny_model_dir / "config.json", model / "config.json")
    cache = tmp_path / "cache"
    expected = ModelConfig.from_hf(AutoConfig.from_pretrained(str(model)), name="tiny", path=str(model),
                                   dtype="float32")

    first, imported = fresh_read(model, cache)
    assert first == repr(expected) and imported  # read through transformers, and kept
    assert len(list(cache.glob("*.json"))) == 1
    again, imported = fresh_read(model, cache)
    assert again == repr(expected) and not imported  # from the cache: transformers never loaded

    config = json.loads((model / "config.json").read_text())
    config["rms_norm_eps"] = 1e-6
    (model / "config.json").write_text(json.dumps(config))
    changed = read_model_config(model, "tiny", "float32", cache)
    assert changed.rms_norm_eps == 1e-6 and len(list(cache.glob("*.json"))) == 2
    assert read_model_config(model, "tiny", "bfloat16", cache).dtype == "bfloat16"  # the dtype is in the key

    for entry in cache.glob("*.json"):
        entry.write_text("{not json")
    assert read_model_config(model, "tiny", "float32", cache) == changed  # read again, and rewritten
    assert read_model_config(model, "tiny", "float32", None) == changed
    assert len(list(cache.glob("*.json"))) == 3
