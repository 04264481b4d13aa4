/* y = x W^T (+ b) with W in 7-bit integers and x quantized to 8 bits per block of 64 on the fly: the int8 GEMM of
 * `--quantization w8a8_int8`'s decoder linears, prefill chunks and decode steps (engine/execution/packing.py; in the
 * one-region decode step, cpu_decode_step.c, through linear_w8a8_for).
 *
 * Why: an fp32 prefill chunk's linears run at the FMA units' peak on a CPU without bf16 or int8 dot products (AVX2:
 * 2 x 8 fp32 multiply-adds a cycle a core; ~170 GFLOP/s on 2 cores of an AMD EPYC Zen 3, near all of it), so fewer
 * bytes cannot help and only cheaper arithmetic can. AVX2's VPMADDUBSW multiplies 32 unsigned 8-bit by 32 signed 8-bit
 * values and adds adjacent pairs into 16 int16 lanes, VPMADDWD against ones widens them to 8 int32 sums: 32 products
 * in two instructions where fp32 takes four FMAs. One thread, 60 x 1536 x 576, this tile structure: 124 against 77
 * GOPS for the same tiles in fp32 FMAs; every decoder linear of SmolLM2-135M on 2 threads, 1.32-1.43x torch's fp32
 * GEMM at 512 and 128 rows (bench/small_linear.py --kernel int8; docs/benchmarks.md, "--quantization w8a8_int8").
 * With AVX-512 a block of 64 is one register: AVX512BW's 512-bit VPMADDUBSW + VPMADDWD (the avx512 build), or
 * AVX512-VNNI's VPDPBUSD, which multiplies, adds each four adjacent products and widens to 16 int32 sums in one
 * instruction (the avx512_vnni and avx512_bf16 builds): 64 products in one instruction where AVX2 takes four, and
 * each block's convert and FMA on 16 lanes instead of 8.
 *
 * The numbers (engine.execution.packing.w8a8_weights, bench/quality.py):
 * - W: symmetric per output row, scale w_scale[n] = max |W[n, :]| / 63 and q in [-63, 63], stored as q + 64 in
 *   [1, 127] (VPMADDUBSW's unsigned operand). Seven bits, not eight: VPMADDUBSW saturates its int16 pair sums, and
 *   127 x 127 x 2 = 32258 stays under 32767 where 255 x 127 x 2 would not (the cost: +1.0% perplexity against 8-bit
 *   weights' +0.35% on the packaged model).
 * - x: symmetric per row per block of 64 along K, scale s = max |x block| / 127, q = round(x * (127 / max)) in
 *   [-127, 127] (round half to even). A scale per block rather than per row keeps one outlier channel from flattening
 *   a row's other values: per row cost +3.1% perplexity, per 64 +1.8%, per 32 +1.3%, and a scale per 64 costs one
 *   convert and one FMA per 64 products.
 * - y[m, n] = w_scale[n] * (sum_b s[m, b] * sum_{k in b} (q_w + 64) q_x  -  x_offset[m]) + bias[n], with
 *   x_offset[m] = 64 * sum_b s[m, b] * sum_{k in b} q_x (the 64 each stored weight carries, which depends on x's row
 *   only, so it is one number a row, computed as the row is quantized). Integer block sums exact (|sum| <= 64 x 127 x
 *   127 < 2^24, so exact in fp32 too), scales applied in fp32.
 *
 * Tiles: 6 rows of x by 2 rows of W (12 fp32 accumulators of 8 lanes), K in steps of one 64-block, each thread a
 * static range of W's row pairs over blocks of MC rows of x (MC x K bytes of x stay in L2 while the thread's rows of W
 * stream past them). Builds without AVX2 run the same integer arithmetic in plain loops.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

#define QB PDSERVE_W8A8_BLOCK  /* x's quantization block along K */
#define MR 6   /* x rows per tile */
#define NR 2   /* W rows per tile */
#define MC 96  /* x rows per pass over a thread's W rows (a multiple of MR) */

