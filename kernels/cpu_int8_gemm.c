/* y = x W^T (+ b) with W in 7-bit integers and x quantized to 8 bits per block of 64 on the fly: the int8 GEMM of
 * `--quantization w8a8_int8`'s linears and LM head, prefill chunks and decode steps (engine/execution/packing.py; in
 * the one-region decode step, cpu_decode_step.c, through linear_w8a8_for).
 *
 * Why: an fp32 prefill chunk's linears run at the FMA units' peak on a CPU without bf16 or int8 dot products (AVX2:
 * 2 x 8 fp32 multiply-adds a cycle a core; ~170 GFLOP/s on 2 cores of an AMD EPYC Zen 3, near all of it), so fewer
 * bytes cannot help and only cheaper arithmetic can. AVX2's VPMADDUBSW multiplies 32 unsigned 8-bit by 32 signed 8-bit
 * values and adds adjacent pairs into 16 int16 lanes, VPMADDWD against ones widens them to 8 int32 sums: 32 products
 * in two instructions where fp32 takes four FMAs. AVX512-VNNI's VPDPBUSD multiplies 64 such pairs, adds each four
 * adjacent products and accumulates them into 16 int32 lanes in one instruction (the avx512_vnni and avx512_bf16
 * builds; the avx512 build takes 512-bit VPMADDUBSW + VPMADDWD).
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
 * Layout (oneDNN's and llama.cpp's for VNNI GEMMs; engine.execution.packing.w8a8_packed): W's rows in groups of 16
 * (the last padded with zero weights), each group K / 4 runs of 64 bytes, run t holding W[n, 4t .. 4t + 3] for the
 * group's 16 rows n in turn: wp [ceil(N / 16), K / 4, 16, 4]. One run is one 512-bit register, and a product with x's
 * four bytes k = 4t .. 4t + 3 broadcast to every lane gives the 16 output columns' partial sums in their own lanes:
 * no horizontal sums, each block's int32 sums converted and scaled once for 16 columns, the outputs stored as
 * vectors. Why not [N, K] rows: there each (row of x, row of W) pair sums its lanes apart, a horizontal sum per
 * output and a convert and FMA per block per output; on an Ice Lake Xeon that tile (VPDPBUSD over a block of 64 per
 * instruction) reached 0.85x torch's fp32 GEMM at 512 rows.
 *
 * Tiles: MR rows of x by NG groups of 16 columns, an int32 accumulator each for the block and an fp32 one across
 * blocks (AVX-512: 8 x 2, the 16 int32 accumulators in registers and the fp32 ones, touched once a block, let spill:
 * on an Ice Lake Xeon 1.26x the 6 x 2 tile at 512 rows, 12 x 2 slower again; with VNNI a block's products in
 * assembly (`block_8x32`): on 2 cores of an AMD EPYC Zen 4, the packaged model's four linear shapes x 30 layers,
 * alternated, 1.16x the intrinsics at 512 rows, 1.12x at 64, bit-identical outputs; AVX2: 4 rows by one group as two
 * halves of 8 lanes, a block's products in assembly (`block_4x16`) so its 8 int32 sums keep to registers: on 2 cores
 * of an AMD EPYC Zen 3, the packaged model's four linear shapes x 30 layers, alternated: 1.10-1.40x the 2-row tile
 * at 64 rows over six runs, 1.08x at 256, 1.11x at 7; bit-identical outputs), K in runs of 4 within blocks of 64,
 * each thread a static range of W's groups over blocks of MC rows of x (MC x K bytes of x stay in L2 while the
 * thread's groups of W stream past them). Builds without AVX2 run the same integer arithmetic in plain loops.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_AVX512 1
#define MR 8  /* x rows per tile */
#define NG 2  /* groups of 16 W rows per tile */
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#define MR 4
#define NG 1
#else
#define MR 4
#define NG 1
#endif

#define QB PDSERVE_W8A8_BLOCK   /* x's quantization block along K */
#define GN PDSERVE_W8A8_GROUP   /* W rows per packed group */
#define MC 96  /* x rows per pass over a thread's groups of W (a multiple of each MR) */

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

/* x's four bytes qx[k .. k + 3] as one int32 (to broadcast: each lane's four products take them in order). */
static inline __attribute__((always_inline)) int32_t four_bytes(const int8_t *qx) {
    int32_t v;
    memcpy(&v, qx, sizeof v);
    return v;
}

/* The outputs of 16 columns n0 .. n0 + 15 of one row: y[n] = w_scale[n] * (acc[n - n0] - offset) + bias[n] for the
 * columns below N (the last group's padding rows are dropped). */
