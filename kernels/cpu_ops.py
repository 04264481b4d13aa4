"""The "cpu" backend: paged decode attention in C (`kernels/cpu_decode.c`), reading K/V in place, a decoder
layer's small per-token ops and the KV-cache write in C (`kernels/cpu_layer_ops.c`), and the fp32 linear layers'
small-batch GEMM (`kernels/cpu_linear.c`), called as torch ops.

The C sources are compiled when pdserve is installed (setup.py), once per ISA level (base, avx2, avx512, avx512_vnni,
avx512_bf16 on x86), into one extension, `kernels/_C`, whose torch ops (`pdserve::*`, `kernels/cpu_ops.cpp`) run the
best level the CPU has. Serving needs no compiler. `$PDSERVE_CPU_ISA` picks a level instead (tests, benchmarks). Prefill
attention without a sliding window: fp32 caches, and bf16 ones on a CPU with AVX512_BF16, in C
(`kernels/cpu_prefill_attention.c`); anything else from `kernels.cpu_prefill` (bf16: blocked GEMMs in torch, the softmax
in C; fp32: the reference's SDPA).

CPU only: `select_ops` never picks it for another device.
"""
from __future__ import annotations

import importlib.util
import os
import platform

import torch

from pdserve_server.kernels import cpu_prefill
from pdserve_server.kernels.checks import check, check_attention
from pdserve_server.kernels.reference import paged_decode_attention as reference_decode_attention
from pdserve_server.kernels.reference import rms_norm as reference_rms_norm
from pdserve_server.kernels.reference import rotary_and_write_kv as reference_rotary_and_write_kv
from pdserve_server.kernels.reference import silu_and_mul as reference_silu_and_mul

MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 16, 256, 64  # the C kernel's stack arrays (cpu_kernels.h)
_C_DTYPES = (torch.float32, torch.bfloat16)  # what the C code reads; fp16 goes to the reference
# A bf16 score for keys left of a sliding window, before the C softmax (`CpuKernels.causal_softmax`): -2^100 scaled
# by any softmax scale up to 2^27 stays finite in fp32, and exp of it minus a real score's max is 0.
_HIDDEN = -2.0 ** 100
ISA_ENV = "PDSERVE_CPU_ISA"
# The ISA levels setup.py builds (ISA_LEVELS), best first.
ALL_ISAS = (("avx512_bf16", "avx512_vnni", "avx512", "avx2", "base")
            if platform.machine().lower() in ("x86_64", "amd64") else ("base",))
_FIX = ("reinstall pdserve so that its build compiles the kernels (bash scripts/install.sh, or pip install "
        "--no-build-isolation -e . with the torch it runs with), or serve with --attention-backend torch (the "
        "slower torch reference)")


class KernelLoadError(RuntimeError):
    """The compiled cpu kernels (`kernels/_C`) are missing or cannot be loaded; the message says why and what to do."""


_loaded = _fakes_registered = False


def load_library() -> None:
    """Load `kernels/_C` into torch and register its ops' fake implementations, once per process, running the
    build `$PDSERVE_CPU_ISA` names if set (else the library's choice: the best this CPU runs).

    Raises:
        KernelLoadError: no compiled extension beside this file, one that does not load (built for another torch,
            a missing shared library), one built against another torch version or from older sources (an op
            missing), or a `$PDSERVE_CPU_ISA` this library has no build of or this CPU cannot run.
    """
    global _loaded, _fakes_registered
    if not _loaded:
        # Finds the file without importing it: it has no Python module.
        spec = importlib.util.find_spec("pdserve_server.kernels._C")
        if spec is None or not spec.origin:
            raise KernelLoadError(f"the compiled cpu kernels (kernels/_C) are not installed; {_FIX}")
        try:
            torch.ops.load_library(spec.origin)
        except (OSError, RuntimeError) as e:  # RuntimeError: another copy of the library registered pdserve::
            raise KernelLoadError(f"the compiled cpu kernels {spec.origin} failed to load ({e}); {_FIX}") from e
        built_with = torch.ops.pdserve.torch_version()
        if built_with != torch.__version__:  # its C++ ABI is that torch's: a mismatch may crash, not just fail
            raise KernelLoadError(f"the compiled cpu kernels {spec.origin} were built against torch {built_with} "
                                  f"but torch {torch.__version__} is running; {_FIX}")
        isa = os.environ.get(ISA_ENV)
        if isa:
            try:
                torch.ops.pdserve.set_cpu_isa(isa)
            except ValueError as e:
                raise KernelLoadError(f"${ISA_ENV}={isa}: {e}") from e
        if not _fakes_registered:
            try:
                _register_fakes()
            except RuntimeError as e:  # a library built from older sources (an editable install not rebuilt)
                raise KernelLoadError(f"the compiled cpu kernels {spec.origin} lack an op this pdserve calls ({e}); "
                                      f"{_FIX}") from e
            _fakes_registered = True
        _loaded = True


