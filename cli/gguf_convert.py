"""Convert a GGUF file into an HF-format safetensors directory, once:
`python -m pdserve_server.cli.gguf_convert SRC.gguf OUT_DIR`.

Run as a child process by `cli.models.resolve_model`. transformers dequantizes the GGUF to fp32; the result is
written atomically under a file lock, so concurrent workers converting the same file wait for one another.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` into `out` (model.safetensors + config.json + tokenizer files).

    Raises:
        OSError / ValueError: from reading the GGUF or writing the directory.
    """
    import torch
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
        config.architectures = [type(model).__name__]  # other tools (vLLM) build the LM head from it
        config.save_pretrained(str(tmp))
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # shares storage with the embedding
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "model.safetensors").chmod(0o644)  # safetensors writes 0600; others (a container's user) read it
        tokenizer.save_pretrained(str(tmp))
        tmp.rename(out)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))
