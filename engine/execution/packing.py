"""The linear layers' CPU forms, chosen at load: bf16 prepacked for oneDNN, fp32 small batches through our kernel.

bf16 (`PackedLinear`): the weights reordered once, at load, into oneDNN's blocked layout. A decode step's few rows
(up to `PACKED_GEMV_ROWS`) go through the cpu backend's own kernel over that same packed tensor, read in place
(`kernels/cpu_linear.c`: blocks of 64 output features with K in pairs, VDPBF16PS's operand shape), prefill chunks
through oneDNN. Every linear of SmolLM2-135M once, distinct weights from DRAM, 2 threads, AMD EPYC (Zen 5) with
AVX512_BF16: 4.4 against oneDNN's 6.6 ms at M = 1 (61 against 41 GB/s), 9.9 / 11.3 at 16, 15.4 / 16.0 at 32, level at
64. In the one-region decode step (engine.execution.cpu_decode_stack) the kernel also saves a parallel region per op:
on an AMD EPYC Zen 4 (2 cores, bf16 steps of SmolLM2 at ~145 tokens of context, the two caps alternated, medians of
4-6) a step of 40 / 48 / 64 sequences took 44.1 / 56.3 / 69.8 ms with it against 47.9 / 67.5 / 69.9 through oneDNN,
so the kernel takes up to 64 rows. The layout is oneDNN's choice, not a contract: each packed weight is checked
against torch's linear at load, and one the kernel does not read as torch computes it stays on oneDNN at every M.

A plain `F.linear` on bf16 CPU tensors hands oneDNN the weights in PyTorch's [out, in] layout on every call, so
each call either reorders them or runs a kernel for the plain layout. Reordering once at load is what PyTorch's
own inductor does for CPU inference with freezing (`torch.ops.mkldnn._reorder_linear_weight` and
`torch.ops.mkldnn._linear_pointwise`, the ops used here).
Measured on this machine kind (1 thread, SmolLM2's seven projection shapes per layer, `bench/step_profile.py`'s
GEMM baseline): bf16 F.linear reaches 5.9 / 22.8 / 96 / 189 GFLOP/s at M = 1 / 4 / 16 / 64 rows, the packed op
10.5-11 / 41-46 / 150-165 / 290-440 (fp32 F.linear: 9.1 / 19.3 / 42 / 75; a packed fp32 weight did not pay).

fp32 (`SmallBatchLinear`): torch's fp32 linear runs a decode step's few rows poorly (a GEMV at about a third of
the machine's read bandwidth at M = 1, and from M = 2 a GEMM slower than that GEMV: by its timing it packs the
weight on every call), so up to `SMALL_BATCH_ROWS` rows go through the cpu backend's own kernel
(`kernels/cpu_linear.c`) over the same weight tensor, and larger batches (prefill chunks) through torch's GEMM. The
crossover was measured on the 2-core AMD EPYC VM (AVX2, 2 threads, every linear of SmolLM2-135M once, distinct
weights streamed from DRAM, `bench/small_linear.py`): the kernel ran 1.3-2.8x torch's speed from M = 1 to 32,
1.2-1.3x at 64, about even at 128 (1.04x) and slower at 256 (0.86x), so up to 64 rows (a decode step's at the
default --max-num-seqs) take it.

fp32 weights that are a GGUF's dequantization (the packaged default model's layers are Q4_1, its embedding and tied
LM head Q8_0) are also kept in that form (`gguf_blocks`: each block of 32 weights along K is exactly d * q + m or
d * q, checked bit for bit at load), and a decode step's rows read them there (`kernels/cpu_linear.c`,
`linear_blocks`): 5 or 8.5 bits a weight instead of 32, and the same fp32 weights: from 2 rows the same sums as the
small-batch kernel on the fp32 tensor bit for bit, at 1 row the same products with each block's scale applied once
(the last bits differ, as torch's GEMM's do). Where the kernel's build has panels (AVX2: 16 features dequantized
and transposed once, 6 x 16 FMA tiles; `AttentionOps.blocks_prefill`), prefill chunks read the blocks too: torch's
GEMM packs its weight on every call, which at a short prompt's rows costs a third of its kernel time. The packaged
model's 100-token prompt, the engine's whole prefill step, 2 AVX2 AMD EPYC cores, the two alternating (ABBA), 30
each: 211 ms p50 through torch's GEMM, 164 through the panels (1.29x; 1.46x in a slower phase); sixteen such prompts
in one step 2,805 against 2,640 ms (1.06x). Elsewhere larger batches keep torch's GEMM on the fp32 tensor (the blocks
cost 16% or 27% more memory beside it).

`--quantization w8a8_int8` (`use_w8a8`): the fp32 decoder layers' linears go through 8-bit integer products
(`kernels/cpu_int8_gemm.c`: weights as 7-bit integers per output row, `w8a8_weights`, in groups of 16 rows for
VNNI-style dot products, `w8a8_packed`; each row of x quantized per block of 64 on the fly). Prefill chunks, where
torch's fp32 GEMM already runs at the FMA units' peak: fewer instructions a product (1.32-1.43x torch at 128-512 rows on
an AVX2 AMD EPYC, 1.77x at 512 with AVX512-VNNI on an Ice Lake Xeon); decode steps of 2 to 64 rows: also a quarter of
the fp32 weight bytes (every decoder linear of SmolLM2-135M, 2 threads, AVX2 AMD EPYC: 1.3-1.6x the Q4_1 blocks,
1.4-2.2x the fp32 kernel); the LM head too. One row of weights held as GGUF blocks stays on those (5 or 8.5 bits a
weight: faster there, and exact). Lossy, as SGLang's w8a8_int8 and llama.cpp's Q8_0 are.

CPU only; anything else keeps `nn.Linear`. Unverified on GPU by construction: never applied there.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

SMALL_BATCH_ROWS = 64  # most rows a SmallBatchLinear sends to its kernel (the crossover in the module docstring)
PACKED_GEMV_ROWS = 64  # most rows a PackedLinear sends to the packed-layout kernel (module docstring)
PACKED_BLOCK = 64  # output features per block of oneDNN's packed bf16 layout, as kernels/cpu_linear.c reads it
GGUF_BLOCK = 32  # weights along K per Q4_1 / Q8_0 block (GGUF's QK4_1, QK8_0), each with its fp16 scale
W8A8_BLOCK = 64  # x's quantization block along K in kernels/cpu_int8_gemm.c (PDSERVE_W8A8_BLOCK)
W8A8_GROUP = 16  # W's rows per packed group in kernels/cpu_int8_gemm.c (PDSERVE_W8A8_GROUP)
W8A8_WEIGHT_MAX = 63  # 7-bit weights: VPMADDUBSW's int16 pair sums cannot saturate (kernels/cpu_int8_gemm.c)


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """True where `PackedLinear` applies: CPU, bf16, and a oneDNN build with bf16 support on this CPU."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """y = x @ W^T + b with W held in oneDNN's blocked layout. x: [..., in] bf16 -> [..., out] bf16.

    The packed weight is an opaque oneDNN tensor (not a state-dict entry): pack after the weights are loaded. Up to
    `PACKED_GEMV_ROWS` rows go through `gemv` (the cpu backend's kernel over the packed tensor's memory) when given and
    the check at construction found that it reads this weight's layout; more rows, or without it, through oneDNN.
    Numerics either way: fp32 accumulation, the bias in fp32, one rounding to bf16, as `F.linear` on CPU; the two
    sum in different orders (the last bits differ).

    Args:
        linear: a loaded bf16 `nn.Linear` on CPU (weight [out, in]).
        gemv: (x [M, in] bf16, weight_ptr, out, padded_k, bias [out] | None) -> [M, out]
            (`kernels.backends.AttentionOps.packed_bf16_linear`), or None.

    Attributes:
        weight_ptr, padded_k: the packed tensor's address and its K padded to whole pairs (what `gemv` and the fused
            decode step read), 0 when `gemv` does not apply to this weight.

    Raises:
        ValueError: the layer is not bf16 on CPU.
    """

    def __init__(self, linear: nn.Linear, gemv: Callable[..., torch.Tensor] | None = None):
        super().__init__()
        w = linear.weight.detach()
        if not packing_supported(w.device, w.dtype):
            raise ValueError(f"packed linears need bf16 weights on CPU with oneDNN bf16 support, got {w.dtype} on "
                             f"{w.device}")
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_ptr = self.padded_k = 0
        self._gemv = None
        if gemv is not None:
            layout = _packed_layout(self.packed_weight, w, gemv)
            if layout is not None:
                self.weight_ptr, self.padded_k = layout
                self._gemv = gemv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gemv is not None and x.dim() == 2 and x.shape[0] <= PACKED_GEMV_ROWS:
            return self._gemv(x, self.weight_ptr, self.out_features, self.padded_k, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias, "none", [], "")


def _packed_layout(packed: torch.Tensor, weight: torch.Tensor,
                   gemv: Callable[..., torch.Tensor]) -> tuple[int, int] | None:
    """(address, padded K) of a packed bf16 weight when `gemv` reads it as torch's linear computes with `weight`
    [N, K], else None. The padded K comes from the buffer's size (N padded to whole `PACKED_BLOCK`s); the check is
    one product of two fixed random rows against `F.linear`'s: within 5% of the largest output, where reading another
    layout gives errors of the outputs' own size (bf16 rounding alone is ~0.4%)."""
    n, k = weight.shape
    blocks = -(-n // PACKED_BLOCK)
    nbytes = torch.ops.mkldnn._nbytes(packed)
    if k % 2 or nbytes % (blocks * PACKED_BLOCK * 2):
        return None
    padded_k = nbytes // (blocks * PACKED_BLOCK * 2)
    if padded_k < k or padded_k % 2:
        return None
    address = torch.ops.mkldnn.data_ptr(packed)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.inference_mode():
        got, want = gemv(x, address, n, padded_k, None).float(), F.linear(x, weight).float()
    scale = want.abs().max().item()
    return (address, padded_k) if (got - want).abs().max().item() <= 0.05 * scale + 1e-6 else None


def _q4_1_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`q4_1_blocks` of a few rows (the temporaries are a few times their size)."""
    n, k = weight.shape
    blocks = weight.reshape(n, k // GGUF_BLOCK, GGUF_BLOCK)
    low, high = blocks.amin(-1), blocks.amax(-1)
    m, d = low.half(), ((high - low) / 15).half()
    if not (torch.isfinite(m).all() and torch.isfinite(d).all()):
        return None
    d32, m32 = d.float().unsqueeze(-1), m.float().unsqueeze(-1)
    q = torch.round((blocks - m32) / torch.where(d32 == 0, 1.0, d32)).clamp_(0, 15)
    if not torch.equal(d32 * q + m32, blocks):
        return None
    q = q.to(torch.uint8).reshape(n, k // GGUF_BLOCK, 2, 2, 8)  # [.., half h, low/high nibble, j]
    return (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(n, k // 2), torch.stack([d, m], dim=-1)


def _q8_0_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`q8_0_blocks` of a few rows."""
    n, k = weight.shape
    blocks = weight.reshape(n, k // GGUF_BLOCK, GGUF_BLOCK)
    d = (blocks.abs().amax(-1) / 127).half()
    if not torch.isfinite(d).all():
        return None
    d32 = d.float().unsqueeze(-1)
    q = torch.round(blocks / torch.where(d32 == 0, 1.0, d32)).clamp_(-127, 127)
    if not torch.equal(d32 * q, blocks):
        return None
    return q.to(torch.int8).reshape(n, k), d


def _by_rows(weight: torch.Tensor, rows_form: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None],
             chunk_elements: int = 1 << 24) -> tuple[torch.Tensor, torch.Tensor] | None:
    """rows_form over slices of `weight`'s rows (about chunk_elements weights each, so that checking a large LM head
    does not hold several fp32 copies of it at once), concatenated; None as soon as one slice is not of the form."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % GGUF_BLOCK:
        return None
    step = max(1, chunk_elements // max(1, weight.shape[1]))
    parts = []
    with torch.inference_mode():
        for start in range(0, weight.shape[0], step):
            part = rows_form(weight.detach()[start:start + step])
            if part is None:
                return None
            parts.append(part)
    if not parts:
        return None
    return torch.cat([p[0] for p in parts]).contiguous(), torch.cat([p[1] for p in parts]).contiguous()


def q4_1_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The Q4_1 form of an fp32 weight [N, K] that is exactly one, else None.

    Q4_1 (GGUF, llama.cpp's ggml-quants): each block of 32 weights along K is d * q + m with q in 0..15 and d, m
    fp16. A dequantized Q4_1 tensor keeps its blocks' minimum (q = 0) and maximum (q = 15), so m = fp16(min) and
    d = fp16((max - min) / 15) recover them; the form is returned only when d * q + m reproduces every weight bit for
    bit in fp32 (d * q is exact, the sum one rounding, as the kernel computes it).

    Returns:
        (qs [N, K / 2] uint8, 16 bytes a block: byte 8h + j holds weight 16h + j of the block in its low nibble and
        weight 16h + 8 + j in its high one, h < 2, j < 8 (the kernel's layout, kernels/cpu_linear.c); scales
        [N, K / 32, 2] float16: each block's d and m), or None: K not a multiple of 32, a block not of that form, or a
        scale out of fp16's range.
    """
    return _by_rows(weight, _q4_1_rows)


def q8_0_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The Q8_0 form of an fp32 weight [N, K] that is exactly one, else None.

    Q8_0 (GGUF): each block of 32 weights along K is d * q with q in -127..127 and d fp16 (llama.cpp's quantizer sets
    d = amax / 127, so the block's largest magnitude has |q| = 127 and d = fp16(amax / 127) recovers it); returned only
    when d * q reproduces every weight bit for bit (exact in fp32).

    Returns:
        (qs [N, K] int8 in order; scales [N, K / 32] float16), or None as `q4_1_blocks`.
    """
    return _by_rows(weight, _q8_0_rows)


def gguf_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The GGUF block form an fp32 weight [N, K] is exactly, fewest bytes first (`q4_1_blocks`, then `q8_0_blocks`),
    as (qs, scales) for `kernels.backends.AttentionOps.blocks_linear` (`blocks_format` tells which), or None."""
    return q4_1_blocks(weight) or q8_0_blocks(weight)


def blocks_format(blocks: tuple[torch.Tensor, torch.Tensor]) -> str:
    """"q4_1" or "q8_0": the format of `gguf_blocks`' (qs, scales), told by qs's dtype (uint8: two weights a byte;
    int8), as kernels/cpu_ops.cpp's linear_blocks tells it."""
    return "q4_1" if blocks[0].dtype == torch.uint8 else "q8_0"


class SmallBatchLinear(nn.Module):
    """y = x @ W^T + b in fp32 on CPU: up to `SMALL_BATCH_ROWS` rows through `small_m` (the cpu backend's kernel),
    more through torch's GEMM, both on nn.Linear's own weight tensor (no copy). x: [..., in] fp32 -> [..., out] fp32.
    A weight that is a dequantized GGUF tensor (`gguf_blocks`) is also held in that form, and the small batches read
    it there through `blocks_linear` when given: the same weights, 3.8-6.4x fewer bytes; with `blocks_prefill`, every
    row count does (the module docstring says where and why).

    Numerics: fp32 with fp32 accumulation either way; the kernels sum in another order than torch's GEMM, so results
    differ from F.linear in the last bits (`blocks_linear` sums exactly as `small_m` does from 2 rows).

    Args:
        linear: a loaded fp32 `nn.Linear` on CPU (weight [out, in]).
        small_m: (x [M, in], weight [out, in], bias [out] | None) -> [M, out]
            (`kernels.backends.AttentionOps.small_batch_linear`).
        blocks_linear: (x [M, in], qs, scales, bias [out] | None) -> [M, out]
            (`kernels.backends.AttentionOps.blocks_linear`), or None.
        blocks_prefill: blocks_linear also takes more than SMALL_BATCH_ROWS rows
            (`kernels.backends.AttentionOps.blocks_prefill`).

    Attributes:
        blocks: (qs, scales) of `gguf_blocks`, or None (no `blocks_linear`, or the weight is not of such a form);
            the small batches read them while they are set (None reads the fp32 tensor).
        q8_activations: a one-row x is quantized to 8 bits a block and multiplied in integers against the blocks
            (`use_q8_activations`); False (the default) keeps the exact fp32 arithmetic.
        int8: (op, wp, w_scale): `w8a8_weights`' tensors (wq as `w8a8_packed`) and the op that reads them, or None
            (the default): every row count goes through 8-bit integer products (`use_w8a8`), but one row where
            `blocks` is set (then read with q8_activations).
    """

    def __init__(self, linear: nn.Linear, small_m: Callable[..., torch.Tensor],
                 blocks_linear: Callable[..., torch.Tensor] | None = None, blocks_prefill: bool = False):
        super().__init__()
        # Plain attributes, not parameters (as PackedLinear's): read on every call, and never moved after load.
        self.weight = linear.weight.detach()
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._small_m = small_m
        self._blocks_linear = blocks_linear
        self.blocks = gguf_blocks(self.weight) if blocks_linear is not None else None
        self._blocks_rows = None if blocks_prefill else SMALL_BATCH_ROWS  # most rows the blocks take; None: any
        self.q8_activations = False
        self.int8: tuple[Callable[..., torch.Tensor], torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if self.int8 is not None and (rows.shape[0] > 1 or self.blocks is None):
            op, *weights = self.int8
            y = op(rows, *weights, self.bias)
        elif self.blocks is not None and (self._blocks_rows is None or rows.shape[0] <= self._blocks_rows):
            y = self._blocks_linear(rows, *self.blocks, self.bias, self.q8_activations)
        elif rows.shape[0] > SMALL_BATCH_ROWS:
            y = F.linear(rows, self.weight, self.bias)
        else:
            y = self._small_m(rows, self.weight, self.bias)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)


def use_q8_activations(model: nn.Module) -> int:
    """Have every `SmallBatchLinear` under `model` that holds GGUF blocks compute a one-row x as llama.cpp does:
    quantized to 8 bits per block of 32 (scale max |x| / 127, kept in fp32; llama.cpp's Q8_1 / Q8_0), integer dot
    products against the blocks (kernels/cpu_linear.c, PDSERVE_Q8_ACTIVATIONS): fewer instructions a weight (2 AVX2
    cores: the packaged model's layers 3.8 against 4.9 ms exact at one row, its LM head 0.85 against 1.0); from 2
    rows, and prefill, the arithmetic stays exact. Lossy: about 1% relative error in each output on random weights
    (the row's rounding), +1.2-1.7% perplexity on the packaged model (bench/quality.py; the spread is rounding: which
    values round which way moved with the split decode attention's last bits), as llama.cpp's arithmetic has.
    Returns how many linears were switched.

    Source: ggml-cpu's ggml_vec_dot_q4_1_q8_1 and ggml_vec_dot_q8_0_q8_0 (llama.cpp), whose arithmetic this is, with
    the row's scales in fp32 instead of fp16 and Q4_1's minimum against the exact sum of x.
    """
    linears = [m for m in model.modules() if isinstance(m, SmallBatchLinear) and m.blocks is not None]
    for m in linears:
        m.q8_activations = True
    return len(linears)


def w8a8_weights(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 weight [N, K] as `kernels/cpu_int8_gemm.c` reads it: (wq [N, K] uint8, w_scale [N] fp32) with
    W ~= (wq - 64) * w_scale[:, None]: symmetric per output row, q = round(W / w_scale) in [-63, 63] (round half to
    even: each weight within w_scale / 2 of its original), stored with 64 added (the kernel's unsigned operand).
    Seven bits: the module docstring says why.

    Raises:
        ValueError: K is not a multiple of W8A8_BLOCK.
    """
    k = weight.shape[1]
    if k % W8A8_BLOCK:
        raise ValueError(f"int8 GEMMs need in_features divisible by {W8A8_BLOCK}, got {k}")
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-30) / W8A8_WEIGHT_MAX
    q = torch.round(w / scale[:, None]).clamp(-W8A8_WEIGHT_MAX, W8A8_WEIGHT_MAX)
    return (q + 64).to(torch.uint8).contiguous(), scale.contiguous()


def w8a8_packed(wq: torch.Tensor) -> torch.Tensor:
    """`w8a8_weights`' wq [N, K] in the layout `kernels/cpu_int8_gemm.c` reads (its header says why): rows in groups
    of W8A8_GROUP, the last padded with zero weights (stored 64), each group K / 4 runs of W8A8_GROUP x 4 bytes, run t
    holding wq[n, 4t .. 4t + 3] for the group's rows n in turn. Returns wp [ceil(N / 16), K / 4, 64] uint8,
    contiguous (K a multiple of 4, as W8A8_BLOCK makes it)."""
    n, k = wq.shape
    groups = -(-n // W8A8_GROUP)
    padded = torch.full((groups * W8A8_GROUP, k), 64, dtype=torch.uint8)
    padded[:n] = wq
    # [G, 16, K / 4, 4] -> [G, K / 4, 16, 4]: the four bytes of a run stay together, the group's rows side by side.
    runs = padded.view(groups, W8A8_GROUP, k // 4, 4).transpose(1, 2)
    return runs.reshape(groups, k // 4, 4 * W8A8_GROUP).contiguous()


def use_w8a8(model: nn.Module, int8_linear: Callable[..., torch.Tensor]) -> int:
    """Have every `SmallBatchLinear` under `model`, the LM head included, compute its rows through 8-bit integer
    products (the module docstring): `int8_linear` (x [M, K], wp, w_scale, bias | None) -> [M, N]
    (`kernels.backends.AttentionOps.int8_linear`) over the layer's `w8a8_weights`, kept beside its fp32 weight (+25% of
    the weights' bytes); a one-row x of a linear that holds GGUF blocks keeps reading those (fewer bytes than 8 bits a
    weight), quantized to 8 bits as `use_q8_activations` does: integer products at every row count, as the mode says
    (exact fp32 there cost 1.14x the time of a 100-in / 75-out request at batch 1, 2 AMD EPYC Zen 3 cores, in one
    process alternating ABBA, 20 requests each, 2026-12-07). The LM head as llama.cpp's
    Q8_0 models compute theirs (SGLang's and vLLM's w8a8 keep it in 16 bits): at a decode step's 64 rows it was a
    fifth of the step in fp32 and runs 1.8x faster as int8 products (SmolLM2-135M's 49,152 x 576 head, 2 AVX2 cores),
    for +0.1% perplexity (+0.8% over a bf16 KV cache). Lossy: +2.2% perplexity in all on the packaged model through
    the engine as one prefill (bench/quality.py; docs/benchmarks.md). Returns how many linears were switched; a
    linear whose in_features is not a multiple of W8A8_BLOCK keeps the fp32 forms.

    Source: SGLang's w8a8_int8 (per-channel int8 weights, x quantized on the fly) for the scheme; the 7-bit weights
    and per-block x scales are this kernel's (AVX2 has no int8 dot product that cannot saturate).
    """
    count = 0
    for m in model.modules():
        if isinstance(m, SmallBatchLinear) and not m.in_features % W8A8_BLOCK:
            wq, w_scale = w8a8_weights(m.weight)
            m.int8 = (int8_linear, w8a8_packed(wq), w_scale)
            m.q8_activations = m.blocks is not None
            count += 1
    return count


def pack_linears(model: nn.Module, small_batch_linear: Callable[..., torch.Tensor] | None = None,
                 packed_bf16_linear: Callable[..., torch.Tensor] | None = None,
                 blocks_linear: Callable[..., torch.Tensor] | None = None, blocks_prefill: bool = False) -> int:
    """Replace the CPU `nn.Linear`s under `model` (projections and LM head), in place: bf16 ones by a `PackedLinear`
    where oneDNN packs bf16 (its small batches through `packed_bf16_linear` when given: the cpu backend's), fp32 ones
    by a `SmallBatchLinear` over `small_batch_linear` when one is given (the cpu backend's), holding GGUF blocks for
    `blocks_linear` where the weight is of such a form (at every row count with `blocks_prefill`). Returns how many
    were replaced; the others are left as they are."""
    count = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear) and packing_supported(child.weight.device, child.weight.dtype):
            setattr(model, name, PackedLinear(child, packed_bf16_linear))
            count += 1
        elif (isinstance(child, nn.Linear) and small_batch_linear is not None and child.weight.device.type == "cpu"
              and child.weight.dtype == torch.float32):
            setattr(model, name, SmallBatchLinear(child, small_batch_linear, blocks_linear, blocks_prefill))
            count += 1
        else:
            count += pack_linears(child, small_batch_linear, packed_bf16_linear, blocks_linear, blocks_prefill)
    return count
