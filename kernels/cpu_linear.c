/* y = x W^T (+ b) in fp32 for the few rows of a decode step: the linear layers' small-M GEMM on CPU.
 *
 * Why ours: torch's fp32 linear on CPU (MKL/oneDNN sgemm) runs small M poorly. At M = 1 it takes a GEMV path at
 * about 8 GB/s of weights where the machine reads 22; from M = 2 on its GEMM path took longer than M = 1 (by its
 * timing it packs the weight on every call; not profiled inside). 2-core AMD EPYC VM, AVX2, 60 distinct 1536 x 576
 * weights streamed from DRAM: 24 / 42 / 41 / 55 ms at M = 1 / 2 / 4 / 16, this kernel 14 / 15 / 16 / 32.
 * A decode step is that regime: every weight is read once per step for a handful of rows.
 *
 * Form: W stays in nn.Linear's [N, K] layout (no copy, no repacking: the same tensor serves torch's GEMM for large M,
 * kernels/cpu_ops.py). Each thread takes blocks of adjacent output features (weight rows adjacent in memory: one
 * sequential stream) and keeps a tile of vector accumulators over K, reduced at the end: below 4 rows, blocks of 4
 * features and 2 x 4 tiles (8 independent FMA chains, enough to hide the FMA latency on two FMA ports); from 4 rows,
 * blocks of 3 and 4 x 3 tiles (fewer loads per FMA once the step's rows make it compute-bound; with AVX-512's 32
 * registers blocks of 6 and 4 x 6 tiles, tile_4x6). A block's weight
 * rows are re-read for each group of x rows from L1/L2, so DRAM sees each weight once per call. Vectors are GCC's
 * vector extensions at the width of the level being compiled (setup.py builds this file per ISA level), so one
 * source serves SSE2, AVX2 and AVX-512.
 * fp32 sums are reassociated against torch's (per-lane partial sums): results differ in the last bits.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_kernels.h"

#if defined(__AVX512BF16__) || defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
#define NB 4  /* weight rows (output features) per block */
#define MB 2  /* x rows per pass over a block */
/* Weight rows ahead that the blocks' loops prefetch (about 4.6 KB of Q4_1 at K = 576). Without it the one-row loops
 * waited on memory: 2 AMD EPYC Zen 3 cores, SmolLM2-135M's layer linears 6.0 -> 4.9 ms, its Q8_0 LM head 2.6 ->
 * 1.0 ms; 4, 8 and 16 rows measured alike within noise, 16 best for the head. */
#define PF_ROWS 16

/* Weight rows of the tile for 4 or more rows: 3 with 16 vector registers (tile_4x3), 6 with AVX-512's 32 (tile_4x6). */
#if VW == 16
#define TILE_N 6
#else
#define TILE_N 3
#endif

/* Output features a thread takes at a time for M rows (each small-M kernel here; linear_small_m_rows says why). */
static inline int block_features(int M) { return M < 4 ? NB : TILE_N; }

typedef float vf __attribute__((vector_size(VW * sizeof(float)), aligned(4), may_alias));  /* unaligned loads */

static inline vf vload(const float *p) { return *(const vf *)p; }

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VW; i++) s += v[i];
    return s;
}

/* out[i][j] = dot(x row i, w row j) for i < mb, j < nb; x rows x_stride apart, w rows K apart. mb is a constant at
 * each call site (always inlined), and nb too but for the last block's tail features, so the loops over them unroll
 * and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void dot_tile(const float *x, int64_t x_stride, const float *w, int K,
                                                            float out[MB][NB], const int mb, const int nb) {
    vf acc[MB][NB];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = (vf){0};
    int k = 0;
    for (; k + VW <= K; k += VW) {
        vf wv[NB];
        for (int j = 0; j < nb; j++) wv[j] = vload(w + (int64_t)j * K + k);
        for (int i = 0; i < mb; i++) {
            const vf xv = vload(x + i * x_stride + k);
            for (int j = 0; j < nb; j++) acc[i][j] += xv * wv[j];
        }
    }
    for (int i = 0; i < mb; i++) {
        for (int j = 0; j < nb; j++) {
            float s = hsum(acc[i][j]);
            for (int t = k; t < K; t++) s += x[i * x_stride + t] * w[(int64_t)j * K + t];
            out[i][j] = s;
        }
    }
}


/* out[i][j] for a 4-row tile's accumulators acc[i][j] (i < 4, j < nj, row-major): each lane sum (hsum), then the K %
 * VW tail from k on; xr the tile's 4 x rows, w its nj weight rows K apart. One definition, so that every 4-row tile
 * sums an output alike. */
static inline void tile_sums(const vf *acc, int nj, const float *const xr[4], const float *w, int K, int k,
                             float *out) {
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < nj; j++) {
            float s = hsum(acc[i * nj + j]);
            for (int t = k; t < K; t++) s += xr[i][t] * w[(int64_t)j * K + t];
            out[i * nj + j] = s;
        }
}

#if VW != 16
/* The tile of 4 or more rows: 4 x rows by 3 weight rows, 12 accumulators (with the 3 weight vectors and one x vector,
 * the 16 vector registers of AVX2), 7 loads per 12 FMAs against the 2 x 4 tile's 6 per 8. Named variables, not
 * arrays: written as arrays, GCC spilled one accumulator to the stack inside the loop (a store-load chain each
 * iteration). out[i][j] = dot(x row i, w row j) for i < rows (1-4, x rows xs apart); with fewer than 4 rows the
 * missing ones repeat the last (computed, not stored by the caller): a full tile's time, where a 1 x 3 pass is held
 * to 3 FMA chains by the FMA latency. */
static inline void tile_4x3(const float *x, int64_t xs, int rows, const float *w, int K, float out[4][3]) {
    vf a00 = {0}, a01 = {0}, a02 = {0}, a10 = {0}, a11 = {0}, a12 = {0};
    vf a20 = {0}, a21 = {0}, a22 = {0}, a30 = {0}, a31 = {0}, a32 = {0};
    const float *w0 = w, *w1 = w + K, *w2 = w + 2 * (int64_t)K;
    const float *x0 = x, *x1 = x + (rows > 1 ? 1 : 0) * xs, *x2 = x + (rows > 2 ? 2 : rows - 1) * xs,
                *x3 = x + (rows > 3 ? 3 : rows - 1) * xs;
    int k = 0;
    for (; k + VW <= K; k += VW) {
        const vf v0 = vload(w0 + k), v1 = vload(w1 + k), v2 = vload(w2 + k);
        vf u = vload(x0 + k);
        a00 += u * v0; a01 += u * v1; a02 += u * v2;
        u = vload(x1 + k);
        a10 += u * v0; a11 += u * v1; a12 += u * v2;
        u = vload(x2 + k);
        a20 += u * v0; a21 += u * v1; a22 += u * v2;
        u = vload(x3 + k);
        a30 += u * v0; a31 += u * v1; a32 += u * v2;
    }
    const vf acc[4][3] = {{a00, a01, a02}, {a10, a11, a12}, {a20, a21, a22}, {a30, a31, a32}};
    const float *const xr[4] = {x0, x1, x2, x3};
    tile_sums(&acc[0][0], 3, xr, w, K, k, &out[0][0]);
}
#define TILE_4XN tile_4x3
#else
/* tile_4x3 (the other builds' tile) with 6 weight rows, for AVX-512's 32 registers: 24 accumulators, 6 weight vectors
 * and one x vector. Each x vector loaded (from L1 or L2: a decode step's rows) serves 6 FMAs instead of 3. Ice Lake
 * Xeon, 2 threads, every linear of SmolLM2-135M against torch's GEMM in the same run (bench/small_linear.py): 0.89x /
 * 0.60x at 16 / 64 rows with 4 x 3 tiles, 1.08x / 0.99x with these. Every output is summed exactly as tile_4x3 sums it
 * (its own lanes over K in order, then tile_sums), so the results are the same bits. */
