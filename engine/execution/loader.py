"""Weight loading: read the safetensors files of an HF-format model directory into one state dict."""
from __future__ import annotations

from pathlib import Path

import torch


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """Read every `*.safetensors` file in an HF-format directory into one CPU state dict (HF tensor names).

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