/* x row [K] fp32 -> qx [K] and sx [K / QB] (each block's scale); returns the row's x_offset. */
static float quantize_row(const float *x, int K, int8_t *qx, float *sx) {
    float offset = 0.0f;
    for (int b = 0; b < K / QB; b++) {
        const float *xb = x + (int64_t)b * QB;
        float amax = 0.0f;
        for (int k = 0; k < QB; k++) amax = fmaxf(amax, fabsf(xb[k]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        sx[b] = amax / 127.0f;
        int32_t sum = 0;
        for (int k = 0; k < QB; k++) {
            float q = nearbyintf(xb[k] * inv);
            q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
            qx[(int64_t)b * QB + k] = (int8_t)q;
            sum += (int32_t)q;
        }
        offset += sx[b] * (float)(64 * sum);
    }
    return offset;
}

#ifdef HAVE_AVX512
/* One block's products w [64] (unsigned) x a [64] (signed) as 16 int32 sums of four adjacent products each. Exact
 * both ways: VPDPBUSD does not saturate, and VPMADDUBSW's pair sums stay under 32767 with 7-bit weights. */
static inline __attribute__((always_inline)) __m512i block_dot(__m512i w, __m512i a) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(w, a), _mm512_set1_epi16(1));
#endif
}
#endif

/* out[i][j] = sum_b sx[i, b] * sum_{k in b} w[j, k] * qx[i, k] for i < mr, j < nr (constants at each call). */
static inline __attribute__((always_inline)) void tile(const int8_t *qx, const float *sx, const uint8_t *w, int K,
                                                       const int mr, const int nr, float out[MR][NR]) {
    const int nb = K / QB;
#if defined(HAVE_AVX512)
    __m512 acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const int64_t k = (int64_t)b * QB;
        __m512i wv[NR];
        for (int j = 0; j < nr; j++) wv[j] = _mm512_loadu_si512((const void *)(w + (int64_t)j * K + k));
        for (int i = 0; i < mr; i++) {
            const __m512i a = _mm512_loadu_si512((const void *)(qx + (int64_t)i * K + k));
            const __m512 s = _mm512_set1_ps(sx[(int64_t)i * nb + b]);
            for (int j = 0; j < nr; j++)
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(block_dot(wv[j], a)), s, acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
#elif defined(HAVE_AVX2)
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const int64_t k = (int64_t)b * QB;
        __m256i w0[NR], w1[NR];
        for (int j = 0; j < nr; j++) {
            w0[j] = _mm256_loadu_si256((const __m256i *)(w + (int64_t)j * K + k));
            w1[j] = _mm256_loadu_si256((const __m256i *)(w + (int64_t)j * K + k + 32));
        }
        for (int i = 0; i < mr; i++) {
            const __m256i a0 = _mm256_loadu_si256((const __m256i *)(qx + (int64_t)i * K + k));
            const __m256i a1 = _mm256_loadu_si256((const __m256i *)(qx + (int64_t)i * K + k + 32));
            const __m256 s = _mm256_broadcast_ss(sx + (int64_t)i * nb + b);
            for (int j = 0; j < nr; j++) {
                const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(w0[j], a0), ones),
                                                   _mm256_madd_epi16(_mm256_maddubs_epi16(w1[j], a1), ones));
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), s, acc[i][j]);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[i][j]), _mm256_extractf128_ps(acc[i][j], 1));
            v = _mm_add_ps(v, _mm_movehl_ps(v, v));
            out[i][j] = _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
        }
#else
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                int32_t d = 0;
                for (int k = b * QB; k < (b + 1) * QB; k++)
                    d += (int32_t)qx[(int64_t)i * K + k] * w[(int64_t)j * K + k];
                acc += (float)d * sx[(int64_t)i * nb + b];
            }
            out[i][j] = acc;
        }
#endif
}

/* y[m0 + i, n0 + j] for i < mr, j < nr: the tile, the row's offset taken off, the weight row's scale and the bias
 * applied. */
