/* Causal prefill attention over paged K/V: the scores, the softmax and P.V of a tile of query rows in one pass over
 * the keys they see, in cache-resident scratch. bf16 caches with AVX512_BF16 dot products; fp32 caches with fp32 FMAs
 * in every build (vectors of the build's width).
 *
 * Why: the blocked-GEMM path (kernels/cpu_prefill.py) hands each block of query rows to torch's bf16 bmm twice, with
 * the scores written out as a bf16 matrix between them and the query and output blocks copied to and from the GQA
 * layout; on 2 AMD EPYC (Zen 5) cores it reaches 171-251 GFLOP/s on SmolLM2's layer (9 q / 3 kv heads, head_dim 64)
 * where oneDNN's GEMMs reach ~900, and it was ~35% of a 1,000-token prefill. fp32 caches went to torch's SDPA with
 * an explicit causal mask (kernels.reference): 42 GFLOP/s of causal work for a 1,000-token prompt on 2 AVX2 AMD
 * EPYC (Zen 3) cores against 126 for the layer's GEMMs, a third of the layer. Here a work item is (sequence, kv head,
 * RT query positions): all its G * RT query rows (the GQA group's heads at each position) are scored against the keys
 * (bf16: VDPBF16PS, 16 keys a vector, each (sequence, kv head)'s K repacked once a call so that one 64-byte load holds
 * 16 keys' pair of dims; fp32: FMAs, K repacked VW keys' same dim a vector), the softmax runs in fp32 on the item's
 * rows, and P.V multiplies V (bf16: repacked in key pairs for VDPBF16PS; fp32: gathered dense) by the
 * probabilities. Items are spread over the threads dynamically (later positions see more keys).
 *
 * Numerics: q.k in fp32 (bf16: from exact bf16 products, as SDPA); the softmax, its max and sum in fp32; bf16: the
 * probabilities normalised and rounded to bf16 before P.V (the blocked-GEMM path and FlashAttention round them too),
 * P.V accumulated in fp32 and rounded to bf16 once; fp32: every step in fp32, summed in another order than SDPA's.
 * Only the avx512_bf16 build computes bf16; the other builds return PREFILL_UNSUPPORTED for it and the caller keeps
 * the blocked-GEMM path.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_kernels.h"

#define RT 16  /* query positions per work item */