def _register_fakes() -> None:
    """Shapes and dtypes of the ops' outputs without computing them (FakeTensor, meta tensors: torch.compile,
    torch.library.opcheck)."""

    @torch.library.register_fake("pdserve::paged_decode_attention")
    def _(query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=0):
        return query.new_empty(query.shape)

    @torch.library.register_fake("pdserve::rms_norm")
    def _(x, weight, eps, residual=None):
        return x.new_empty(x.shape)

    @torch.library.register_fake("pdserve::silu_and_mul")
    def _(gate_up):
        return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))

    @torch.library.register_fake("pdserve::rotary_and_write_kv")
    def _(qkv, cos, sin, k_cache, v_cache, slot_mapping):
        return None

    @torch.library.register_fake("pdserve::causal_softmax_")
    def _(scores, rows, scale):
        return None

    @torch.library.register_fake("pdserve::linear_small_m")
    def _(x, weight, bias=None):
        return x.new_empty((x.shape[0], weight.shape[0]))

    @torch.library.register_fake("pdserve::linear_packed_bf16")
    def _(x, weight_ptr, out_features, padded_k, bias=None):
        return x.new_empty((x.shape[0], out_features))

    @torch.library.register_fake("pdserve::linear_blocks")
    def _(x, qs, scales, bias=None, q8_activations=False):
        return x.new_empty((x.shape[0], qs.shape[0]))

    @torch.library.register_fake("pdserve::linear_w8a8")
    def _(x, wq, w_scale, bias=None):
        return x.new_empty((x.shape[0], w_scale.shape[0]))

    @torch.library.register_fake("pdserve::prefill_attention")
    def _(query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale):
        return query.new_empty(query.shape)

    @torch.library.register_fake("pdserve::decode_layers")
    def _(residual, x, *args):
        return x.new_empty(x.shape)

    @torch.library.register_fake("pdserve::decode_layers_fused")
    def _(residual, x, *args):
        return x.new_empty(x.shape)


def cpu_isa() -> str:
    """The ISA level whose build the ops run now ("avx512_bf16", "avx512_vnni", "avx512", "avx2" or "base").
    Raises KernelLoadError (see `load_library`)."""
    load_library()
    return torch.ops.pdserve.cpu_isa()


def cpu_isas() -> list[str]:
    """The ISA levels built into the library that this CPU runs, best first. Raises KernelLoadError."""
    load_library()
    return list(torch.ops.pdserve.cpu_isas())


def set_cpu_isa(isa: str) -> None:
    """Run the `isa` build from now on, in the whole process (tests and benchmarks compare the builds).

    Raises:
        KernelLoadError: the library does not load.
        ValueError: no build of `isa`, or this CPU lacks its instructions.
    """
    load_library()
    torch.ops.pdserve.set_cpu_isa(isa)


