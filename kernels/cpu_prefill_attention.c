/* Causal prefill attention over paged bf16 K/V with AVX512_BF16 dot products: the scores, the softmax and P.V of a
 * tile of query rows in one pass over the keys they see, in cache-resident scratch.
 *
 * Why: the blocked-GEMM path (kernels/cpu_prefill.py) hands each block of query rows to torch's bf16 bmm twice, with
 * the scores written out as a bf16 matrix between them and the query and output blocks copied to and from the GQA
 * layout; on 2 AMD EPYC (Zen 5) cores it reaches 171-251 GFLOP/s on SmolLM2's layer (9 q / 3 kv heads, head_dim 64)
 * where oneDNN's GEMMs reach ~900, and it was ~35% of a 1,000-token prefill. Here a work item is (sequence, kv head,
 * RT query positions): all its G * RT query rows (the GQA group's heads at each position) are scored against the keys
 * with VDPBF16PS (16 keys a vector: each (sequence, kv head)'s K is repacked once a call so that one 64-byte load
 * holds 16 keys' pair of dims), the softmax runs in fp32 on the item's rows, and P.V uses VDPBF16PS again on V
 * repacked in key pairs. Items are spread over the threads dynamically (later positions see more keys).
 *
 * Numerics: q.k in fp32 from exact bf16 products (VDPBF16PS), as SDPA; the softmax, its max and sum in fp32; the
 * probabilities normalised and rounded to bf16 before P.V (the blocked-GEMM path and FlashAttention round them too),
 * P.V accumulated in fp32 and rounded to bf16 once. Only the avx512_bf16 build computes; the other builds return
 * PREFILL_UNSUPPORTED and the caller keeps the blocked-GEMM path.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_kernels.h"

#define RT 16  /* query positions per work item */

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* Key j's row of kv head h: paged as [num_blocks, block_size, num_kv_heads, head_dim]. */
static inline const uint16_t *kv_row(const uint16_t *cache, const int32_t *table, int j, int h, int block_size,
                                     int64_t block_stride, int kv_heads, int D) {
    return cache + (int64_t)table[j / block_size] * block_stride + ((int64_t)(j % block_size) * kv_heads + h) * D;
}