static inline __attribute__((always_inline)) void store_group(const float *acc, float offset, const float *w_scale,
                                                              const float *bias, float *y, int n0, int N) {
    const int n_end = n0 + GN < N ? n0 + GN : N;
    for (int n = n0; n < n_end; n++) y[n] = w_scale[n] * (acc[n - n0] - offset) + (bias ? bias[n] : 0.0f);
}

#ifdef HAVE_AVX512
/* iacc + the products of one run: 16 lanes, each four unsigned weight bytes of w by the four signed bytes of x in
 * every lane of xb. Exact both ways: VPDPBUSD does not saturate, and VPMADDUBSW's pair sums stay under 32767 with
 * 7-bit weights. */
static inline __attribute__((always_inline)) __m512i run_dot(__m512i iacc, __m512i w, __m512i xb) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(iacc, w, xb);
#else
    return _mm512_add_epi32(iacc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, xb), _mm512_set1_epi16(1)));
#endif
}
#endif

#if defined(HAVE_AVX512) && defined(__AVX512VNNI__)
/* One block of QB along K for 8 rows of x (x: row 0's block, rows K bytes apart) by two groups of 16 W rows (w: group
 * 0's runs of the block, group 1's group_bytes further): a[i][j] = row i's int32 sums against group j, exactly the
 * sums of `tile`'s intrinsics. In assembly because GCC, given those intrinsics for the full tile, copied all 16 sums
 * between registers every k-step and stored two to the stack (50 instructions a k-step around 16 VPDPBUSD; 0.49 of
 * the CPU's VPDPBUSD rate at 512 rows on an AMD EPYC Zen 4). Here a k-step is two loads of W and 16 VPDPBUSD whose
 * x operand is an embedded broadcast of the row's four bytes ({1to16}); 16 sums and 2 runs in 18 of 32 registers.
 * Two k-steps an iteration. */
static inline __attribute__((always_inline)) void block_8x32(const uint8_t *w, int64_t group_bytes, const int8_t *x,
                                                           int64_t K, __m512i a[8][2]) {
    const int8_t *x3 = x + 3 * K, *x6 = x + 6 * K;
    int n = QB / 8;
    __m512i w0, w1;
    __asm__ volatile(
#define ZERO(A) "vpxord %[" A "], %[" A "], %[" A "]\n\t"
        ZERO("a0") ZERO("a1") ZERO("a2") ZERO("a3") ZERO("a4") ZERO("a5") ZERO("a6") ZERO("a7")
        ZERO("a8") ZERO("a9") ZERO("a10") ZERO("a11") ZERO("a12") ZERO("a13") ZERO("a14") ZERO("a15")
#undef ZERO
        "1:\n\t"
#define ROW(ADDR, A, B) \
        "vpdpbusd " ADDR "%{1to16%}, %[w0], %[" A "]\n\t" \
        "vpdpbusd " ADDR "%{1to16%}, %[w1], %[" B "]\n\t"
#define KSTEP(WOFF, XOFF) \
        "vmovdqu64 " WOFF "(%[w]), %[w0]\n\t" \
        "vmovdqu64 " WOFF "(%[w],%[gb],1), %[w1]\n\t" \
        ROW(XOFF "(%[x])", "a0", "a1") \
        ROW(XOFF "(%[x],%[K],1)", "a2", "a3") \
        ROW(XOFF "(%[x],%[K],2)", "a4", "a5") \
        ROW(XOFF "(%[x3])", "a6", "a7") \
        ROW(XOFF "(%[x3],%[K],1)", "a8", "a9") \
        ROW(XOFF "(%[x3],%[K],2)", "a10", "a11") \
        ROW(XOFF "(%[x6])", "a12", "a13") \
        ROW(XOFF "(%[x6],%[K],1)", "a14", "a15")
        KSTEP("0", "0")
        KSTEP("64", "4")
#undef KSTEP
#undef ROW
        "add $128, %[w]\n\t"
        "add $8, %[x]\n\t"
        "add $8, %[x3]\n\t"
        "add $8, %[x6]\n\t"
        "dec %[n]\n\t"
        "jnz 1b\n\t"
        : [a0] "=&v"(a[0][0]), [a1] "=&v"(a[0][1]), [a2] "=&v"(a[1][0]), [a3] "=&v"(a[1][1]), [a4] "=&v"(a[2][0]),
          [a5] "=&v"(a[2][1]), [a6] "=&v"(a[3][0]), [a7] "=&v"(a[3][1]), [a8] "=&v"(a[4][0]), [a9] "=&v"(a[4][1]),
          [a10] "=&v"(a[5][0]), [a11] "=&v"(a[5][1]), [a12] "=&v"(a[6][0]), [a13] "=&v"(a[6][1]),
          [a14] "=&v"(a[7][0]), [a15] "=&v"(a[7][1]), [w] "+r"(w), [x] "+r"(x), [x3] "+r"(x3), [x6] "+r"(x6),
          [n] "+r"(n), [w0] "=&v"(w0), [w1] "=&v"(w1)
        : [K] "r"(K), [gb] "r"(group_bytes)
        : "memory", "cc");
}
#endif

