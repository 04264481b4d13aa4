"""`engine.hardware.keep_freed_memory`: large tensors come from glibc's heap and are reused, not mmap'd anew. Run in
a child process: the setting is process-wide, and the test reads glibc's own count of mmap'd blocks."""
import json
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import ctypes, json, sys
    import torch
    from pdserve_server.engine.hardware import keep_freed_memory

    class MallInfo2(ctypes.Structure):  # glibc >= 2.33, malloc.h
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                          "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        print(json.dumps(None)); sys.exit(0)
    libc.mallinfo2.restype = MallInfo2
    def mmapped_blocks_added(nbytes):  # while a tensor of nbytes is held
        base = libc.mallinfo2().hblks
        t = torch.empty(nbytes, dtype=torch.uint8)
        return libc.mallinfo2().hblks - base
    before = mmapped_blocks_added(64 << 20)  # 64 MB: past glibc's largest mmap threshold
    kept = keep_freed_memory()
    after = mmapped_blocks_added(64 << 20)
    arena = libc.mallinfo2().arena  # the heap the freed 64 MB went back to
    print(json.dumps([before, kept, after, arena]))
""")


def test_large_tensors_come_from_the_heap_and_stay_there_once_set():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result is None:
        pytest.skip("not glibc >= 2.33 (no mallinfo2)")
    before, kept, after, arena = result
    assert before == 1  # glibc's default: a 64 MB block is mmap'd (and unmapped when freed)
    assert kept and after == 0  # with the setting: from the heap
    assert arena >= 64 << 20  # and the freed block stays in the heap for the next step's tensors