#define ACC6(i) vf a##i##0 = {0}, a##i##1 = {0}, a##i##2 = {0}, a##i##3 = {0}, a##i##4 = {0}, a##i##5 = {0}
#define FMA6(i) a##i##0 += u * v0; a##i##1 += u * v1; a##i##2 += u * v2; \
                a##i##3 += u * v3; a##i##4 += u * v4; a##i##5 += u * v5
#define ROW6(i) {a##i##0, a##i##1, a##i##2, a##i##3, a##i##4, a##i##5}
static inline void tile_4x6(const float *x, int64_t xs, int rows, const float *w, int K, float out[4][6]) {
    ACC6(0); ACC6(1); ACC6(2); ACC6(3);
    const float *x0 = x, *x1 = x + (rows > 1 ? 1 : 0) * xs, *x2 = x + (rows > 2 ? 2 : rows - 1) * xs,
                *x3 = x + (rows > 3 ? 3 : rows - 1) * xs;
    int k = 0;
    for (; k + VW <= K; k += VW) {
        const vf v0 = vload(w + k), v1 = vload(w + K + k), v2 = vload(w + 2 * (int64_t)K + k),
                 v3 = vload(w + 3 * (int64_t)K + k), v4 = vload(w + 4 * (int64_t)K + k),
                 v5 = vload(w + 5 * (int64_t)K + k);
        vf u = vload(x0 + k);
        FMA6(0);
        u = vload(x1 + k);
        FMA6(1);
        u = vload(x2 + k);
        FMA6(2);
        u = vload(x3 + k);
        FMA6(3);
    }
    const vf acc[4][6] = {ROW6(0), ROW6(1), ROW6(2), ROW6(3)};
    const float *const xr[4] = {x0, x1, x2, x3};
    tile_sums(&acc[0][0], 6, xr, w, K, k, &out[0][0]);
}
#undef ACC6
#undef FMA6
#undef ROW6
#define TILE_4XN tile_4x6
#endif

/* y[m, n0 + j] = sum_k x[m, k] * wb[j, k] + (bias ? bias[n0 + j] : 0) for m < M, j < nb: one block of nb <= nbk output
 * features (nbk 4 below 4 rows, else TILE_N: 3, or 6 with AVX-512), its weight rows wb [nb, K] dense. The block's
 * tiles, in the order linear_small_m_rows documents; the blocks kernel runs the same tiles over a block it dequantized,
 * so both sum alike (one compiled copy for both, never inlined: two inlined copies may be vectorized differently under
 * -ffast-math). */
static __attribute__((noinline)) void block_rows(const float *x, int64_t x_stride, const float *wb,
                                                 const float *bias, float *y, int M, int N, int K, int n0, int nb) {
    if (nb == TILE_N && M >= 4) {
        for (int m0 = 0; m0 < M; m0 += 4) {
            const int rows = M - m0 < 4 ? M - m0 : 4;
            float out[4][TILE_N];
            TILE_4XN(x + m0 * x_stride, x_stride, rows, wb, K, out);
            for (int i = 0; i < rows; i++)
                for (int j = 0; j < TILE_N; j++)
                    y[(int64_t)(m0 + i) * N + n0 + j] = out[i][j] + (bias ? bias[n0 + j] : 0.0f);
        }
        return;
    }
    /* Fewer rows, or the last block's tail features: the general tile over at most NB features at a time. */
    for (int j0 = 0; j0 < nb; j0 += NB) {
        const int nj = nb - j0 < NB ? nb - j0 : NB;
        const float *wj = wb + (int64_t)j0 * K;
        for (int m0 = 0; m0 < M; m0 += MB) {
            const int mb = M - m0 < MB ? M - m0 : MB;
            const float *xm = x + m0 * x_stride;
            float out[MB][NB];
            if (nj == NB && mb == MB) dot_tile(xm, x_stride, wj, K, out, MB, NB);
            else if (nj == NB) dot_tile(xm, x_stride, wj, K, out, 1, NB);
            else if (mb == MB) dot_tile(xm, x_stride, wj, K, out, MB, nj);
            else dot_tile(xm, x_stride, wj, K, out, 1, nj);
            for (int i = 0; i < mb; i++)
                for (int j = 0; j < nj; j++)
                    y[(int64_t)(m0 + i) * N + n0 + j0 + j] = out[i][j] + (bias ? bias[n0 + j0 + j] : 0.0f);
        }
    }
}

/* y[m, n] = sum_k x[m, k] * w[n, k] + (bias ? bias[n] : 0) for m < M, n < N.
 * x: [M, K] fp32, rows x_stride apart (dense within a row); w: [N, K] fp32 dense; bias: [N] or NULL; y: [M, N]
 * dense. Threads split the output features: blocks of 4 for M < 4 (the 2 x 4 tile: 4 weight streams keep a 1-row
 * pass off the FMA latency; 3 streams were ~10% slower at M = 1), else blocks of 3 through the 4 x 3 tile (1.1-1.3x
 * the 2 x 4 tile at M = 16-32, 2-core AMD EPYC VM, AVX2; blocks of 6 through the 4 x 6 tile with AVX-512), the last
 * M % 4 rows as a tile of repeated rows; the last N % TILE_N features (one block) through the general tile. */
void linear_small_m_rows(const float *x, const float *w, const float *bias, float *y, int M, int N, int K,
                         int64_t x_stride) {
    const int nbk = block_features(M);
    const int blocks = (N + nbk - 1) / nbk;
    #pragma omp for schedule(static) nowait
    for (int b = 0; b < blocks; b++) {
        const int n0 = b * nbk, nb = N - n0 < nbk ? N - n0 : nbk;
        block_rows(x, x_stride, w + (int64_t)n0 * K, bias, y, M, N, K, n0, nb);
    }
}