#ifdef HAVE_AVX2
/* One block of QB along K for 4 rows of x (x: row 0's block, rows K bytes apart) by one group of 16 W rows (w: the
 * group's runs of the block): a[i][h] = row i's int32 sums against columns 8h .. 8h + 7, exactly the sums the
 * intrinsics in `tile` compute for fewer rows. In assembly so that the 8 sums, the group's two half-runs, the
 * broadcast and two products stay in 14 of AVX2's 16 registers: given the same loop as intrinsics, GCC hoisted the
 * four broadcasts and spilled two sums to the stack, and their store-to-load round trip each k-step bounded the
 * loop (4 rows then ran 1.03x the 2-row tile). Two k-steps an iteration: 5% faster than one. */
static inline __attribute__((always_inline)) void block_4x16(const uint8_t *w, const int8_t *x, int64_t K,
                                                           __m256i ones, __m256i a[4][2]) {
    const int8_t *x3 = x + 3 * K;
    int n = QB / 8;
    __m256i w0, w1, xb, t0, t1;
    __asm__ volatile(
        "vpxor %[a0], %[a0], %[a0]\n\t"
        "vpxor %[a1], %[a1], %[a1]\n\t"
        "vpxor %[a2], %[a2], %[a2]\n\t"
        "vpxor %[a3], %[a3], %[a3]\n\t"
        "vpxor %[a4], %[a4], %[a4]\n\t"
        "vpxor %[a5], %[a5], %[a5]\n\t"
        "vpxor %[a6], %[a6], %[a6]\n\t"
        "vpxor %[a7], %[a7], %[a7]\n\t"
        "1:\n\t"
#define ROW(ADDR, A, B) \
        "vpbroadcastd " ADDR ", %[xb]\n\t" \
        "vpmaddubsw %[xb], %[w0], %[t0]\n\t" \
        "vpmaddubsw %[xb], %[w1], %[t1]\n\t" \
        "vpmaddwd %[ones], %[t0], %[t0]\n\t" \
        "vpmaddwd %[ones], %[t1], %[t1]\n\t" \
        "vpaddd %[t0], %[" A "], %[" A "]\n\t" \
        "vpaddd %[t1], %[" B "], %[" B "]\n\t"
#define KSTEP(WOFF, XOFF) \
        "vmovdqu " WOFF "(%[w]), %[w0]\n\t" \
        "vmovdqu 32+" WOFF "(%[w]), %[w1]\n\t" \
        ROW(XOFF "(%[x])", "a0", "a1") \
        ROW(XOFF "(%[x],%[K],1)", "a2", "a3") \
        ROW(XOFF "(%[x],%[K],2)", "a4", "a5") \
        ROW(XOFF "(%[x3])", "a6", "a7")
        KSTEP("0", "0")
        KSTEP("64", "4")
#undef KSTEP
#undef ROW
        "add $128, %[w]\n\t"
        "add $8, %[x]\n\t"
        "add $8, %[x3]\n\t"
        "dec %[n]\n\t"
        "jnz 1b\n\t"
        : [a0] "=&x"(a[0][0]), [a1] "=&x"(a[0][1]), [a2] "=&x"(a[1][0]), [a3] "=&x"(a[1][1]), [a4] "=&x"(a[2][0]),
          [a5] "=&x"(a[2][1]), [a6] "=&x"(a[3][0]), [a7] "=&x"(a[3][1]), [w] "+r"(w), [x] "+r"(x), [x3] "+r"(x3),
          [n] "+r"(n), [w0] "=&x"(w0), [w1] "=&x"(w1), [xb] "=&x"(xb), [t0] "=&x"(t0), [t1] "=&x"(t1)
        : [K] "r"(K), [ones] "x"(ones)
        : "memory", "cc");
}
#endif

/* y rows m0 .. m0 + mr, columns of groups g0 .. g0 + ng (mr <= MR, ng <= NG: constants at each call). qx, sx,
 * x_offset: the quantized rows of x from row 0; wp the packed W from group 0. */
