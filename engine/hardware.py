"""What the machine offers that the engine's choices depend on: CPU instruction sets, the `auto` dtype, torch's
threads, and how the process's C allocator keeps memory."""
from __future__ import annotations

from pathlib import Path

# Instruction sets that make bf16 matmuls fast on x86 CPUs (oneDNN uses them: AVX512_BF16 dot products, AMX tiles).
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU feature flags Linux reports for the first core; empty where /proc/cpuinfo is absent (not Linux)."""
    try:
        with cpuinfo.open() as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def resolve_dtype(name: str, device: str, flags: frozenset[str] | None = None) -> str:
    """The concrete dtype name for `--dtype` (`auto` or one of `engine.args.DTYPE_NAMES`).

    `auto` follows vLLM's rule of "the fastest dtype the device computes well": on CUDA bfloat16 where the GPU
    supports it, else float16; on CPU bfloat16 where the CPU has AVX512_BF16 or AMX (there a bf16 GEMM runs 3x
    the fp32 rate, see docs/history/benchmarks.md), else float32 (without them bf16 is emulated and slower than fp32).
    Norms, RoPE tables and softmax stay in fp32 whatever the dtype (`engine.models.layers`, `kernels.reference`).

    Args:
        name: "auto" or a concrete dtype name (returned unchanged).
        device: torch device string of the worker ("cpu", "cuda:0").
        flags: CPU flags (default: `cpu_flags()`); for tests.
    """
    if name != "auto":
        return name
    if device.startswith("cuda"):
        import torch

        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    flags = cpu_flags() if flags is None else flags
    return "bfloat16" if flags & CPU_BF16_FLAGS else "float32"


def resolve_threads(num_threads: int) -> int:
    """num_threads, or for 0 one per CPU in the process's affinity mask (`set_threads`' rule)."""
    import os

    return num_threads if num_threads > 0 else len(os.sched_getaffinity(0))


def set_threads(num_threads: int) -> None:
    """Torch intra-op threads for the calling thread (and threads that first run torch after it); 0 = one per CPU in
    the process's affinity mask (what a container or taskset grants it, not the host's count, which torch would
    take). Several processes on few cores: give each its share (`cli.launcher.worker_threads`); more threads than
    cores only adds contention.

    With OpenMP (torch's CPU build) the count is per thread, and each thread that starts parallel regions keeps its
    own pool of OpenMP threads. A served worker therefore gives its threads to the engine thread alone
    (`engine.core.engine_core.EngineCore`'s `threads`) and keeps every other thread at 1: once a process holds more
    OpenMP threads than CPUs, libgomp stops spin-waiting between regions and every parallel op pays a futex sleep
    and wake.
    Measured (AMD EPYC VM, 2 cores, int4 batch-1 decode step, 2 threads): 7.6 ms run from the thread that built the
    model, 14.1-15.8 ms from a second thread after a 2-thread build, 7.8 ms after a 1-thread build."""
    import torch

    torch.set_num_threads(resolve_threads(num_threads))


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def keep_freed_memory() -> bool:
    """Have the process's C allocator (glibc's malloc, under torch's CPU tensors) keep freed memory for reuse: no
    allocation served by mmap (M_MMAP_MAX 0) and the heap's free top kept up to 2 GiB (M_TRIM_THRESHOLD). Returns
    False, changing nothing, where the C library has no mallopt (not glibc).

    Why: glibc serves every allocation above its mmap threshold (32 MB at most, whatever it adapts to) with fresh pages
    and unmaps them when freed, so each large activation of a big CPU prefill step is page-faulted and zeroed anew,
    every layer, every step: a burst of 64 prompts of 100 tokens makes SmolLM2-135M's gate_up output [6400, 3072] fp32,
    79 MB. Ice Lake Xeon, 2 cores: a [6400, 1536] fp32 tensor allocated and filled in 12.1 ms, filled in place in 1.7,
    allocated and filled with this setting in 3.4; that 6,400-token prefill step took 6.9-7.6 s in 8 of 8 runs without
    it, 5.9-6.5 s in 7 of 8 with it (docs/benchmarks.md). vLLM's CPU guide and PyTorch's performance guide preload
    tcmalloc or jemalloc for the same reason; glibc's own setting needs no preload. The cost: the process keeps the
    memory its largest step used, as those allocators do. Process-wide, applied once the engine runs on the CPU
    (`engine.builder.build_runner`)."""
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def free_memory_bytes(device: str, cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes a KV pool could still take on `device`, measured now; None where unknown.

    CPU: the smallest of the kernel's MemAvailable (/proc/meminfo), the process's cgroup headroom (its memory limit
    less its usage, cgroup v2 or v1 under `cgroup`: a container's limit, which MemAvailable, the host's, ignores) and
    /dev/shm's free bytes, since a served engine's pool is shared memory between the worker and its engine process
    (`engine.execution.kv_cache.share`); CUDA: the device's free bytes (`torch.cuda.mem_get_info`).
    """
    import os

    if device.startswith("cuda"):
        import torch

        try:
            return int(torch.cuda.mem_get_info(torch.device(device))[0])
        except (RuntimeError, AssertionError):
            return None
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = (cgroup / limit_file).read_text().strip()
            usage = int((cgroup / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit != "max" and int(limit) < 2**62:  # v1 writes "no limit" as a number near 2^63
            found.append(max(0, int(limit) - usage))
        break
    try:
        shm = os.statvfs("/dev/shm")
        found.append(shm.f_bavail * shm.f_frsize)
    except OSError:
        pass
    return min(found) if found else None