/* linear_small_m_rows (above) as the calling thread's share of an enclosing OpenMP region's work (an orphaned
 * worksharing loop, no barrier at the end: cpu_decode_step.c), and linear_small_m as a region of its own. */
void linear_small_m(const float *x, const float *w, const float *bias, float *y, int M, int N, int K,
                    int64_t x_stride, int num_threads) {
    #pragma omp parallel num_threads(num_threads)
    linear_small_m_rows(x, w, bias, y, M, N, K, x_stride);
}


/* ---- fp32 rows against weights held as GGUF blocks (Q4_1, Q8_0), for a decode step's few rows ----
 *
 * Why: a model that comes as a GGUF (the packaged SmolLM2 is Q4_1 layers with a Q8_0 embedding) is served as its fp32
 * dequantization, so a batch-1 step reads 4 bytes a weight where the file held 5 or 8.5 bits. Each weight is exactly
 * what its block makes of it: Q4_1 d * q + m (q 0-15), Q8_0 d * q (q -128..127), d and m fp16, one block per 32
 * weights along K (engine.execution.packing.gguf_blocks recovers them from the fp32 tensor and checks that every
 * block reproduces it bit for bit). Read in that form, a step reads 6.4x (Q4_1) or 3.8x (Q8_0) fewer bytes of those
 * linears and computes with the very same fp32 weights: a lossless compression, not a quantization.
 *
 * Layout (`format`): PDSERVE_Q4_1: qs [N, K / 2] uint8, 16 bytes a block of 32 weights: byte 8h + j holds weight
 * 16h + j in its low nibble and weight 16h + 8 + j in its high one (h = 0, 1; j < 8), so 8 bytes zero-extended to 8
 * lanes give 16 weights with one mask and one shift (a broadcast and a variable shift for each 8 ran ~1.5x slower at
 * one row); scales [N, K / 32, 2] fp16, (d, m) of each block. PDSERVE_Q8_0: qs [N, K] int8 in order; scales
 * [N, K / 32] fp16, d of each block. K a multiple of 32.
 *
 * Form: each thread takes blocks of output features as the small-M kernel does (4 features below 4 rows, else 3).
 * From 2 rows it dequantizes a block into a buffer of fp32 rows, exactly, then runs the small-M kernel's tiles over
 * it (block_rows): the sums are the small-M kernel's on the fp32 tensor, bit for bit, and each weight is dequantized
 * once per call whatever M is. At 1 row (a batch-1 decode step, where the dequantization is the work) the weights stay
 * in registers and each block's scale is applied once (one_row_tile). */

/* Per weight row of the blocks of `format`: bytes of qs, fp16 scales. */
static inline int64_t blocks_row_bytes(int format, int K) { return format == PDSERVE_Q4_1 ? K / 2 : K; }
static inline int blocks_row_scales(int format, int K) { return format == PDSERVE_Q4_1 ? K / 16 : K / 32; }

/* In a one-row loop over the K / 32 blocks of NB rows starting at qs: prefetch the NB rows PF_ROWS ahead, spread over
 * the loop (their 4 * row_bytes bytes are K / 32 cache lines for Q4_1, one a block, and K / 16 for Q8_0, two). */
static inline void prefetch_rows_ahead(const uint8_t *qs, int64_t row_bytes, int b, int format) {
    const uint8_t *ahead = qs + PF_ROWS * row_bytes;
    if (format == PDSERVE_Q4_1) {
        __builtin_prefetch(ahead + 64 * b);
    } else {
        __builtin_prefetch(ahead + 128 * b);
        __builtin_prefetch(ahead + 128 * b + 64);
    }
}

/* fp16 bits -> fp32 for n values, exact (every fp16 value is an fp32 one): F16C's conversion where the build has it,
 * else the bits rearranged (normal and subnormal values; infinities and NaN kept). */
static inline void f16_to_f32(const uint16_t *h, float *out, int n) {
    int i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) {
        const uint32_t sign = (uint32_t)(h[i] & 0x8000u) << 16, exp = (h[i] >> 10) & 0x1fu, man = h[i] & 0x3ffu;
        uint32_t bits;
        if (exp == 0) {  /* zero or subnormal: man * 2^-24, exact in fp32 */
            const float f = (float)man * 0x1p-24f;
            memcpy(&bits, &f, sizeof bits);
            bits |= sign;
        } else {
            bits = sign | (exp == 31 ? 0x7f800000u : (exp + 112) << 23) | (man << 13);
        }
        memcpy(out + i, &bits, sizeof bits);
    }
}

typedef uint8_t vq8 __attribute__((vector_size(8), aligned(1), may_alias));  /* unaligned */
typedef int8_t vq8s __attribute__((vector_size(8), aligned(1), may_alias));
typedef int32_t vqi __attribute__((vector_size(8 * sizeof(int32_t))));
typedef float vq_f __attribute__((vector_size(8 * sizeof(float)), aligned(4), may_alias));

/* 8 bytes at p widened to 8 int32 lanes, zero- or sign-extended: one vpmovzxbd / vpmovsxbd (GCC 12 turns the generic
 * conversion into 8 byte loads). Macros, not functions: a function returning a 32-byte vector draws GCC's ABI
 * warning in the builds without AVX. */
#if defined(__AVX2__)
#define WIDEN_U8(p) ((vqi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define WIDEN_S8(p) ((vqi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#else
#define WIDEN_U8(p) __builtin_convertvector(*(const vq8 *)(p), vqi)
#define WIDEN_S8(p) __builtin_convertvector(*(const vq8s *)(p), vqi)
#endif

/* out[k] = weight k of one row, for k < K, exact: Q4_1 d * q + m (d * q is exact in fp32, an 11-bit mantissa times a
 * 4-bit integer, and the sum one rounding, as the fp32 tensor's own dequantization did), Q8_0 d * q (exact: 11 x 8
 * bits). sf: K / 16 floats of scratch for the row's scales. */
static inline void dequant_row(const void *qs, const uint16_t *scales, int format, float *out, int K, float *sf) {
    if (format == PDSERVE_Q4_1) {
        const uint8_t *q = qs;
        f16_to_f32(scales, sf, K / 16);
        for (int b = 0; b < K / 32; b++) {
            __builtin_prefetch(q + PF_ROWS * (int64_t)K / 2 + 16 * b);  /* rows ahead: see PF_ROWS */
            const float d = sf[2 * b], m = sf[2 * b + 1];
            for (int h = 0; h < 2; h++) {
                const vqi v = WIDEN_U8(q + 16 * b + 8 * h);
                *(vq_f *)(out + 32 * b + 16 * h) = __builtin_convertvector(v & 15, vq_f) * d + m;  /* unaligned */
                *(vq_f *)(out + 32 * b + 16 * h + 8) = __builtin_convertvector(v >> 4, vq_f) * d + m;
            }
        }
    } else {
        const int8_t *q = qs;
        f16_to_f32(scales, sf, K / 32);
        for (int b = 0; b < K / 32; b++) {
            __builtin_prefetch(q + PF_ROWS * (int64_t)K + 32 * b);
            for (int g = 0; g < 4; g++)
                *(vq_f *)(out + 32 * b + 8 * g) = __builtin_convertvector(WIDEN_S8(q + 32 * b + 8 * g), vq_f) * sf[b];
        }
    }
}

