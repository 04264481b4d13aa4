"""The "cpu" backend: paged decode attention in C (`kernels/cpu_decode.c`), reading K/V in place, and a decoder
layer's small per-token ops and the KV-cache write in C (`kernels/cpu_layer_ops.c`).

The C sources are compiled on first use with the system C compiler (`$CC`, else `cc`) for the host's own ISA
(`-O3 -march=native -ffast-math -fopenmp`) into a cache keyed by the sources, the flags, the compiler and the CPU's
flags (`$PDSERVE_KERNEL_CACHE`, else `~/.cache/pdserve/kernels`), then loaded with ctypes: no torch headers, so a
build takes about a second. Prefill attention is not here: the "cpu" backend takes it from `kernels.cpu_prefill`
(blocked GEMMs in torch).

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

from kernels import cpu_prefill
from kernels.checks import check, check_attention, dense_block_strides
from kernels.reference import paged_decode_attention as reference_decode_attention
from kernels.reference import rms_norm as reference_rms_norm
from kernels.reference import rotary_and_write_kv as reference_rotary_and_write_kv
from kernels.reference import silu_and_mul as reference_silu_and_mul

SOURCES = (Path(__file__).with_name("cpu_decode.c"), Path(__file__).with_name("cpu_layer_ops.c"))
HEADERS = (Path(__file__).with_name("cpu_bf16.h"),)  # included by the sources: part of the cache key
# -ffast-math is for compiling only: linked with it, GCC < 13 adds crtfastmath.o, whose constructor turns on
# flush-to-zero for the whole process (torch's numerics included) when the library loads.
# -mprefer-vector-width=512 (x86 only): GCC otherwise keeps to 256-bit vectors on AVX-512 CPUs (one run here, 64
# sequences x 272 tokens, fp32: 8.2 ms per layer at 256 bits, 4.1 at 512, both with -ffast-math).
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11") + (
    ("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ())
LDFLAGS = ("-shared", "-fopenmp")
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 16, 256, 64  # the C kernel's stack arrays (cpu_decode.c)
_C_DTYPES = (torch.float32, torch.bfloat16)  # what the C code reads; fp16 goes to the reference


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
    """Compile the C sources unless a build of them for this compiler and CPU is cached; returns the .so's path.

    Concurrent workers may build at once: each compiles to its own temporary file and renames it into place.
    `extra_cflags` are appended to CFLAGS (and keyed): `-DPDSERVE_PORTABLE` builds the plain loops only, as on a
    CPU without AVX-512, and `-mno-avx512bf16` the AVX-512 path without VDPBF16PS, so that the tests check every
    path against the reference on one machine.

    Raises:
        KernelBuildError: no C compiler, an unwritable cache directory, or compilation failed (with the
            compiler's output).
    """
    cc = os.environ.get("CC", "cc")
    sources = [path.read_bytes() for path in SOURCES + HEADERS]
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelBuildError(f"no C compiler for the cpu attention kernels ({cc}: {e}); set $CC or use "
                               "--attention-backend torch") from e
    cflags = CFLAGS + tuple(extra_cflags)
    key = hashlib.sha256(b"\0".join([*sources, " ".join(cflags + LDFLAGS).encode(), version.encode(),
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
        objects = [f"{tmp}.{i}.o" for i in range(len(SOURCES))]
        commands = [[cc, *cflags, "-c", str(src), "-o", obj] for src, obj in zip(SOURCES, objects)]
        for command in commands + [[cc, *LDFLAGS, *objects, "-o", tmp, "-lm"]]:
            try:
                result = subprocess.run(command, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise KernelBuildError(f"{' '.join(command)} did not run: {e}") from e
            if result.returncode != 0:
                raise KernelBuildError(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
        os.replace(tmp, target)
    finally:
        for path in (tmp, *objects):
            if os.path.exists(path):
                os.unlink(path)
    return target


def _bind(fn, restype, argtypes):
    """Declare a C function's signature for ctypes (wrong types would pass garbage, not fail)."""
    fn.restype, fn.argtypes = restype, argtypes
    return fn


class CpuKernels:
    """The loaded C library. Build with `CpuKernels.load()`; one instance per worker (it holds the handle)."""

    def __init__(self, library: ctypes.CDLL):
        c_int, c_i64, c_ptr, c_float = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        self._decode = _bind(library.paged_decode_attention, c_int, [c_ptr] * 6 + [c_int] * 6 +
                             [c_i64, c_i64, c_float, c_int, c_int, c_i64])
        self._rms_norm = _bind(library.rms_norm, None, [c_ptr] * 4 + [c_int, c_int, c_i64, c_float, c_int, c_int])
        self._silu_and_mul = _bind(library.silu_and_mul, None, [c_ptr, c_ptr] + [c_int] * 4)
        self._rotary_and_write_kv = _bind(library.rotary_and_write_kv, c_int, [c_ptr] * 6 + [c_int] * 4 +
                                          [c_i64, c_int, c_i64, c_i64, c_int, c_int])
        self._causal_softmax = _bind(library.causal_softmax_bf16, None, [c_ptr, c_i64, c_int, c_int, c_float, c_int])

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
            ValueError: a bad shape, dtype, stride or device (`kernels.checks`), a non-CPU tensor, a context longer
                than its row of block_tables, or a block id outside the cache (nothing is computed then).
        """
        num_seqs, num_q_heads, head_dim = query.shape
        check_attention(query, k_cache, v_cache, block_tables, context_lens, num_seqs)
        check(query.device.type == "cpu", lambda: f"the cpu attention kernel needs CPU tensors, got {query.device}")
        num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
        if (query.dtype not in _C_DTYPES or num_q_heads // num_kv_heads > MAX_GROUP
                or head_dim > MAX_HEAD_DIM or block_size > MAX_BLOCK):  # beyond the C kernel's stack arrays
            return reference_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale)
        block_stride = k_cache.stride(0)
        check(v_cache.stride(0) == block_stride, lambda: f"k_cache and v_cache block strides differ: "
                                                 f"{block_stride} vs {v_cache.stride(0)}")
        if query.stride(1) != head_dim:  # the kernel takes any sequence stride, not this
            query = query.contiguous()
        if not context_lens.is_contiguous():  # block_tables: rows dense (checked), any row stride but its width
            context_lens = context_lens.contiguous()
        if block_tables.stride(0) != block_tables.shape[1]:
            block_tables = block_tables.contiguous()
        out = torch.empty(query.shape, dtype=query.dtype)
        if num_seqs:
            bad = self._decode(query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                               context_lens.data_ptr(), out.data_ptr(), num_seqs, num_q_heads, num_kv_heads,
                               head_dim, block_size, block_tables.shape[1], block_stride, query.stride(0), scale,
                               int(query.dtype == torch.bfloat16), torch.get_num_threads(), num_blocks)
            if bad >= 0:
                raise ValueError(f"sequence {bad}: a context of {int(context_lens[bad])} tokens over block table "
                                 f"row {block_tables[bad].tolist()} needs more blocks than the row has or names a "
                                 f"block outside the cache ({num_blocks} blocks of {block_size} tokens)")
        return out

    # The small per-token ops (cpu_layer_ops.c). Each keeps the contract of its torch reference in kernels.reference;
    # they are called once or twice per layer per step, so the checks are plain comparisons and anything the C code
    # does not take (fp16, odd strides) goes to the reference.

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """As `kernels.reference.rms_norm` (x [T, hidden], rows may be strided; residual updated in place)."""
        # Each condition costs a call into torch: shape and strides are read once (called 2 x layers per step).
        dtype, shape, strides = x.dtype, x.shape, x.stride()
        if (dtype not in _C_DTYPES or len(shape) != 2 or strides[1] != 1 or weight.dtype != dtype
                or weight.shape != shape[1:] or not weight.is_contiguous() or (residual is not None and not (
                    residual.dtype == dtype and residual.shape == shape and residual.is_contiguous()))):
            return reference_rms_norm(x, weight, eps, residual)
        out = torch.empty(shape, dtype=dtype)
        self._rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                       out.data_ptr(), shape[0], shape[1], strides[0], eps, int(dtype == torch.bfloat16),
                       torch.get_num_threads())
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """As `kernels.reference.silu_and_mul`."""
        dtype, shape = gate_up.dtype, gate_up.shape
        if dtype not in _C_DTYPES or len(shape) != 2 or shape[1] % 2 or not gate_up.is_contiguous():
            return reference_silu_and_mul(gate_up)
        rows, inter = shape[0], shape[1] // 2
        out = torch.empty((rows, inter), dtype=dtype)
        self._silu_and_mul(gate_up.data_ptr(), out.data_ptr(), rows, inter, int(dtype == torch.bfloat16),
                           torch.get_num_threads())
        return out

    def causal_softmax(self, scores: torch.Tensor, rows: int, scale: float) -> torch.Tensor:
        """As `kernels.cpu_prefill.causal_softmax`, writing the probabilities into `scores` and returning it;
        fp16 or non-contiguous scores take the torch version."""
        if scores.dtype != torch.bfloat16 or not scores.is_contiguous():
            return cpu_prefill.causal_softmax(scores, rows, scale)
        end = scores.shape[-1]
        self._causal_softmax(scores.data_ptr(), scores.numel() // end, rows, end, scale, torch.get_num_threads())
        return scores

    def prefill_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                          scale: float, max_query_len: int | None = None) -> torch.Tensor:
        """`kernels.cpu_prefill.prefill_attention` with the softmax in C."""
        return cpu_prefill.prefill_attention(query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
                                             scale, max_query_len, softmax=self.causal_softmax,
                                             block_m=cpu_prefill.C_BLOCK_M)

    def rotary_and_write_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """As `kernels.reference.rotary_and_write_kv`, rotating the q and k heads of `qkv` in place and returning the
        q heads' view of it.

        Raises:
            ValueError: a slot outside the cache (the reference raises IndexError there), naming the token; nothing
                is rotated or written then.
        """
        tokens, all_heads, head_dim = qkv.shape
        cache_shape, k_strides, qkv_strides = k_cache.shape, k_cache.stride(), qkv.stride()
        num_blocks, block_size, kv_heads = cache_shape[:3]
        dtype, block_stride = qkv.dtype, k_strides[0]
        q_heads = all_heads - 2 * kv_heads
        # The conditions in one expression, each tensor's shape and strides read once (called once per layer).
        if (dtype not in _C_DTYPES or qkv_strides[1:] != (head_dim, 1) or head_dim % 2
                or q_heads < 1 or cos.dtype != dtype or sin.dtype != dtype or cos.numel() != tokens * head_dim
                or sin.numel() != tokens * head_dim or not cos.is_contiguous() or not sin.is_contiguous()
                or k_cache.dtype != dtype or v_cache.dtype != dtype or cache_shape[3] != head_dim
                or v_cache.shape != cache_shape or k_strides[1:] != dense_block_strides(kv_heads, head_dim)
                or v_cache.stride() != k_strides or slot_mapping.dtype != torch.int64
                or slot_mapping.numel() != tokens or not slot_mapping.is_contiguous()):
            return reference_rotary_and_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping)
        size = qkv.element_size()
        bad = self._rotary_and_write_kv(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
                                        v_cache.data_ptr(), slot_mapping.data_ptr(), tokens, q_heads, kv_heads,
                                        head_dim, qkv_strides[0], block_size, block_stride * size, num_blocks,
                                        int(dtype == torch.bfloat16), torch.get_num_threads())
        if bad >= 0:
            raise ValueError(f"slot {int(slot_mapping[bad])} of token {bad} is outside the KV cache "
                             f"({num_blocks} blocks of {block_size} tokens)")
        return qkv[:, :q_heads]