/* 64-byte aligned scratch of at least `bytes` (aligned_alloc wants a multiple of the alignment). */
static void *scratch(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* uint32 words pack_kv_bf16 writes for a context of `keys` keys: Kp, then Vp. */
static inline int64_t packed_words_bf16(int keys, int D) {
    return (int64_t)(keys + 15) / 16 * 16 * (D / 2) + (int64_t)(keys + 1) / 2 * D;
}

/* sr[j] = exp(scale * (sr[j] - max)) for j < n, in place (scale > 0, so the scores' max is the scaled ones'); returns
 * their sum: a row's softmax before its normalisation. */
static inline float exp_row(float *sr, int n, float scale) {
    float m = -FLT_MAX;
    for (int j = 0; j < n; j++) m = sr[j] > m ? sr[j] : m;
    float sum = 0.0f;
    for (int j = 0; j < n; j++) {  /* a loop of its own so that expf vectorizes (libmvec) */
        sr[j] = expf((sr[j] - m) * scale);
        sum += sr[j];
    }
    return sum;
}

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* Key j's row of kv head h: paged as [num_blocks, block_size, num_kv_heads, head_dim]. */
static inline const uint16_t *kv_row(const uint16_t *cache, const int32_t *table, int j, int h, int block_size,
                                     int64_t block_stride, int kv_heads, int D) {
    return cache + (int64_t)table[j / block_size] * block_stride + ((int64_t)(j % block_size) * kv_heads + h) * D;
}

/* Kp and Vp of one (sequence, kv head) over its `keys` context keys. Kp: 16 keys' pair of dims per 64 bytes,
 * [group of 16 keys][d pair][16] uint32 (keys past the context zero: their scores are never used); Vp: each key pair's
 * two values of each dim side by side (VDPBF16PS's pairs), [key pair][d] uint32, a missing second key zero. */
static void pack_kv_bf16(uint32_t *kp, uint32_t *vp, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int32_t *table, int keys, int h, int kv_heads, int D, int block_size,
                         int64_t block_stride) {
    const int groups = (keys + 15) / 16, pairs = (keys + 1) / 2, P2 = D / 2;
    for (int g = 0; g < groups; g++)
        for (int lane = 0; lane < 16; lane++) {
            const int j = g * 16 + lane;
            uint32_t *dst = kp + (int64_t)g * P2 * 16 + lane;
            if (j < keys) {
                const uint32_t *src = (const uint32_t *)kv_row(k_cache, table, j, h, block_size, block_stride,
                                                               kv_heads, D);
                for (int d2 = 0; d2 < P2; d2++) dst[d2 * 16] = src[d2];
            } else {
                for (int d2 = 0; d2 < P2; d2++) dst[d2 * 16] = 0;
            }
        }
    for (int jj = 0; jj < pairs; jj++) {
        const uint16_t *v0 = kv_row(v_cache, table, 2 * jj, h, block_size, block_stride, kv_heads, D);
        const uint16_t *v1 = 2 * jj + 1 < keys ? kv_row(v_cache, table, 2 * jj + 1, h, block_size, block_stride,
                                                        kv_heads, D) : NULL;
        uint16_t *dst = (uint16_t *)(vp + (int64_t)jj * D);
        for (int d = 0; d < D; d++) {
            dst[2 * d] = v0[d];
            dst[2 * d + 1] = v1 ? v1[d] : 0;
        }
    }
}

/* One item: positions [t0, t1) of one sequence's chunk, kv head h, over the sequence's packed K/V (kp, vp). q: the
 * chunk's first row (rows q_stride apart); out likewise (rows o_stride apart). Returns 0, or -1 when its scratch
 * could not be allocated (nothing written). */
static int attend_tile_bf16(const uint16_t *q, uint16_t *out, int64_t q_stride, int64_t o_stride, const uint32_t *kp,
                            const uint32_t *vp, int prefix, int t0, int t1, int h, int G, int D, float scale) {
    const int keys = prefix + t1;               /* the keys the tile's last position sees */
    const int groups = (keys + 15) / 16, pairs = (keys + 1) / 2, P2 = D / 2;
    const int width = groups * 16;              /* score row length, whole 16-key groups */
    const int rows = (t1 - t0) * G;             /* row r: position t0 + r / G, head h * G + r % G */
    const int pstride = width + 2;              /* bf16 probabilities a row: even, so rows start on a pair */
    float *s = scratch((size_t)rows * width * 4);          /* scores, then fp32 exps */
    uint16_t *p = scratch((size_t)rows * pstride * 2);     /* bf16 probabilities */
    if (!s || !p) {
        free(s);
        free(p);
        return -1;
    }
    /* Scores, 4 rows by 2 key groups at a time (8 accumulators; a short last block of rows repeats its last row). */
    for (int r0 = 0; r0 < rows; r0 += 4) {
        const int32_t *qr[4];
        int seen = 0;
        for (int i = 0; i < 4; i++) {
            const int r = r0 + i < rows ? r0 + i : rows - 1;
            qr[i] = (const int32_t *)(q + (int64_t)(t0 + r / G) * q_stride + (int64_t)(h * G + r % G) * D);
            const int n = prefix + t0 + r / G + 1;
            seen = n > seen ? n : seen;
        }
        const int ng = (seen + 15) / 16;
        for (int g = 0; g < ng; g += 2) {
            const int two = g + 1 < ng;
            __m512 a[4][2];
            for (int i = 0; i < 4; i++) a[i][0] = a[i][1] = _mm512_setzero_ps();
            const uint32_t *k0 = kp + (int64_t)g * P2 * 16, *k1 = k0 + P2 * 16;
            for (int d2 = 0; d2 < P2; d2++) {
                const __m512bh kv0 = (__m512bh)_mm512_load_si512(k0 + d2 * 16);
                const __m512bh kv1 = two ? (__m512bh)_mm512_load_si512(k1 + d2 * 16) : kv0;
                for (int i = 0; i < 4; i++) {
                    const __m512bh b = (__m512bh)_mm512_set1_epi32(qr[i][d2]);
                    a[i][0] = _mm512_dpbf16_ps(a[i][0], kv0, b);
                    a[i][1] = _mm512_dpbf16_ps(a[i][1], kv1, b);
                }
            }
            for (int i = 0; i < 4 && r0 + i < rows; i++) {
                _mm512_store_ps(s + (int64_t)(r0 + i) * width + g * 16, a[i][0]);
                if (two) _mm512_store_ps(s + (int64_t)(r0 + i) * width + (g + 1) * 16, a[i][1]);
            }
        }
    }
    /* Softmax of each row over the keys it sees, in fp32; the probabilities rounded to bf16, zero past them. */
    for (int r = 0; r < rows; r++) {
        const int n = prefix + t0 + r / G + 1;
        float *sr = s + (int64_t)r * width;
        const float inv = 1.0f / exp_row(sr, n, scale);
        uint16_t *pr = p + (int64_t)r * pstride;
        const __m512 vinv = _mm512_set1_ps(inv);
        int j = 0;
        for (; j + 16 <= n; j += 16)  /* VCVTNEPS2BF16: nearest even, as f32_to_bf16 */
            _mm256_storeu_si256((__m256i *)(pr + j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(sr + j), vinv)));
        for (; j < n; j++) pr[j] = f32_to_bf16(sr[j] * inv);
        for (; j < 2 * pairs; j++) pr[j] = 0;
    }
    /* P.V, 4 rows by 64 dims at a time (16 accumulators). */
    for (int r0 = 0; r0 < rows; r0 += 4) {
        int seen = 0;
        const uint32_t *pr[4];
        for (int i = 0; i < 4; i++) {
            const int r = r0 + i < rows ? r0 + i : rows - 1;
            pr[i] = (const uint32_t *)(p + (int64_t)r * pstride);
            const int n = prefix + t0 + r / G + 1;
            seen = n > seen ? n : seen;
        }
        const int np = (seen + 1) / 2;
        for (int d0 = 0; d0 < D; d0 += 64) {
            __m512 a[4][4];
            for (int i = 0; i < 4; i++)
                for (int c = 0; c < 4; c++) a[i][c] = _mm512_setzero_ps();
            for (int jj = 0; jj < np; jj++) {
                const uint32_t *vr = vp + (int64_t)jj * D + d0;
                __m512bh vv[4];
                for (int c = 0; c < 4; c++) vv[c] = (__m512bh)_mm512_loadu_si512(vr + 16 * c);
                for (int i = 0; i < 4; i++) {
                    const __m512bh b = (__m512bh)_mm512_set1_epi32((int)pr[i][jj]);
                    for (int c = 0; c < 4; c++) a[i][c] = _mm512_dpbf16_ps(a[i][c], vv[c], b);
                }
            }
            for (int i = 0; i < 4 && r0 + i < rows; i++) {
                const int r = r0 + i;
                uint16_t *o = out + (int64_t)(t0 + r / G) * o_stride + (int64_t)(h * G + r % G) * D + d0;
                for (int c = 0; c < 4; c++) {
                    float f[16] __attribute__((aligned(64)));
                    _mm512_store_ps(f, a[i][c]);
                    for (int e = 0; e < 16; e++) o[16 * c + e] = f32_to_bf16(f[e]);
                }
            }
        }
    }
    free(s);
    free(p);
    return 0;
}
#else
/* Never called: prefill_attention refuses bf16 first in a build without AVX512_BF16. */
static void pack_kv_bf16(uint32_t *kp, uint32_t *vp, const void *k_cache, const void *v_cache, const int32_t *table,
                         int keys, int h, int kv_heads, int D, int block_size, int64_t block_stride) {
    (void)kp; (void)vp; (void)k_cache; (void)v_cache; (void)table; (void)keys; (void)h; (void)kv_heads; (void)D;
    (void)block_size; (void)block_stride;
}
static int attend_tile_bf16(const uint16_t *q, uint16_t *out, int64_t q_stride, int64_t o_stride, const uint32_t *kp,
                            const uint32_t *vp, int prefix, int t0, int t1, int h, int G, int D, float scale) {
    (void)q; (void)out; (void)q_stride; (void)o_stride; (void)kp; (void)vp; (void)prefix; (void)t0; (void)t1;
    (void)h; (void)G; (void)D; (void)scale;
    return -1;
}
#endif