static inline float hsum8(vq_f v) {
    float s = 0.0f;
    for (int i = 0; i < 8; i++) s += v[i];
    return s;
}

/* One row of x against nb (1-4) weight rows of the blocks, the weights dequantized in registers and never stored,
 * each block's scale applied once to the block's partial dot product and Q4_1's minimum through the block's sum of x
 * (a short pass of its own after the main loop):
 *     y_n = sum_b d_nb * (sum_{k in b} x_k q_nk) + sum_b m_nb * xsum_b.
 * The same fp32 products, summed in another order than the small-M kernel's over the dequantized tensor (the last
 * bits differ, as torch's GEMM's do). At one row the dequantization is the step's work (each weight is read once):
 * per 32 weights 2 loads, 2 masks/shifts, 4 conversions and 5 multiply-adds here against 13 vector ops with a store
 * and a reload of every weight through the buffer. format and nb are constants at each call (always inlined): the
 * loop has no branch and its accumulators stay in registers. qs: the first of the nb rows (rows row_bytes apart); sf:
 * their scales in fp32 (rows row_sf apart: d, or d and m, per block); xsum [K / 32]: x's sum over each block (Q4_1
 * only). */
static inline __attribute__((always_inline)) void one_row_tile(const float *x, const float *xsum, const uint8_t *qs,
                                                                int64_t row_bytes, const float *sf, int row_sf, int K,
                                                                float out[NB], const int format, const int nb) {
    vq_f tot[NB];
    for (int j = 0; j < nb; j++) tot[j] = (vq_f){0};
    for (int b = 0; b < K / 32; b++) {
        prefetch_rows_ahead(qs, row_bytes, b, format);
        const vq_f x0 = *(const vq_f *)(x + 32 * b), x1 = *(const vq_f *)(x + 32 * b + 8);
        const vq_f x2 = *(const vq_f *)(x + 32 * b + 16), x3 = *(const vq_f *)(x + 32 * b + 24);
        for (int j = 0; j < nb; j++) {
            const uint8_t *q = qs + j * row_bytes;
            vq_f lo, hi;  /* two independent FMA chains a block */
            if (format == PDSERVE_Q4_1) {  /* byte 8h + i: weights 16h + i (low nibble), 16h + 8 + i (high) */
                const vqi v0 = WIDEN_U8(q + 16 * b), v1 = WIDEN_U8(q + 16 * b + 8);
                lo = __builtin_convertvector(v0 & 15, vq_f) * x0 + __builtin_convertvector(v0 >> 4, vq_f) * x1;
                hi = __builtin_convertvector(v1 & 15, vq_f) * x2 + __builtin_convertvector(v1 >> 4, vq_f) * x3;
                tot[j] += (lo + hi) * sf[j * row_sf + 2 * b];
            } else {
                const int8_t *s = (const int8_t *)q + 32 * b;
                lo = __builtin_convertvector(WIDEN_S8(s), vq_f) * x0 +
                     __builtin_convertvector(WIDEN_S8(s + 8), vq_f) * x1;
                hi = __builtin_convertvector(WIDEN_S8(s + 16), vq_f) * x2 +
                     __builtin_convertvector(WIDEN_S8(s + 24), vq_f) * x3;
                tot[j] += (lo + hi) * sf[j * row_sf + b];
            }
        }
    }
    for (int j = 0; j < nb; j++) {
        float mins = 0.0f;
        if (format == PDSERVE_Q4_1)
            for (int b = 0; b < K / 32; b++) mins += sf[j * row_sf + 2 * b + 1] * xsum[b];
        out[j] = hsum8(tot[j]) + mins;
    }
}

/* ---- the same blocks against one row quantized to 8 bits a block (PDSERVE_Q8_ACTIVATIONS): llama.cpp's arithmetic
 *
 * Why: at one row the exact kernel above spends about 17 vector instructions on 32 weights (each widened, converted
 * and multiplied in fp32); llama.cpp quantizes the row instead (Q8_1 for Q4_1 weights, Q8_0 for Q8_0: per block of
 * 32, d = max |x| / 127, q = round(x / d)) and takes integer dot products, 32 weights in one VPMADDUBSW, about 10
 * instructions a block (ggml-cpu's ggml_vec_dot_q4_1_q8_1 / _q8_0_q8_0). Both reading ahead, 2 AMD EPYC Zen 3 cores,
 * SmolLM2-135M's layer linears at one row: 3.8 ms here against 4.9 exact; its Q8_0 LM head 0.85 against 1.0.
 * This is that arithmetic, with two differences that only remove error: the row's scales stay fp32 (llama.cpp rounds
 * them to fp16) and Q4_1's minimum multiplies the exact fp32 sum of x over the block (llama.cpp's d * sum(q)). Lossy
 * in the activations (a relative error of about 2^-8 per block of x; +1.2-1.7% perplexity on the packaged model,
 * bench/quality.py), so it is opt-in: --quantization gguf.
 *
 * qx: K int8, x quantized; for Q4_1 each block's 32 in the order that pairs them with the nibbles as
 * _mm256_set_m128i(bytes >> 4, bytes) & 15 lays them out (the low nibbles of bytes 0-15 are weights 0-7 and 16-23,
 * the high ones 8-15 and 24-31: blocks_q8_row's permutation); dx [K / 32]: the row's scales. */

/* x [K] fp32 -> qx [K] int8 and dx [K / 32] as described above; perm: Q4_1's order within each block. */
static void blocks_q8_row(const float *x, int K, int perm, int8_t *qx, float *dx) {
    for (int b = 0; b < K / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        dx[b] = d;
        for (int i = 0; i < 32; i++) {
            /* weight i's place: 0-7 stay, 8-15 go to 16-23, 16-23 to 8-15, 24-31 stay */
            const int at = perm && (i & 8) != (i & 16) / 2 ? i ^ 24 : i;
            qx[32 * b + at] = (int8_t)lrintf(xb[i] * id);
        }
    }
}

/* out[j] = sum_b d_jb * dx_b * (sum_{k in b} q_jk qx_k) (+ sum_b m_jb * xsum_b for Q4_1) for j < nb weight rows of the
 * blocks (rows row_bytes apart; sf their fp32 scales, rows row_sf apart, as one_row_tile takes them). format and nb
 * are constants at each call (always inlined). Integer sums are exact (at most 32 * 128 * 127 in magnitude); the
 * per-block products are summed in fp32. */