static inline __attribute__((always_inline)) void tile(const int8_t *qx, const float *sx, const float *x_offset,
                                                       const uint8_t *wp, const float *w_scale, const float *bias,
                                                       float *y, int m0, int g0, int N, int K, const int mr,
                                                       const int ng) {
    const int nb = K / QB;
    const int64_t group_bytes = (int64_t)K * GN;
    const int8_t *xq = qx + (int64_t)m0 * K;
    const float *xs = sx + (int64_t)m0 * nb;
    const uint8_t *w = wp + (int64_t)g0 * group_bytes;
#if defined(HAVE_AVX512)
    __m512 acc[MR][NG];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < ng; j++) acc[i][j] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512i iacc[MR][NG];
#ifdef __AVX512VNNI__
        if (mr == MR && ng == NG) {  /* a full tile: the same sums as the loop below, in assembly */
            block_8x32(w + (int64_t)b * QB * GN, group_bytes, xq + (int64_t)b * QB, K, iacc);
        } else
#endif
        {
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < ng; j++) iacc[i][j] = _mm512_setzero_si512();
            for (int k = b * QB; k < (b + 1) * QB; k += 4) {
                __m512i wv[NG];
                for (int j = 0; j < ng; j++) wv[j] = _mm512_loadu_si512((const void *)(w + j * group_bytes + k * GN));
                for (int i = 0; i < mr; i++) {
                    const __m512i xb = _mm512_set1_epi32(four_bytes(xq + (int64_t)i * K + k));
                    for (int j = 0; j < ng; j++) iacc[i][j] = run_dot(iacc[i][j], wv[j], xb);
                }
            }
        }
        for (int i = 0; i < mr; i++) {
            const __m512 s = _mm512_set1_ps(xs[(int64_t)i * nb + b]);
            for (int j = 0; j < ng; j++) acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[i][j]), s, acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < ng; j++) {
            const int n0 = (g0 + j) * GN;
            float *yr = y + (int64_t)(m0 + i) * N;
            if (n0 + GN <= N) {
                const __m512 b = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
                const __m512 v = _mm512_sub_ps(acc[i][j], _mm512_set1_ps(x_offset[m0 + i]));
                _mm512_storeu_ps(yr + n0, _mm512_fmadd_ps(_mm512_loadu_ps(w_scale + n0), v, b));
            } else {
                float out[GN];
                _mm512_storeu_ps(out, acc[i][j]);
                store_group(out, x_offset[m0 + i], w_scale, bias, yr, n0, N);
            }
        }
#elif defined(HAVE_AVX2)
    /* A group's 16 lanes as two halves of 8 (h): its run's first 32 bytes are columns 0-7, the next 32 columns 8-15. */
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MR][2 * NG];
    for (int i = 0; i < mr; i++)
        for (int h = 0; h < 2 * ng; h++) acc[i][h] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i iacc[MR][2 * NG];
        if (mr == MR) {  /* a full tile (4 x 2 sums, NG = 1): the same sums as the loop below, in assembly */
            block_4x16(w + (int64_t)b * QB * GN, xq + (int64_t)b * QB, K, ones, iacc);
        } else {
            for (int i = 0; i < mr; i++)
                for (int h = 0; h < 2 * ng; h++) iacc[i][h] = _mm256_setzero_si256();
            for (int k = b * QB; k < (b + 1) * QB; k += 4) {
                __m256i wv[2 * NG];
                for (int h = 0; h < 2 * ng; h++)
                    wv[h] = _mm256_loadu_si256((const __m256i *)(w + (h / 2) * group_bytes + k * GN + (h % 2) * 32));
                for (int i = 0; i < mr; i++) {
                    const __m256i xb = _mm256_set1_epi32(four_bytes(xq + (int64_t)i * K + k));
                    for (int h = 0; h < 2 * ng; h++)
                        iacc[i][h] = _mm256_add_epi32(iacc[i][h],
                                                      _mm256_madd_epi16(_mm256_maddubs_epi16(wv[h], xb), ones));
                }
            }
        }
        for (int i = 0; i < mr; i++) {
            const __m256 s = _mm256_broadcast_ss(xs + (int64_t)i * nb + b);
            for (int h = 0; h < 2 * ng; h++) acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[i][h]), s, acc[i][h]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < ng; j++) {
            float out[GN];
            _mm256_storeu_ps(out, acc[i][2 * j]);
            _mm256_storeu_ps(out + 8, acc[i][2 * j + 1]);
            store_group(out, x_offset[m0 + i], w_scale, bias, y + (int64_t)(m0 + i) * N, (g0 + j) * GN, N);
        }
