"""The "cpu" attention backend: paged decode attention in C (`kernels/cpu_decode.c`), reading K/V in place.

The C source is compiled on first use with the system C compiler (`$CC`, else `cc`) for the host's own ISA
(`-O3 -march=native -ffast-math -fopenmp`) into a cache keyed by the source, the flags, the compiler and the CPU's flags
(`$PDSERVE_KERNEL_CACHE`, else `~/.cache/pdserve/kernels`), then loaded with ctypes: no torch headers, so a build
takes about a second. Writing the KV cache and prefill attention are the torch reference's (`kernels.reference`);
prefill is GEMM-bound and the reference's gather is a small part of it.

CPU only: the kernel takes host pointers (`Tensor.data_ptr()` of CPU tensors); `select_ops` never picks it for
another device.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from kernels.checks import check, check_attention
from kernels.reference import paged_decode_attention as reference_decode_attention

SOURCE = Path(__file__).with_name("cpu_decode.c")
# -ffast-math is for compiling only: linked with it, GCC < 13 adds crtfastmath.o, whose constructor turns on
# flush-to-zero for the whole process (torch's numerics included) when the library loads.
# -mprefer-vector-width=512 (x86 only): GCC otherwise keeps to 256-bit vectors on AVX-512 CPUs (one run here, 64
# sequences x 272 tokens, fp32: 8.2 ms per layer at 256 bits, 4.1 at 512, both with -ffast-math).
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11") + (
    ("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ())
LDFLAGS = ("-shared", "-fopenmp")
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 16, 256, 64  # the C kernel's stack arrays (cpu_decode.c)


class KernelBuildError(RuntimeError):
    """The C kernel could not be compiled or loaded (no compiler, or it failed); the message has its output."""


def _cpu_signature() -> str:
    """The CPU's feature flags: a library built with -march=native must not be loaded on another CPU model."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_library(cache_dir: Path | None = None, extra_cflags: tuple[str, ...] = ()) -> Path:
    """Compile cpu_decode.c unless a build for this source, compiler and CPU is cached; returns the .so's path.

    Concurrent workers may build at once: each compiles to its own temporary file and renames it into place.
    `extra_cflags` are appended to CFLAGS (and keyed): `-DPDSERVE_PORTABLE` builds the plain loops only, as on a
    CPU without AVX-512, and `-mno-avx512bf16` the AVX-512 path without VDPBF16PS, so that the tests check every
    path against the reference on one machine.

    Raises:
        KernelBuildError: no C compiler, an unwritable cache directory, or compilation failed (with the
            compiler's output).
    """
    cc = os.environ.get("CC", "cc")
    source = SOURCE.read_bytes()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelBuildError(f"no C compiler for the cpu attention kernels ({cc}: {e}); set $CC or use "
                               "--attention-backend torch") from e
    cflags = CFLAGS + tuple(extra_cflags)
    key = hashlib.sha256(b"\0".join([source, " ".join(cflags + LDFLAGS).encode(), version.encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    cache_dir = cache_dir or Path(os.environ.get("PDSERVE_KERNEL_CACHE", Path.home() / ".cache/pdserve/kernels"))
    target = cache_dir / f"cpu_decode-{key}.so"
    if target.exists():
        return target
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".so.tmp")
    except OSError as e:  # a read-only home in a container: the worker runs on the reference instead
        raise KernelBuildError(f"cannot write the kernel cache {cache_dir} ({e}); set $PDSERVE_KERNEL_CACHE") from e
    os.close(fd)
    try:
        for command in ([cc, *cflags, "-c", str(SOURCE), "-o", tmp + ".o"],
                        [cc, *LDFLAGS, tmp + ".o", "-o", tmp, "-lm"]):
            try:
                result = subprocess.run(command, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise KernelBuildError(f"{' '.join(command)} did not run: {e}") from e
            if result.returncode != 0:
                raise KernelBuildError(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
        os.replace(tmp, target)
    finally:
        for path in (tmp, tmp + ".o"):
            if os.path.exists(path):
                os.unlink(path)
    return target


class CpuKernels:
    """The loaded C library. Build with `CpuKernels.load()`; one instance per worker (it holds the handle)."""

    def __init__(self, library: ctypes.CDLL):
        fn = library.paged_decode_attention
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_void_p] + [ctypes.c_int] * 6 + [
            ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_int]
        self._decode = fn

    @classmethod
    def load(cls, cache_dir: Path | None = None, extra_cflags: tuple[str, ...] = ()) -> CpuKernels:
        """Build (or find cached) and load the library (`extra_cflags`: see `build_library`). Raises
        KernelBuildError."""
        path = build_library(cache_dir, extra_cflags)
        try:
            return cls(ctypes.CDLL(str(path)))
        except OSError as e:
            raise KernelBuildError(f"cannot load {path}: {e}") from e

    def paged_decode_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """Same contract as `kernels.reference.paged_decode_attention` (shapes, dtypes, fp32 accumulation), on CPU
        tensors. fp32 and bf16 run in C; fp16, GQA groups over 16, head_dim over 256 or blocks over 64 tokens use the
        reference.

        Raises:
            ValueError: a bad shape, dtype, stride or device (`kernels.checks`), or a non-CPU tensor.
        """
        num_seqs, num_q_heads, head_dim = query.shape
        check_attention(query, k_cache, v_cache, block_tables, context_lens, num_seqs)
        check(query.device.type == "cpu", lambda: f"the cpu attention kernel needs CPU tensors, got {query.device}")
        num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
        if (query.dtype not in (torch.float32, torch.bfloat16) or num_q_heads // num_kv_heads > MAX_GROUP
                or head_dim > MAX_HEAD_DIM or block_size > MAX_BLOCK):  # beyond the C kernel's stack arrays
            return reference_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale)
        check(v_cache.stride(0) == k_cache.stride(0), lambda: f"k_cache and v_cache block strides differ: "
                                                      f"{k_cache.stride(0)} vs {v_cache.stride(0)}")
        query, block_tables, context_lens = query.contiguous(), block_tables.contiguous(), context_lens.contiguous()
        out = torch.empty_like(query)
        if num_seqs:
            longest = int(context_lens.max())  # the C kernel trusts the table's width: check it here
            check(longest <= block_tables.shape[1] * block_size,
                  lambda: f"a context of {longest} tokens needs more blocks than block_tables has "
                          f"({block_tables.shape[1]})")
            self._decode(query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                         context_lens.data_ptr(), out.data_ptr(), num_seqs, num_q_heads, num_kv_heads, head_dim,
                         block_size, block_tables.shape[1], k_cache.stride(0), scale,
                         int(query.dtype == torch.bfloat16), torch.get_num_threads())
        return out