static inline __attribute__((always_inline)) void one_row_q8_tile(const int8_t *qx, const float *dx, const float *xsum,
                                                                   const uint8_t *qs, int64_t row_bytes,
                                                                   const float *sf, int row_sf, int K,
                                                                   float out[NB], const int format, const int nb) {
    const int q41 = format == PDSERVE_Q4_1;
#if defined(__AVX2__)
    __m256 acc[NB];
    for (int j = 0; j < nb; j++) acc[j] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int b = 0; b < K / 32; b++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(qx + 32 * b));
        prefetch_rows_ahead(qs, row_bytes, b, format);
        for (int j = 0; j < nb; j++) {
            const uint8_t *q = qs + j * row_bytes;
            __m256i pairs;
            if (q41) {
                const __m128i raw = _mm_loadu_si128((const __m128i *)(q + 16 * b));
                const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4);
                pairs = _mm256_maddubs_epi16(w, xv);
            } else {  /* signed x signed through VPMADDUBSW's unsigned operand: |w| and x with w's sign */
                const __m256i w = _mm256_loadu_si256((const __m256i *)(q + 32 * b));
                pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w));
            }
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
            acc[j] = _mm256_fmadd_ps(dot, _mm256_set1_ps(sf[j * row_sf + (q41 ? 2 * b : b)] * dx[b]), acc[j]);
        }
    }
    for (int j = 0; j < nb; j++) {
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[j]), _mm256_extractf128_ps(acc[j], 1));
        const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
        out[j] = _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
    }
#else
    for (int j = 0; j < nb; j++) {
        const uint8_t *q = qs + j * row_bytes;
        float tot = 0.0f;
        for (int b = 0; b < K / 32; b++) {
            int32_t dot = 0;
            if (q41)
                for (int i = 0; i < 16; i++)
                    dot += (q[16 * b + i] & 15) * qx[32 * b + i] + (q[16 * b + i] >> 4) * qx[32 * b + 16 + i];
            else
                for (int i = 0; i < 32; i++) dot += (int8_t)q[32 * b + i] * qx[32 * b + i];
            tot += (float)dot * (sf[j * row_sf + (q41 ? 2 * b : b)] * dx[b]);
        }
        out[j] = tot;
    }
#endif
    if (q41)
        for (int j = 0; j < nb; j++) {
            float mins = 0.0f;
            for (int b = 0; b < K / 32; b++) mins += sf[j * row_sf + 2 * b + 1] * xsum[b];
            out[j] += mins;
        }
}

/* ---- AVX2: from PANEL_MIN_ROWS rows, a block of 16 dequantized features as a panel
 *
 * Why: with AVX2's 16 registers the dot-product tiles above hold 4 x 3 outputs, 12 FMAs per 7 vector loads, and end
 * each output with a horizontal sum; at a decode step of 16-64 rows on 2 AMD EPYC Zen 3 cores they ran the fp32
 * linears at ~58% of the FMA units' peak. A panel holds 16 features transposed (panel[16 k + j] = W[n0 + j, k]), so
 * a tile of 6 rows x 16 features is 12 accumulators fed by 2 panel loads and 6 broadcasts of x per k (the BLIS / oneDNN
 * microkernel shape): one thread, one 1536 x 576 weight, 64 rows 87 against 67 GFLOP/s for the 4 x 3 tile (16 rows 63
 * against 46; weights streamed 67 against 50). The block is dequantized once a call, as before, then transposed in
 * 8 x 8 blocks into the panel. SmolLM2-135M's Q4_1 layer linears, 2 threads, two interleaved runs against the tiles:
 * 24 rows 41 against 43-56 ms, 48 rows 68-71 against 96-111, 64 rows 90-93 against 111-132; its Q8_0 LM head at 64
 * rows 24-25 against 26-31 ms.
 *
 * Prefill chunks take the panels too (engine.execution.packing: AttentionOps.blocks_prefill): at a short prompt's rows
 * torch's fp32 GEMM repacks its weight on every call. Every layer linear of SmolLM2-135M, 2 threads, M = 100 / 1,000:
 * 167 / 183 against torch's 136-141 / 170-175 GFLOP/s. Past PANEL_CHUNK_ROWS rows a call runs the rows in chunks of
 * it (each block dequantized and transposed again for each chunk, where the chunk's x stays in cache): at 4,096 rows
 * without chunks 145 against torch's 161, with chunks of 256 157 / 155 (96: 140 / 148; 512: 151 / 141, a slower phase).
 *
 * Numerics: each output is its terms summed in order of k, one FMA a term, then the bias added: the same bits
 * whatever the rows' count, their place in a tile or the threads (the dot-product tiles' per-lane sums differ from
 * these in the last bits, as torch's GEMM's do). */
#if defined(__AVX2__) && !defined(__AVX512F__)
#define PANELS 1
#define PANEL 16
#define PANEL_CHUNK_ROWS 256  /* most rows a pass over the blocks takes (above) */
#define PANEL_MIN_ROWS 24  /* at 16 rows the transpose's share made it level (two runs: 1.16x and 0.85x) */

static inline int blocks_features(int M) { return M >= PANEL_MIN_ROWS ? PANEL : block_features(M); }

/* rows [16, K] (row j at j * K) -> panel [K, 16], panel[16 k + j] = rows[j * K + k]; K a multiple of 8. */
static void to_panel(const float *rows, int K, float *panel) {
    for (int g = 0; g < 2; g++)
        for (int k = 0; k < K; k += 8) {
            const float *s = rows + 8 * g * (int64_t)K + k;
            const __m256 r0 = _mm256_loadu_ps(s), r1 = _mm256_loadu_ps(s + K), r2 = _mm256_loadu_ps(s + 2 * K),
                         r3 = _mm256_loadu_ps(s + 3 * K), r4 = _mm256_loadu_ps(s + 4 * K),
                         r5 = _mm256_loadu_ps(s + 5 * K), r6 = _mm256_loadu_ps(s + 6 * K),
                         r7 = _mm256_loadu_ps(s + 7 * K);
            const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1),
                         t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3),
                         t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
                         t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
            const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee),
                         u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee),
                         u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee),
                         u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
            float *d = panel + 16 * (int64_t)k + 8 * g;
            _mm256_storeu_ps(d, _mm256_permute2f128_ps(u0, u4, 0x20));
            _mm256_storeu_ps(d + 16, _mm256_permute2f128_ps(u1, u5, 0x20));
            _mm256_storeu_ps(d + 32, _mm256_permute2f128_ps(u2, u6, 0x20));
            _mm256_storeu_ps(d + 48, _mm256_permute2f128_ps(u3, u7, 0x20));
            _mm256_storeu_ps(d + 64, _mm256_permute2f128_ps(u0, u4, 0x31));
            _mm256_storeu_ps(d + 80, _mm256_permute2f128_ps(u1, u5, 0x31));
            _mm256_storeu_ps(d + 96, _mm256_permute2f128_ps(u2, u6, 0x31));
            _mm256_storeu_ps(d + 112, _mm256_permute2f128_ps(u3, u7, 0x31));
        }
}