/* The fp32 path, in every build: vectors of FW floats (the build's width; unaligned loads). */
#if defined(__AVX512F__)
#define FW 16
#elif defined(__AVX__)
#define FW 8
#else
#define FW 4
#endif
typedef float fv __attribute__((vector_size(FW * sizeof(float)), aligned(4), may_alias));

/* Element offset of key j's row of kv head h in a cache paged as [num_blocks, block_size, num_kv_heads, head_dim]. */
static inline int64_t kv_row_at(const int32_t *table, int j, int h, int block_size, int64_t block_stride, int kv_heads,
                                int D) {
    return (int64_t)table[j / block_size] * block_stride + ((int64_t)(j % block_size) * kv_heads + h) * D;
}

/* Element d of the row at element offset `at` of an fp32 or bf16 (kv_bf16) cache, as fp32 (bf16 widened exactly). */
static inline float kv_elem_f32(const void *cache, int64_t at, int d, int kv_bf16) {
    return kv_bf16 ? bf16_to_f32(((const uint16_t *)cache)[at + d]) : ((const float *)cache)[at + d];
}

/* Floats pack_kv_f32 writes for a context of `keys` keys: Kp, then Vp. */
static inline int64_t packed_floats(int keys, int D) {
    return (int64_t)(keys + FW - 1) / FW * FW * D + (int64_t)keys * D;
}

