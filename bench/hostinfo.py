"""Where a benchmark ran: the machine's name and cores, the CPU flags worth showing, and the commit measured (every
result file carries them, so a figure can be traced to the machine and code it came from)."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
FLAGS_SHOWN = {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile", "avx512_fp16"}


def machine() -> str:
    """"<CPU model name>, <N> cores" of this host."""
    cpu = platform.processor() or ""
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def commit() -> str:
    """The checked-out commit, short, with "+dirty" when tracked files differ from it."""
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE, capture_output=True,
                           text=True).stdout.strip()
    return (out.stdout.strip() or "unknown") + ("+dirty" if dirty else "")