/* out[i][j] = sum_k x_i[k] * panel[16 k + j] in order of k, for i < 6 x rows xs apart; with fewer rows the last
 * repeats (computed, not stored by the caller). Named accumulators: as an array GCC stored them to the stack every
 * iteration (tile_4x3 says the same). */
static inline void panel_tile(const float *x, int64_t xs, int rows, const float *panel, int K, float out[6][16]) {
    const float *x0 = x, *x1 = x + (rows > 1 ? 1 : 0) * xs, *x2 = x + (rows > 2 ? 2 : rows - 1) * xs,
                *x3 = x + (rows > 3 ? 3 : rows - 1) * xs, *x4 = x + (rows > 4 ? 4 : rows - 1) * xs,
                *x5 = x + (rows > 5 ? 5 : rows - 1) * xs;
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int k = 0; k < K; k++) {
        const __m256 b0 = _mm256_loadu_ps(panel + 16 * (int64_t)k), b1 = _mm256_loadu_ps(panel + 16 * (int64_t)k + 8);
        __m256 a = _mm256_broadcast_ss(x0 + k);
        c00 = _mm256_fmadd_ps(a, b0, c00); c01 = _mm256_fmadd_ps(a, b1, c01);
        a = _mm256_broadcast_ss(x1 + k);
        c10 = _mm256_fmadd_ps(a, b0, c10); c11 = _mm256_fmadd_ps(a, b1, c11);
        a = _mm256_broadcast_ss(x2 + k);
        c20 = _mm256_fmadd_ps(a, b0, c20); c21 = _mm256_fmadd_ps(a, b1, c21);
        a = _mm256_broadcast_ss(x3 + k);
        c30 = _mm256_fmadd_ps(a, b0, c30); c31 = _mm256_fmadd_ps(a, b1, c31);
        a = _mm256_broadcast_ss(x4 + k);
        c40 = _mm256_fmadd_ps(a, b0, c40); c41 = _mm256_fmadd_ps(a, b1, c41);
        a = _mm256_broadcast_ss(x5 + k);
        c50 = _mm256_fmadd_ps(a, b0, c50); c51 = _mm256_fmadd_ps(a, b1, c51);
    }
    _mm256_storeu_ps(out[0], c00); _mm256_storeu_ps(out[0] + 8, c01);
    _mm256_storeu_ps(out[1], c10); _mm256_storeu_ps(out[1] + 8, c11);
    _mm256_storeu_ps(out[2], c20); _mm256_storeu_ps(out[2] + 8, c21);
    _mm256_storeu_ps(out[3], c30); _mm256_storeu_ps(out[3] + 8, c31);
    _mm256_storeu_ps(out[4], c40); _mm256_storeu_ps(out[4] + 8, c41);
    _mm256_storeu_ps(out[5], c50); _mm256_storeu_ps(out[5] + 8, c51);
}

/* y[m, n0 + j] for m < M, j < nb <= 16: the block's dequantized rows [16, K] at rows (those from nb on zeroed here),
 * through a panel at panel [K * 16]. */
static void panel_block(const float *x, int64_t x_stride, float *rows, float *panel, const float *bias, float *y,
                        int M, int N, int K, int n0, int nb) {
    if (nb < PANEL) memset(rows + (int64_t)nb * K, 0, (size_t)(PANEL - nb) * K * sizeof(float));
    to_panel(rows, K, panel);
    for (int m0 = 0; m0 < M; m0 += 6) {
        const int mr = M - m0 < 6 ? M - m0 : 6;
        float out[6][16];
        panel_tile(x + m0 * x_stride, x_stride, mr, panel, K, out);
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nb; j++)
                y[(int64_t)(m0 + i) * N + n0 + j] = out[i][j] + (bias ? bias[n0 + j] : 0.0f);
    }
}
#else
static inline int blocks_features(int M) { return block_features(M); }
#endif

/* y[m, n] = sum_k x[m, k] * W[n, k] + (bias ? bias[n] : 0), W the blocks qs / scales of `format` above; x: [M, K]
 * fp32, rows x_stride apart; bias [N] fp32 or NULL; y [M, N] fp32 dense; buf: the calling thread's own
 * BLOCKS_BUF_FLOATS(K) floats. The calling thread's share of the features, as linear_small_m_rows (an orphaned
 * worksharing loop, no barrier at the end). From 2 rows the same sums as that kernel over the dequantized tensor,
 * bit for bit (each weight dequantized once into the buffer serves every row), except in the AVX2 build from
 * PANEL_MIN_ROWS rows (blocks of 16 features through panels: panel_block); at 1 row one_row_tile's, or with
 * PDSERVE_Q8_ACTIVATIONS or'ed into format one_row_q8_tile's (x quantized once by each thread into its buffer). */