/* Kp and Vp of one (sequence, kv head) over its `keys` context keys, in fp32 from an fp32 or bf16 (kv_bf16) cache.
 * Kp: [group of FW keys][d][FW], so that one vector holds FW keys' same dim (keys past the context zero: their scores
 * are never used); Vp: [key][d], dense. */
static void pack_kv_f32(float *kp, float *vp, const void *k_cache, const void *v_cache, const int32_t *table,
                        int keys, int h, int kv_heads, int D, int block_size, int64_t block_stride, int kv_bf16) {
    const int groups = (keys + FW - 1) / FW;
    for (int g = 0; g < groups; g++)
        for (int lane = 0; lane < FW; lane++) {
            const int j = g * FW + lane;
            float *dst = kp + (int64_t)g * D * FW + lane;
            if (j < keys) {
                const int64_t at = kv_row_at(table, j, h, block_size, block_stride, kv_heads, D);
                for (int d = 0; d < D; d++) dst[d * FW] = kv_elem_f32(k_cache, at, d, kv_bf16);
            } else {
                for (int d = 0; d < D; d++) dst[d * FW] = 0.0f;
            }
        }
    for (int j = 0; j < keys; j++) {
        const int64_t at = kv_row_at(table, j, h, block_size, block_stride, kv_heads, D);
        float *dst = vp + (int64_t)j * D;
        if (kv_bf16)
            for (int d = 0; d < D; d++) dst[d] = kv_elem_f32(v_cache, at, d, 1);
        else
            memcpy(dst, (const float *)v_cache + at, sizeof(float) * D);
    }
}

/* One fp32 item, as attend_tile: positions [t0, t1) of one sequence's chunk, kv head h, over the sequence's packed
 * K/V (kp, vp); s: the calling thread's scratch of at least (t1 - t0) * G rows of the keys' whole FW groups. D a
 * multiple of 2 * FW. */
