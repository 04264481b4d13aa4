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
 * blocks of 3 and 4 x 3 tiles (fewer loads per FMA once the step's rows make it compute-bound). A block's weight
 * rows are re-read for each group of x rows from L1/L2, so DRAM sees each weight once per call. Vectors are GCC's
 * vector extensions at the width of the level being compiled (setup.py builds this file per ISA level), so one
 * source serves SSE2, AVX2 and AVX-512.
 * fp32 sums are reassociated against torch's (per-lane partial sums): results differ in the last bits.
 */
#include <stdint.h>

#include "cpu_kernels.h"

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
#define NB 4  /* weight rows (output features) per block */
#define MB 2  /* x rows per pass over a block */

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
    const float *xr[4] = {x0, x1, x2, x3};
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 3; j++) {
            float s = hsum(acc[i][j]);
            for (int t = k; t < K; t++) s += xr[i][t] * w[(int64_t)j * K + t];
            out[i][j] = s;
        }
}

/* y[m, n] = sum_k x[m, k] * w[n, k] + (bias ? bias[n] : 0) for m < M, n < N.
 * x: [M, K] fp32, rows x_stride apart (dense within a row); w: [N, K] fp32 dense; bias: [N] or NULL; y: [M, N]
 * dense. Threads split the output features: blocks of 4 for M < 4 (the 2 x 4 tile: 4 weight streams keep a 1-row
 * pass off the FMA latency; 3 streams were ~10% slower at M = 1), else blocks of 3 through the 4 x 3 tile (1.1-1.3x
 * the 2 x 4 tile at M = 16-32, 2-core AMD EPYC VM, AVX2), the last M % 4 rows as a tile of repeated rows; the last
 * N % 3 features (one block) through the general tile. */
void linear_small_m(const float *x, const float *w, const float *bias, float *y, int M, int N, int K,
                    int64_t x_stride, int num_threads) {
    const int nbk = M < 4 ? NB : 3;
    const int blocks = (N + nbk - 1) / nbk;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int b = 0; b < blocks; b++) {
        const int n0 = b * nbk, nb = N - n0 < nbk ? N - n0 : nbk;
        const float *wb = w + (int64_t)n0 * K;
        int m0 = 0;
        if (nb == 3 && M >= 4) {
            for (; m0 < M; m0 += 4) {
                const int rows = M - m0 < 4 ? M - m0 : 4;
                float out[4][3];
                tile_4x3(x + m0 * x_stride, x_stride, rows, wb, K, out);
                for (int i = 0; i < rows; i++)
                    for (int j = 0; j < 3; j++)
                        y[(int64_t)(m0 + i) * N + n0 + j] = out[i][j] + (bias ? bias[n0 + j] : 0.0f);
            }
        }
        for (; m0 < M; m0 += MB) {
            const int mb = M - m0 < MB ? M - m0 : MB;
            const float *xm = x + m0 * x_stride;
            float out[MB][NB];
            if (nb == NB && mb == MB) dot_tile(xm, x_stride, wb, K, out, MB, NB);
            else if (nb == NB) dot_tile(xm, x_stride, wb, K, out, 1, NB);
            else if (mb == MB) dot_tile(xm, x_stride, wb, K, out, MB, nb);
            else dot_tile(xm, x_stride, wb, K, out, 1, nb);
            for (int i = 0; i < mb; i++)
                for (int j = 0; j < nb; j++)
                    y[(int64_t)(m0 + i) * N + n0 + j] = out[i][j] + (bias ? bias[n0 + j] : 0.0f);
        }
    }
}