void linear_blocks_rows(const float *x, int64_t x_stride, const void *qs, const uint16_t *scales, int format,
                        const float *bias, float *y, int M, int N, int K, float *buf) {
#if defined(PANELS)
    /* More rows in equal chunks of at most PANEL_CHUNK_ROWS (each past PANEL_MIN_ROWS, so every row takes the panels),
     * each chunk an orphaned loop of its own (disjoint rows of y, no barrier). */
    if (M > PANEL_CHUNK_ROWS) {
        const int chunks = (M + PANEL_CHUNK_ROWS - 1) / PANEL_CHUNK_ROWS, rows = (M + chunks - 1) / chunks;
        for (int m0 = 0; m0 < M; m0 += rows)
            linear_blocks_rows(x + m0 * x_stride, x_stride, qs, scales, format, bias, y + (int64_t)m0 * N,
                               M - m0 < rows ? M - m0 : rows, N, K, buf);
        return;
    }
#endif
    const int q8 = M == 1 && (format & PDSERVE_Q8_ACTIVATIONS);
    format &= PDSERVE_BLOCKS_FORMAT;
    const int nbk = blocks_features(M);
    const int blocks = (N + nbk - 1) / nbk;
    const int64_t row_bytes = blocks_row_bytes(format, K);
    const int row_scales = blocks_row_scales(format, K);
    float *xsum = buf + NB * (int64_t)row_scales;  /* M = 1: after the block's scales */
    if (M == 1 && format == PDSERVE_Q4_1)
        for (int b = 0; b < K / 32; b++) {
            float s = 0.0f;
            for (int i = 0; i < 32; i++) s += x[32 * b + i];
            xsum[b] = s;
        }
    /* M = 1 with Q8 activations: the row's scales and its quantized values after xsum (K / 32 + K / 4 floats) */
    float *dx = xsum + K / 32;
    int8_t *qx = (int8_t *)(dx + K / 32);
    if (q8) blocks_q8_row(x, K, format == PDSERVE_Q4_1, qx, dx);
    #pragma omp for schedule(static) nowait
    for (int b = 0; b < blocks; b++) {
        const int n0 = b * nbk, nb = N - n0 < nbk ? N - n0 : nbk;
        const uint8_t *q = (const uint8_t *)qs + n0 * row_bytes;
        if (M == 1) {
            f16_to_f32(scales + (int64_t)n0 * row_scales, buf, nb * row_scales);
            float out[NB];
#define ONE_ROW(FORMAT) switch (nb) {                                                              \
                case 1: one_row_tile(x, xsum, q, row_bytes, buf, row_scales, K, out, FORMAT, 1); break;     \
                case 2: one_row_tile(x, xsum, q, row_bytes, buf, row_scales, K, out, FORMAT, 2); break;     \
                case 3: one_row_tile(x, xsum, q, row_bytes, buf, row_scales, K, out, FORMAT, 3); break;     \
                default: one_row_tile(x, xsum, q, row_bytes, buf, row_scales, K, out, FORMAT, 4); break;    \
            }
#define ONE_ROW_Q8(FORMAT) switch (nb) {                                                                     \
                case 1: one_row_q8_tile(qx, dx, xsum, q, row_bytes, buf, row_scales, K, out, FORMAT, 1); break;     \
                case 2: one_row_q8_tile(qx, dx, xsum, q, row_bytes, buf, row_scales, K, out, FORMAT, 2); break;     \
                case 3: one_row_q8_tile(qx, dx, xsum, q, row_bytes, buf, row_scales, K, out, FORMAT, 3); break;     \
                default: one_row_q8_tile(qx, dx, xsum, q, row_bytes, buf, row_scales, K, out, FORMAT, 4); break;    \
            }
            if (q8 && format == PDSERVE_Q4_1) ONE_ROW_Q8(PDSERVE_Q4_1)
            else if (q8) ONE_ROW_Q8(PDSERVE_Q8_0)
            else if (format == PDSERVE_Q4_1) ONE_ROW(PDSERVE_Q4_1)
            else ONE_ROW(PDSERVE_Q8_0)
#undef ONE_ROW
#undef ONE_ROW_Q8
            for (int j = 0; j < nb; j++) y[n0 + j] = out[j] + (bias ? bias[n0 + j] : 0.0f);
            continue;
        }
        for (int j = 0; j < nb; j++)
            dequant_row(q + j * row_bytes, scales + (int64_t)(n0 + j) * row_scales, format, buf + j * K, K,
                        buf + 2 * BLOCK_ROWS_MAX * (int64_t)K);
#if defined(PANELS)
        if (nbk == PANEL) {
            panel_block(x, x_stride, buf, buf + BLOCK_ROWS_MAX * (int64_t)K, bias, y, M, N, K, n0, nb);
            continue;
        }
#endif
        block_rows(x, x_stride, buf, bias, y, M, N, K, n0, nb);
    }
}

/* Prefetch the first PF_ROWS weight rows (and their scales) of the calling thread's share of a linear_blocks_rows call
 * of these arguments, as its static schedule assigns the features (libgomp's: the first n % threads threads take one
 * block more). A hint only: run before the barrier that precedes the call (cpu_decode_step.c), the loads that start
 * each thread's share overlap the small ops between the linears instead of waiting. */
void linear_blocks_warm(const void *qs, const uint16_t *scales, int format, int M, int N, int K) {
    format &= PDSERVE_BLOCKS_FORMAT;
    const int nbk = blocks_features(M), blocks = (N + nbk - 1) / nbk;
    const int threads = omp_get_num_threads(), tid = omp_get_thread_num();
    const int q = blocks / threads, extra = blocks % threads;
    const int first = tid * q + (tid < extra ? tid : extra), n0 = first * nbk;
    if (n0 >= N) return;
    const int rows = N - n0 < PF_ROWS ? N - n0 : PF_ROWS;
    const int64_t row_bytes = blocks_row_bytes(format, K), row_scales = blocks_row_scales(format, K);
    const char *w = (const char *)qs + n0 * row_bytes, *s = (const char *)(scales + n0 * row_scales);
    for (int64_t off = 0; off < rows * row_bytes; off += 64) __builtin_prefetch(w + off);
    for (int64_t off = 0; off < rows * row_scales * 2; off += 64) __builtin_prefetch(s + off);
}

/* linear_blocks_rows in a parallel region of its own, num_threads threads. Returns 0, or -1 with nothing written
 * when the threads' buffers could not be allocated. */
int linear_blocks(const float *x, int64_t x_stride, const void *qs, const uint16_t *scales, int format,
                  const float *bias, float *y, int M, int N, int K, int num_threads) {
    float *bufs = blocks_buffers(K, num_threads);
    if (bufs == NULL) return -1;
    #pragma omp parallel num_threads(num_threads)
    linear_blocks_rows(x, x_stride, qs, scales, format, bias, y, M, N, K,
                       bufs + (size_t)omp_get_thread_num() * BLOCKS_BUF_FLOATS(K));
    free(bufs);
    return 0;
}

/* One buffer of BLOCKS_BUF_FLOATS(max_k) floats for each of num_threads threads, thread t's at
 * t * BLOCKS_BUF_FLOATS(max_k), 64-byte aligned; NULL when out of memory. Freed with free(). */
float *blocks_buffers(int max_k, int num_threads) {
    const size_t bytes = (size_t)num_threads * BLOCKS_BUF_FLOATS(max_k) * sizeof(float);
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}