#else
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < ng; j++) {
            const uint8_t *wg = w + j * group_bytes;
            float acc[GN] = {0.0f};
            for (int b = 0; b < nb; b++) {
                int32_t d[GN] = {0};
                for (int k = b * QB; k < (b + 1) * QB; k++)
                    for (int l = 0; l < GN; l++)
                        d[l] += (int32_t)xq[(int64_t)i * K + k] * wg[(int64_t)(k / 4) * 4 * GN + 4 * l + k % 4];
                for (int l = 0; l < GN; l++) acc[l] += (float)d[l] * xs[(int64_t)i * nb + b];
            }
            store_group(acc, x_offset[m0 + i], w_scale, bias, y + (int64_t)(m0 + i) * N, (g0 + j) * GN, N);
        }
#endif
}

/* Rows m0 .. m0 + rows (rows <= MR) against groups g0 .. g0 + ng (ng <= NG): a constant mr and ng for each case. */
static void rows_out(const int8_t *qx, const float *sx, const float *x_offset, const uint8_t *wp,
                     const float *w_scale, const float *bias, float *y, int m0, int rows, int g0, int ng, int N,
                     int K) {
#define CASE(R) case R: \
        if (ng == NG) tile(qx, sx, x_offset, wp, w_scale, bias, y, m0, g0, N, K, R, NG); \
        else tile(qx, sx, x_offset, wp, w_scale, bias, y, m0, g0, N, K, R, 1); \
        break;
    switch (rows) {
        CASE(1) CASE(2)
#if MR > 2
        CASE(3) CASE(4)
#endif
#if MR > 4
        CASE(5) CASE(6)
#endif
#if MR > 6
        CASE(7) CASE(8)
#endif
    }
#undef CASE
}

/* The worksharing body of linear_w8a8, orphaned (no region of its own): every thread of the enclosing region calls it
 * with the same arguments. qx [M, K] and sx [M, K / QB + 1] are the caller's buffers, shared by the threads (x's
 * quantized rows, their block scales, then one x_offset a row). Ends without a barrier after the products: the
 * caller's next barrier orders y for its readers. Each output is computed by one thread in the same order whatever the
 * thread count, so the region's build (linear_w8a8) and decode_step's give the same bits. */
void linear_w8a8_for(const float *x, int64_t x_stride, const uint8_t *wp, const float *w_scale, const float *bias,
                     float *y, int M, int N, int K, int8_t *qx, float *sx) {
    const int nb = K / QB, groups = (N + GN - 1) / GN, units = (groups + NG - 1) / NG;
    float *x_offset = sx + (int64_t)M * nb;
    #pragma omp for schedule(static)
    for (int m = 0; m < M; m++)
        x_offset[m] = quantize_row(x + (int64_t)m * x_stride, K, qx + (int64_t)m * K, sx + (int64_t)m * nb);
    for (int mc = 0; mc < M; mc += MC) {
        const int mend = mc + MC < M ? mc + MC : M;
        #pragma omp for schedule(static) nowait
        for (int u = 0; u < units; u++) {
            const int g0 = u * NG, ng = groups - g0 < NG ? groups - g0 : NG;
            for (int m0 = mc; m0 < mend; m0 += MR)
                rows_out(qx, sx, x_offset, wp, w_scale, bias, y, m0, mend - m0 < MR ? mend - m0 : MR, g0, ng, N, K);
        }
    }
}

/* y [M, N] = x [M, K] W^T + bias, as the header comment says. x rows x_stride floats apart; wp W packed as the
 * layout above ([ceil(N / 16), K / 4, 16, 4] uint8 in [1, 127], q + 64), w_scale [N], bias [N] or NULL; K a multiple
 * of QB (the caller checks). Returns 0, or -1 with nothing written when the quantized x's buffer cannot be
 * allocated. */
int linear_w8a8(const float *x, int64_t x_stride, const uint8_t *wp, const float *w_scale, const float *bias, float *y,
                int M, int N, int K, int num_threads) {
    int8_t *qx = malloc((size_t)M * K);
    float *sx = malloc(W8A8_SX_FLOATS(M, K) * sizeof(float));
    if (!qx || !sx) {
        free(qx);
        free(sx);
        return -1;
    }
    #pragma omp parallel num_threads(num_threads)
    linear_w8a8_for(x, x_stride, wp, w_scale, bias, y, M, N, K, qx, sx);
    free(qx);
    free(sx);
    return 0;
}
