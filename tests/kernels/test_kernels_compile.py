"""The Triton kernels compile for Hopper (sm_90) without a GPU (`bench/kernel_report.py`: Triton's PTX lowering
plus its bundled ptxas), so errors the CPU interpreter cannot see show up in CI, and none spills registers to
local memory (that would make the memory-bound decode kernel slow)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def test_kernels_compile_for_sm90_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_report.py"), "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["kernel"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"decode", "decode-split", "merge", "prefill", "write_kv"}
    for name, r in rows.items():
        assert r["stack_bytes"] == 0 and r["local_loads"] == 0, f"{name} spills: {r}"
    for name in ("decode", "decode-split", "prefill"):
        assert rows[name]["mma"] > 0, f"{name} has no tensor-core instructions: {rows[name]}"