/* ---- bf16 weights in oneDNN's packed linear layout, for a decode step's few rows ----
 *
 * Why: a decode step at batch 1 calls ~120 linears (4 a layer and the LM head); through oneDNN each is a parallel
 * region of its own, and on 2 AMD EPYC cores the regions' start and end cost ~12 us a call (every bf16 linear of
 * SmolLM2-135M, distinct weights from DRAM: 6.0-6.7 ms as separate calls, 4.6-5.2 ms as worksharing loops inside one
 * region, same bytes). This kernel is written to run inside a region that the caller holds open over the whole step
 * (cpu_decode_step.c); `linear_packed_bf16` below is the same kernel in a region of its own.
 *
 * Layout: the weight tensor oneDNN makes of a bf16 nn.Linear weight [N, K] (torch.ops.mkldnn._reorder_linear_weight,
 * engine.execution.packing.PackedLinear) on the CPUs it was read on (AMD EPYC with AVX512_BF16, torch 2.13's oneDNN):
 * blocks of 64 output features, N padded with zeros to whole blocks; within a block the K pairs in order, each pair
 * [64 features][2 consecutive k], K padded to Kp; block b starts at element b * 64 * Kp. So feature n's weights
 * k, k+1 sit at (n / 64) * 64 * Kp + (k / 2) * 128 + (n % 64) * 2 + k % 2. This is VDPBF16PS's own operand shape:
 * one 64-byte load holds 16 features' pair, one instruction adds 16 features' two products, and no horizontal sums
 * are needed. The layout is oneDNN's choice, not a contract: PackedLinear checks this kernel against torch's linear
 * on each weight it packs and keeps oneDNN where they differ.
 *
 * Numerics: fp32 accumulation of exact bf16 products (VDPBF16PS, or widened fp32 products in the other builds), the
 * bias added in fp32, one rounding to bf16 (nearest even), as oneDNN's bf16 linear; the sum's order is this kernel's
 * (each output is summed by one thread in K order, whatever the thread count: results do not depend on it). */
#define PK_BLOCK 64  /* output features per packed block */
#define PK_VEC 16    /* features per 64-byte column of a block (one AVX-512 vector) */
#define PK_ROWS 4    /* x rows per pass over a block */

#if defined(__AVX512BF16__)
/* out[r][16 v + i] = sum over k pairs of x row r . column v's pair, for r < mr, v < nv (constants at each call:
 * always inlined, so the accumulators stay in registers: 16 + 4 weight vectors + 1 x pair of the 32 zmm). w points at
 * the first column's first pair; pairs are PK_BLOCK * 2 elements apart. */
static inline __attribute__((always_inline)) void packed_tile(const uint16_t *x, int64_t xs, const uint16_t *w,
                                                               int pairs, const int mr, const int nv,
                                                               float out[PK_ROWS][PK_BLOCK]) {
    __m512 acc[PK_ROWS][4];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = _mm512_setzero_ps();
    for (int p = 0; p < pairs; p++) {
        const uint16_t *wp = w + (int64_t)p * (2 * PK_BLOCK);
        __m512bh wv[4];
        for (int v = 0; v < nv; v++) wv[v] = (__m512bh)_mm512_loadu_si512(wp + 2 * PK_VEC * v);
        for (int r = 0; r < mr; r++) {
            uint32_t pair;
            memcpy(&pair, x + r * xs + 2 * p, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int v = 0; v < nv; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], wv[v], xv);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(out[r] + PK_VEC * v, acc[r][v]);
}
#else
/* The same contract in plain loops over the 16 features of a column, which the compiler vectorizes at the build's
 * width (bf16 widened exactly, fp32 FMAs). */
static inline __attribute__((always_inline)) void packed_tile(const uint16_t *x, int64_t xs, const uint16_t *w,
                                                               int pairs, const int mr, const int nv,
                                                               float out[PK_ROWS][PK_BLOCK]) {
    for (int r = 0; r < mr; r++)
        for (int i = 0; i < nv * PK_VEC; i++) out[r][i] = 0.0f;
    for (int p = 0; p < pairs; p++) {
        const uint16_t *wp = w + (int64_t)p * (2 * PK_BLOCK);
        for (int r = 0; r < mr; r++) {
            const float x0 = bf16_to_f32(x[r * xs + 2 * p]), x1 = bf16_to_f32(x[r * xs + 2 * p + 1]);
            for (int i = 0; i < nv * PK_VEC; i++)
                out[r][i] += x0 * bf16_to_f32(wp[2 * i]) + x1 * bf16_to_f32(wp[2 * i + 1]);
        }
    }
}
#endif

/* y[m, n] = round_bf16(sum_k x[m, k] * w[n, k] + bias[n]) for m < M, n < N, the calling thread's share of the
 * features: an orphaned worksharing loop, run by every thread of the enclosing OpenMP region (or alone outside
 * one), with no barrier at the end. x: [M, K] bf16, rows x_stride apart; w: the packed layout above with K padded to
 * padded_k (K even, padded_k >= K, padded_k even); bias: [N] bf16 or NULL; y: [M, N] bf16 dense. The features are
 * split in 16-feature columns, evenly over the threads (a 576-feature layer is 9 blocks: whole blocks would leave
 * one of 2 threads a ninth more to read). */
void linear_packed_bf16_rows(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,
                             uint16_t *y, int M, int N, int K, int padded_k) {
    const int columns = (N + PK_VEC - 1) / PK_VEC, per_block = PK_BLOCK / PK_VEC;
    const int threads = omp_get_num_threads(), tid = omp_get_thread_num();
    const int c0 = (int)((int64_t)columns * tid / threads), c1 = (int)((int64_t)columns * (tid + 1) / threads);
    for (int c = c0; c < c1;) {
        const int block = c / per_block, first = c % per_block;
        const int nv = per_block - first < c1 - c ? per_block - first : c1 - c;
        const uint16_t *wb = w + (int64_t)block * PK_BLOCK * padded_k + first * 2 * PK_VEC;
        const int n0 = block * PK_BLOCK + first * PK_VEC;
        for (int m0 = 0; m0 < M; m0 += PK_ROWS) {
            const int mr = M - m0 < PK_ROWS ? M - m0 : PK_ROWS;
            const uint16_t *xm = x + (int64_t)m0 * x_stride;
            float out[PK_ROWS][PK_BLOCK];
#define PK_TILE(MR) switch (nv) {                                                   \
                case 1: packed_tile(xm, x_stride, wb, K / 2, MR, 1, out); break;     \
                case 2: packed_tile(xm, x_stride, wb, K / 2, MR, 2, out); break;     \
                case 3: packed_tile(xm, x_stride, wb, K / 2, MR, 3, out); break;     \
                default: packed_tile(xm, x_stride, wb, K / 2, MR, 4, out); break;    \
            }
            switch (mr) {
                case 1: PK_TILE(1); break;
                case 2: PK_TILE(2); break;
                case 3: PK_TILE(3); break;
                default: PK_TILE(4); break;
            }
#undef PK_TILE
            for (int r = 0; r < mr; r++) {
                uint16_t *yr = y + (int64_t)(m0 + r) * N;
                for (int i = 0; i < nv * PK_VEC && n0 + i < N; i++)
                    yr[n0 + i] = f32_to_bf16(out[r][i] + (bias ? bf16_to_f32(bias[n0 + i]) : 0.0f));
            }
        }
        c += nv;
    }
}

/* linear_packed_bf16_rows in a parallel region of its own, num_threads threads. */
void linear_packed_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                        int M, int N, int K, int padded_k, int num_threads) {
    #pragma omp parallel num_threads(num_threads)
    linear_packed_bf16_rows(x, x_stride, w, bias, y, M, N, K, padded_k);
}