/* 64-byte aligned scratch of at least `bytes` (aligned_alloc wants a multiple of the alignment). */
static void *scratch(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* Kp and Vp of one (sequence, kv head) over its `keys` context keys. Kp: 16 keys' pair of dims per 64 bytes,
 * [group of 16 keys][d pair][16] uint32 (keys past the context zero: their scores are never used); Vp: each key pair's
 * two values of each dim side by side (VDPBF16PS's pairs), [key pair][d] uint32, a missing second key zero. */
static void pack_kv(uint32_t *kp, uint32_t *vp, const uint16_t *k_cache, const uint16_t *v_cache,
                    const int32_t *table, int keys, int h, int kv_heads, int D, int block_size, int64_t block_stride) {
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

/* uint32 words pack_kv writes for a context of `keys` keys: Kp, then Vp. */
static inline int64_t packed_words(int keys, int D) {
    return (int64_t)(keys + 15) / 16 * 16 * (D / 2) + (int64_t)(keys + 1) / 2 * D;
}

/* One item: positions [t0, t1) of one sequence's chunk, kv head h, over the sequence's packed K/V (kp, vp). q: the
 * chunk's first row (rows q_stride apart); out likewise (rows o_stride apart). Returns 0, or -1 when its scratch
 * could not be allocated (nothing written). */
static int attend_tile(const uint16_t *q, uint16_t *out, int64_t q_stride, int64_t o_stride, const uint32_t *kp,
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
        float m = -FLT_MAX;
        for (int j = 0; j < n; j++) m = sr[j] > m ? sr[j] : m;
        float sum = 0.0f;
        for (int j = 0; j < n; j++) {  /* a loop of its own so that expf vectorizes (libmvec) */
            sr[j] = expf((sr[j] - m) * scale);
            sum += sr[j];
        }
        const float inv = 1.0f / sum;
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
#endif

/* out[t, hq, :] = softmax(scale * q[t, hq] . K[:p+1]) . V[:p+1] for every query row of every sequence's chunk, p
 * its absolute position (prefix + index in the chunk), K/V of kv head hq / G (the reference:
 * kernels.reference.prefill_attention, without a sliding window).
 * query: [num_tokens, num_q_heads, head_dim] bf16, tokens q_stride elements apart (heads dense); out: the same shape,
 * dense. k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] bf16, blocks block_stride elements apart.
 * cu_seqlens_q: [num_seqs + 1]; context_lens: [num_seqs] (cached prefix + chunk); block_tables: [num_seqs,
 * max_blocks] int32. head_dim a multiple of 64, at most PDSERVE_MAX_HEAD_DIM.
 * Returns -1 when done; PREFILL_UNSUPPORTED from builds without AVX512_BF16 and PREFILL_NO_MEMORY when scratch could
 * not be allocated (nothing computed in either case; with no memory, some rows may be); else the first sequence
 * whose chunk is longer than its context, whose context needs more blocks than its row has, or whose row names a
 * block outside [0, num_blocks) among those it reads, having computed nothing. */
int prefill_attention_bf16(const uint16_t *query, const uint16_t *k_cache, const uint16_t *v_cache,
                           const int32_t *cu_seqlens_q, const int32_t *context_lens, const int32_t *block_tables,
                           uint16_t *out, int num_seqs, int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                           int max_blocks, int64_t block_stride, int64_t q_stride, float scale, int num_threads,
                           int64_t num_blocks) {
#if defined(__AVX512BF16__)
    int items = 0;
    for (int i = 0; i < num_seqs; i++) {
        const int q_len = cu_seqlens_q[i + 1] - cu_seqlens_q[i], ctx = context_lens[i];
        if (q_len < 0 || q_len > ctx || ctx > (int64_t)max_blocks * block_size) return i;
        for (int b = 0; b < (ctx + block_size - 1) / block_size; b++) {
            const int32_t block = block_tables[(int64_t)i * max_blocks + b];
            if (block < 0 || block >= num_blocks) return i;
        }
        items += (q_len + RT - 1) / RT * num_kv_heads;
    }
    const int G = num_q_heads / num_kv_heads;
    /* Each (sequence, kv head)'s K/V packed once, in one buffer, before any tile reads them. */
    int64_t *offset = malloc(sizeof(int64_t) * ((size_t)num_seqs * num_kv_heads + 1));
    if (!offset) return PREFILL_NO_MEMORY;
    offset[0] = 0;
    for (int i = 0; i < num_seqs; i++)
        for (int h = 0; h < num_kv_heads; h++) {
            const int64_t at = (int64_t)i * num_kv_heads + h;
            offset[at + 1] = offset[at] + (packed_words(context_lens[i], head_dim) + 15) / 16 * 16;
        }
    uint32_t *packed = scratch((size_t)offset[(int64_t)num_seqs * num_kv_heads] * 4);
    if (!packed) {
        free(offset);
        return PREFILL_NO_MEMORY;
    }
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) reduction(|:failed)
    {
        #pragma omp for schedule(dynamic, 1)
        for (int job = 0; job < num_seqs * num_kv_heads; job++) {
            const int i = job / num_kv_heads, h = job % num_kv_heads, keys = context_lens[i];
            uint32_t *kp = packed + offset[job];
            pack_kv(kp, kp + (int64_t)(keys + 15) / 16 * 16 * (head_dim / 2), k_cache, v_cache,
                    block_tables + (int64_t)i * max_blocks, keys, h, num_kv_heads, head_dim, block_size, block_stride);
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
            failed |= attend_tile(query + (int64_t)start * q_stride, out + (int64_t)start * o_stride, q_stride,
                                  o_stride, kp, kp + (int64_t)(keys + 15) / 16 * 16 * (head_dim / 2), prefix, t0, t1,
                                  h, G, head_dim, scale) != 0;
        }
    }
    free(packed);
    free(offset);
    return failed ? PREFILL_NO_MEMORY : -1;
#else
    (void)query; (void)k_cache; (void)v_cache; (void)cu_seqlens_q; (void)context_lens; (void)block_tables;
    (void)out; (void)num_seqs; (void)num_q_heads; (void)num_kv_heads; (void)head_dim; (void)block_size;
    (void)max_blocks; (void)block_stride; (void)q_stride; (void)scale; (void)num_threads; (void)num_blocks;
    return PREFILL_UNSUPPORTED;
#endif
}