class CpuKernels:
    """The ops of the compiled library, with the fallbacks to the torch reference for what the C code does not
    compute. Get one with `CpuKernels.load()`."""

    def __init__(self):
        ops = torch.ops.pdserve
        # The overloads themselves: skips the overload lookup of each call through torch.ops.
        self._decode = ops.paged_decode_attention.default
        self._rms_norm = ops.rms_norm.default
        self._silu_and_mul = ops.silu_and_mul.default
        self._rotary_and_write_kv = ops.rotary_and_write_kv.default
        self._causal_softmax = ops.causal_softmax_.default
        self._prefill = ops.prefill_attention.default
        # fp32 (x [M, K], weight [N, K], bias [N] or None) -> x W^T + b [M, N] (`kernels/cpu_linear.c`); raises
        # ValueError on another dtype or mismatched shapes. Fast for small M only:
        # `engine.execution.packing.SmallBatchLinear`.
        self.linear_small_m = ops.linear_small_m.default
        # Every layer of a dense pre-norm decoder over an all-decode step in one call, the same ops as the model's
        # forward; its arguments are `engine.execution.cpu_decode_stack.CpuDecodeStack`'s (kernels/cpu_ops.cpp documents
        # them).
        self.decode_layers = ops.decode_layers.default
        # bf16 (x [M, K], weight_ptr, N, padded_k, bias [N] or None) -> x W^T + b [M, N] over a weight in oneDNN's
        # packed layout, read in place (`kernels/cpu_linear.c`; `engine.execution.packing.PackedLinear` checks the
        # layout and keeps the packed tensor alive), and every layer of an all-decode step over such weights (or fp32
        # ones) in one OpenMP region (`kernels/cpu_decode_step.c`, `engine.execution.cpu_decode_stack`).
        self.linear_packed_bf16 = ops.linear_packed_bf16.default
        self.decode_layers_fused = ops.decode_layers_fused.default
        # fp32 (x [M, K], qs, scales, bias [N] or None) -> x W^T + b [M, N] with W held as GGUF blocks: Q4_1 (qs
        # [N, K / 2] uint8, scales [N, K / 32, 2] fp16) or Q8_0 (qs [N, K] int8, scales [N, K / 32] fp16)
        # (`kernels/cpu_linear.c`; `engine.execution.packing.gguf_blocks`). Fast for small M only. q8_activations=True:
        # a one-row x is quantized to 8 bits a block and multiplied in integers, as llama.cpp does (lossy).
        self.linear_blocks = ops.linear_blocks.default
        # fp32 (x [M, K], wq packed [ceil(N / 16), K / 4, 64] uint8 (7-bit integers + 64), w_scale [N], bias [N] or
        # None) -> x W^T + b [M, N] through 8-bit integer products, x quantized per block of 64
        # (`kernels/cpu_int8_gemm.c`; `engine.execution.packing.w8a8_weights`, `w8a8_packed`). Lossy.
        self.linear_w8a8 = ops.linear_w8a8.default

    @classmethod
    def load(cls) -> CpuKernels:
        """Load the library (`load_library`). Raises KernelLoadError."""
        load_library()
        return cls()

    def paged_decode_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               sliding_window: int | None = 0) -> torch.Tensor:
        """Same contract as `kernels.reference.paged_decode_attention`: query [num_seqs, num_q_heads, head_dim],
        caches [num_blocks, block_size, num_kv_heads, head_dim] of its dtype or bf16 under an fp32 query
        (`--kv-cache-dtype`; dim 0 may be strided), block_tables
        [num_seqs, max_blocks] int32, context_lens [num_seqs] int32, all CPU tensors; sliding_window W >= 1 attends
        over positions [max(0, context_len - W), context_len) only (HF's sliding-window mask; the C kernel reads
        none of the blocks before the window's), 0 or None over the whole context; returns [num_seqs,
        num_q_heads, head_dim] in the query's dtype, with fp32 accumulation. fp32 and bf16 run in C; fp16, GQA
        groups over 16, head_dim over 256 or blocks over 64 tokens use the reference.

        Raises:
            ValueError: a bad shape, dtype, stride or device, a non-CPU tensor, a negative sliding_window, a context
                longer than its row of block_tables, or a block id outside the cache among the blocks the window
                reads (nothing is computed then).
        """
        q_shape, k_shape = query.shape, k_cache.shape
        # One expression (each shape read once): called once per layer per step.
        if (query.dtype in _C_DTYPES and len(q_shape) == 3 and len(k_shape) == 4 and q_shape[2] <= MAX_HEAD_DIM
                and k_shape[1] <= MAX_BLOCK and q_shape[1] <= MAX_GROUP * k_shape[2]):
            # checks its inputs; None is the op's 0 (no window)
            return self._decode(query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window or 0)
        check_attention(query, k_cache, v_cache, block_tables, context_lens, query.shape[0] if query.dim() else 0,
                        mixed_kv=True)
        check(query.device.type == "cpu", lambda: f"the cpu attention kernel needs CPU tensors, got {query.device}")
        return reference_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window)

    # The small per-token ops (cpu_layer_ops.c). Each keeps the contract of its torch reference in kernels.reference;
    # they are called once or twice per layer per step, so the dtype is the one test here: fp16 goes to the
    # reference, and the op checks the rest (a ValueError) or copies an input whose strides the C code cannot read.

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """As `kernels.reference.rms_norm`: x [T, hidden] (rows may be strided), weight [hidden] in x's dtype,
        residual None or [T, hidden] contiguous, updated in place; returns a new [T, hidden].

        Raises:
            ValueError: shapes, dtypes or a residual's layout that do not match (fp32 and bf16).
        """
        if x.dtype in _C_DTYPES:
            return self._rms_norm(x, weight, eps, residual)
        return reference_rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """As `kernels.reference.silu_and_mul`: gate_up [T, 2 * inter] -> [T, inter].

        Raises:
            ValueError: gate_up is not 2-D with an even width (fp32 and bf16).
        """
        if gate_up.dtype in _C_DTYPES:
            return self._silu_and_mul(gate_up)
        return reference_silu_and_mul(gate_up)

    def causal_softmax(self, scores: torch.Tensor, rows: int, scale: float,
                       window_start: int | None = None) -> torch.Tensor:
        """As `kernels.cpu_prefill.causal_softmax`, writing the probabilities into `scores` and returning it;
        fp16 or non-contiguous scores take the torch version.

        The C softmax masks the causal diagonal only. With `window_start`, the keys left of each row's window are
        first overwritten with `_HIDDEN`, a finite score (the C code is built with -ffast-math, which assumes no
        infinities) so far below any real one that its probability underflows to exactly 0: every row sees its own
        key, so the row's max is a real score.
        """
        if scores.dtype != torch.bfloat16 or not scores.is_contiguous():
            return cpu_prefill.causal_softmax(scores, rows, scale, window_start)
        if window_start is not None:
            hidden = cpu_prefill.left_of_window(rows, scores.shape[-1], window_start, scores.device)
            scores.view(-1, rows, scores.shape[-1])[..., :hidden.shape[1]].masked_fill_(hidden, _HIDDEN)
        self._causal_softmax(scores, rows, scale)
        return scores

    def prefill_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                          scale: float, max_query_len: int | None = None,
                          sliding_window: int | None = 0) -> torch.Tensor:
        """The contract of `kernels.reference.prefill_attention`. Without a sliding window, in C, one pass per tile of
        query rows (`kernels/cpu_prefill_attention.c`): an fp32 query over fp32 or bf16 caches with head_dim a
        multiple of 32 (fp32 FMAs, a bf16 cache widened as it is packed; 2 AVX2
        AMD EPYC Zen 3 cores, SmolLM2's layer: 1.9-3.5x the reference's SDPA with its explicit mask), bf16
        ones with head_dim a multiple of 64 in the avx512_bf16 build (VDPBF16PS scores and P.V); head_dim up to 256.
        Otherwise `kernels.cpu_prefill.prefill_attention` (bf16: blocked GEMMs with the softmax in C; fp32: the
        reference).

        Raises:
            ValueError: a chunk longer than its context, a context longer than its block table row, or a block id
                outside the cache (the C path; nothing computed), or bad shapes and dtypes.
        """
        multiple = 64 if query.dtype == torch.bfloat16 else 32
        if (query.dtype in _C_DTYPES and not sliding_window and query.dim() == 3
                and query.shape[-1] % multiple == 0 and query.shape[-1] <= MAX_HEAD_DIM):
            out = self._prefill(query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale)
            if out is not None:  # None: bf16 in a build without AVX512_BF16
                return out
        return cpu_prefill.prefill_attention(query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
                                             scale, max_query_len, sliding_window, softmax=self.causal_softmax,
                                             block_m=cpu_prefill.C_BLOCK_M)

    def rotary_and_write_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """As `kernels.reference.rotary_and_write_kv`, rotating the q and k heads of `qkv` ([T, q_heads + 2 *
        kv_heads, head_dim], heads dense within a token) in place, writing the k and v heads into the caches
        ([num_blocks, block_size, kv_heads, head_dim], dense within a block) at slot_mapping ([T] int64), and
        returning the q heads' view of qkv. cos, sin: [T, head_dim] (any shape of that size) in qkv's dtype.

        Raises:
            ValueError: a slot outside the cache (the reference raises IndexError there), naming the token, with
                nothing rotated or written; or shapes, dtypes or layouts that do not match (fp32 and bf16).
        """
        if qkv.dtype in _C_DTYPES:
            self._rotary_and_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping)
            return qkv[:, :qkv.shape[1] - 2 * k_cache.shape[2]]
        return reference_rotary_and_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping)