static void attend_tile_f32(const float *q, float *out, int64_t q_stride, int64_t o_stride, const float *kp,
                            const float *vp, int prefix, int t0, int t1, int h, int G, int D, float scale, float *s) {
    const int keys = prefix + t1;               /* the keys the tile's last position sees */
    const int width = (keys + FW - 1) / FW * FW;  /* score row length, whole FW-key groups */
    const int rows = (t1 - t0) * G;             /* row r: position t0 + r / G, head h * G + r % G */
    /* Scores, 4 rows by 3 key groups at a time (12 accumulators; a short last block of rows repeats its last row). */
    for (int r0 = 0; r0 < rows; r0 += 4) {
        const float *qr[4];
        int seen = 0;
        for (int i = 0; i < 4; i++) {
            const int r = r0 + i < rows ? r0 + i : rows - 1;
            qr[i] = q + (int64_t)(t0 + r / G) * q_stride + (int64_t)(h * G + r % G) * D;
            const int n = prefix + t0 + r / G + 1;
            seen = n > seen ? n : seen;
        }
        const int ng = (seen + FW - 1) / FW;
        for (int g = 0; g < ng; g += 3) {
            const fv *k0 = (const fv *)(kp + (int64_t)g * D * FW);
            const fv *k1 = g + 1 < ng ? k0 + D : k0, *k2 = g + 2 < ng ? k0 + 2 * D : k0;
            fv a[4][3] = {{{0}}};
            for (int d = 0; d < D; d++) {
                const fv x0 = k0[d], x1 = k1[d], x2 = k2[d];
                for (int i = 0; i < 4; i++) {
                    const fv b = (fv){0} + qr[i][d];
                    a[i][0] += x0 * b;
                    a[i][1] += x1 * b;
                    a[i][2] += x2 * b;
                }
            }
            for (int i = 0; i < 4 && r0 + i < rows; i++)
                for (int c = 0; c < 3 && g + c < ng; c++)
                    *(fv *)(s + (int64_t)(r0 + i) * width + (g + c) * FW) = a[i][c];
        }
    }
    /* Softmax of each row over the keys it sees, in fp32; zero past them (the P.V below reads its block's widest). */
    for (int r = 0; r < rows; r++) {
        const int n = prefix + t0 + r / G + 1;
        float *sr = s + (int64_t)r * width;
        const float inv = 1.0f / exp_row(sr, n, scale);
        for (int j = 0; j < n; j++) sr[j] *= inv;
        for (int j = n; j < width; j++) sr[j] = 0.0f;
    }
    /* P.V, 4 rows by 2 vectors of dims at a time (8 accumulators). */
    for (int r0 = 0; r0 < rows; r0 += 4) {
        int seen = 0;
        const float *pr[4];
        for (int i = 0; i < 4; i++) {
            const int r = r0 + i < rows ? r0 + i : rows - 1;
            pr[i] = s + (int64_t)r * width;
            const int n = prefix + t0 + r / G + 1;
            seen = n > seen ? n : seen;
        }
        for (int d0 = 0; d0 < D; d0 += 2 * FW) {
            fv a[4][2] = {{{0}}};
            for (int j = 0; j < seen; j++) {
                const fv *vr = (const fv *)(vp + (int64_t)j * D + d0);
                const fv v0 = vr[0], v1 = vr[1];
                for (int i = 0; i < 4; i++) {
                    const fv b = (fv){0} + pr[i][j];
                    a[i][0] += v0 * b;
                    a[i][1] += v1 * b;
                }
            }
            for (int i = 0; i < 4 && r0 + i < rows; i++) {
                const int r = r0 + i;
                fv *o = (fv *)(out + (int64_t)(t0 + r / G) * o_stride + (int64_t)(h * G + r % G) * D + d0);
                o[0] = a[i][0];
                o[1] = a[i][1];
            }
        }
    }
}

/* out[t, hq, :] = softmax(scale * q[t, hq] . K[:p+1]) . V[:p+1] for every query row of every sequence's chunk, p
 * its absolute position (prefix + index in the chunk), K/V of kv head hq / G (the reference:
 * kernels.reference.prefill_attention, without a sliding window).
 * query: [num_tokens, num_q_heads, head_dim] bf16 (is_bf16) or fp32, tokens q_stride elements apart (heads dense);
 * out: the same shape and dtype, dense. k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] of the
 * query's dtype, or bf16 (kv_bf16) under an fp32 query (widened as they are packed), blocks block_stride elements
 * apart. cu_seqlens_q: [num_seqs + 1]; context_lens: [num_seqs] (cached
 * prefix + chunk); block_tables: [num_seqs, max_blocks] int32. head_dim at most PDSERVE_MAX_HEAD_DIM, a multiple of
 * 64 (bf16) or 32 (fp32).
 * Returns -1 when done; PREFILL_UNSUPPORTED for bf16 from builds without AVX512_BF16 or over an fp32 cache, and
 * PREFILL_NO_MEMORY when scratch could not be allocated (nothing computed in either case; with no memory, some rows
 * may be); else the first sequence whose chunk is longer than its context, whose context needs more blocks than its
 * row has, or whose row names a block outside [0, num_blocks) among those it reads, having computed nothing. */