static inline __attribute__((always_inline)) void tile_out(const int8_t *qx, const float *sx, const float *x_offset,
                                                           const uint8_t *wq, const float *w_scale, const float *bias,
                                                           float *y, int m0, int n0, int N, int K, const int mr,
                                                           const int nr) {
    float out[MR][NR];
    tile(qx + (int64_t)m0 * K, sx + (int64_t)m0 * (K / QB), wq + (int64_t)n0 * K, K, mr, nr, out);
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++)
            y[(int64_t)(m0 + i) * N + n0 + j] = w_scale[n0 + j] * (out[i][j] - x_offset[m0 + i]) +
                                                (bias ? bias[n0 + j] : 0.0f);
}

/* Rows m0 .. m0 + rows (rows <= MR) against W rows n0 .. n0 + nr: a constant mr for each case. */
static void rows_out(const int8_t *qx, const float *sx, const float *x_offset, const uint8_t *wq,
                     const float *w_scale, const float *bias, float *y, int m0, int rows, int n0, int nr, int N, int K) {
#define CASE(R) case R: \
        if (nr == NR) tile_out(qx, sx, x_offset, wq, w_scale, bias, y, m0, n0, N, K, R, NR); \
        else tile_out(qx, sx, x_offset, wq, w_scale, bias, y, m0, n0, N, K, R, 1); \
        break;
    switch (rows) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) }
#undef CASE
}

/* The worksharing body of linear_w8a8, orphaned (no region of its own): every thread of the enclosing region calls it
 * with the same arguments. qx [M, K] and sx [M, K / QB + 1] are the caller's buffers, shared by the threads (x's
 * quantized rows, their block scales, then one x_offset a row). Ends without a barrier after the products: the
 * caller's next barrier orders y for its readers. Each output is computed by one thread in the same order whatever the
 * thread count, so the region's build (linear_w8a8) and decode_step's give the same bits. */
void linear_w8a8_for(const float *x, int64_t x_stride, const uint8_t *wq, const float *w_scale, const float *bias,
                     float *y, int M, int N, int K, int8_t *qx, float *sx) {
    const int nb = K / QB, pairs = (N + NR - 1) / NR;
    float *x_offset = sx + (int64_t)M * nb;
    #pragma omp for schedule(static)
    for (int m = 0; m < M; m++)
        x_offset[m] = quantize_row(x + (int64_t)m * x_stride, K, qx + (int64_t)m * K, sx + (int64_t)m * nb);
    for (int mc = 0; mc < M; mc += MC) {
        const int mend = mc + MC < M ? mc + MC : M;
        #pragma omp for schedule(static) nowait
        for (int p = 0; p < pairs; p++) {
            const int n0 = p * NR, nr = N - n0 < NR ? N - n0 : NR;
            for (int m0 = mc; m0 < mend; m0 += MR)
                rows_out(qx, sx, x_offset, wq, w_scale, bias, y, m0, mend - m0 < MR ? mend - m0 : MR, n0, nr, N, K);
        }
    }
}

/* y [M, N] = x [M, K] W^T + bias, as the header comment says. x rows x_stride floats apart; wq [N, K] uint8 in
 * [1, 127] (q + 64), w_scale [N], bias [N] or NULL; K a multiple of QB (the caller checks). Returns 0, or -1 with
 * nothing written when the quantized x's buffer cannot be allocated. */
int linear_w8a8(const float *x, int64_t x_stride, const uint8_t *wq, const float *w_scale, const float *bias, float *y,
                int M, int N, int K, int num_threads) {
    int8_t *qx = malloc((size_t)M * K);
    float *sx = malloc(W8A8_SX_FLOATS(M, K) * sizeof(float));
    if (!qx || !sx) {
        free(qx);
        free(sx);
        return -1;
    }
    #pragma omp parallel num_threads(num_threads)
    linear_w8a8_for(x, x_stride, wq, w_scale, bias, y, M, N, K, qx, sx);
    free(qx);
    free(sx);
    return 0;
}