int prefill_attention(const void *query, const void *k_cache, const void *v_cache, const int32_t *cu_seqlens_q,
                      const int32_t *context_lens, const int32_t *block_tables, void *out, int num_seqs,
                      int num_q_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
                      int64_t block_stride, int64_t q_stride, float scale, int is_bf16, int kv_bf16,
                      int num_threads, int64_t num_blocks) {
#if !defined(__AVX512BF16__)
    if (is_bf16) return PREFILL_UNSUPPORTED;
#endif
    if (is_bf16 && !kv_bf16) return PREFILL_UNSUPPORTED;
    int items = 0, max_keys = 0;
    for (int i = 0; i < num_seqs; i++) {
        const int q_len = cu_seqlens_q[i + 1] - cu_seqlens_q[i], ctx = context_lens[i];
        if (q_len < 0 || q_len > ctx || ctx > (int64_t)max_blocks * block_size) return i;
        for (int b = 0; b < (ctx + block_size - 1) / block_size; b++) {
            const int32_t block = block_tables[(int64_t)i * max_blocks + b];
            if (block < 0 || block >= num_blocks) return i;
        }
        items += (q_len + RT - 1) / RT * num_kv_heads;
        max_keys = ctx > max_keys ? ctx : max_keys;
    }
    const int G = num_q_heads / num_kv_heads;
    /* Each (sequence, kv head)'s K/V packed once, in one buffer, before any tile reads them (offsets in 4-byte
     * words, each start 64-byte aligned). */
    int64_t *offset = malloc(sizeof(int64_t) * ((size_t)num_seqs * num_kv_heads + 1));
    if (!offset) return PREFILL_NO_MEMORY;
    offset[0] = 0;
    for (int i = 0; i < num_seqs; i++)
        for (int h = 0; h < num_kv_heads; h++) {
            const int64_t at = (int64_t)i * num_kv_heads + h;
            const int64_t words = is_bf16 ? packed_words_bf16(context_lens[i], head_dim)
                                          : packed_floats(context_lens[i], head_dim);
            offset[at + 1] = offset[at] + (words + 15) / 16 * 16;
        }
    uint32_t *packed = scratch((size_t)offset[(int64_t)num_seqs * num_kv_heads] * 4);
    if (!packed) {
        free(offset);
        return PREFILL_NO_MEMORY;
    }
    /* fp32: each thread's scores, RT positions' rows of the longest context's whole groups */
    const size_t scores_bytes = (size_t)RT * G * ((max_keys + FW - 1) / FW * FW) * sizeof(float);
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) reduction(|:failed)
    {
        float *s = is_bf16 ? NULL : scratch(scores_bytes);
        failed |= !is_bf16 && !s;
        #pragma omp for schedule(dynamic, 1)
        for (int job = 0; job < num_seqs * num_kv_heads; job++) {
            const int i = job / num_kv_heads, h = job % num_kv_heads, keys = context_lens[i];
            const int32_t *table = block_tables + (int64_t)i * max_blocks;
            uint32_t *kp = packed + offset[job];
            if (is_bf16)
                pack_kv_bf16(kp, kp + (int64_t)(keys + 15) / 16 * 16 * (head_dim / 2), k_cache, v_cache, table,
                             keys, h, num_kv_heads, head_dim, block_size, block_stride);
            else
                pack_kv_f32((float *)kp, (float *)kp + (int64_t)(keys + FW - 1) / FW * FW * head_dim, k_cache,
                            v_cache, table, keys, h, num_kv_heads, head_dim, block_size, block_stride, kv_bf16);
        }
        /* the loop's barrier: every K/V is packed */
        #pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; item++) {
            /* item -> (sequence, tile, kv head), sequences in order */
            int rest = item, i = 0;
            for (;; i++) {
                const int n = (cu_seqlens_q[i + 1] - cu_seqlens_q[i] + RT - 1) / RT * num_kv_heads;
                if (rest < n) break;
                rest -= n;
            }
            const int start = cu_seqlens_q[i], q_len = cu_seqlens_q[i + 1] - start;
            const int keys = context_lens[i], prefix = keys - q_len;
            const int tile = rest / num_kv_heads, h = rest % num_kv_heads;
            const int t0 = tile * RT, t1 = t0 + RT < q_len ? t0 + RT : q_len;
            const int64_t o_stride = (int64_t)num_q_heads * head_dim;
            const uint32_t *kp = packed + offset[(int64_t)i * num_kv_heads + h];
            if (is_bf16)
                failed |= attend_tile_bf16((const uint16_t *)query + (int64_t)start * q_stride,
                                           (uint16_t *)out + (int64_t)start * o_stride, q_stride, o_stride, kp,
                                           kp + (int64_t)(keys + 15) / 16 * 16 * (head_dim / 2), prefix, t0, t1, h,
                                           G, head_dim, scale) != 0;
            else if (s)
                attend_tile_f32((const float *)query + (int64_t)start * q_stride, (float *)out + (int64_t)start *
                                o_stride, q_stride, o_stride, (const float *)kp, (const float *)kp +
                                (int64_t)(keys + FW - 1) / FW * FW * head_dim, prefix, t0, t1, h, G, head_dim, scale,
                                s);
        }
        free(s);
    }
    free(packed);
    free(offset);
    return failed ? PREFILL_NO_MEMORY : -1;
}
