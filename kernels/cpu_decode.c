/* Paged decode attention on CPU: one query token per sequence, K/V read in place through the block table.
 *
 * Why C: the torch reference gathers every sequence's blocks into a contiguous copy before attending (a second
 * pass over all of K and V per layer per step); at batch 64 that gather and the SDPA over it were most of the
 * decode step (docs/history/benchmarks.md, "Decode step profile"). Decode attention does ~2 FLOPs per byte of KV,
 * so it is bound by reading K/V once; this kernel streams each block once per (sequence, kv head), computing all the
 * query heads of the GQA group from the same loaded rows, with the online softmax of Milakov & Gimelshein 2018
 * ("Online normalizer calculation for softmax"), as FlashAttention / vLLM's paged attention do per block.
 *
 * Numerics: scores, softmax and the P.V accumulation in fp32 for every storage dtype (the torch reference's
 * contract); bf16 is widened exactly (bits << 16) and the output rounded to nearest even, as torch's .to() does.
 * Built at install time by setup.py, once per ISA level (-O3 -ffast-math -fopenmp plus the level's -m flags; see
 * cpu_kernels.h), and called through the torch ops of cpu_ops.cpp. Three paths: attend_item_avx512 (AVX-512
 * intrinsics, head_dim 64 and 128, in the avx512 and avx512_bf16 builds; 1.4-2.0x the plain loops on an AMD EPYC,
 * one thread, 64 sequences x 256-1024 tokens: docs/history/benchmarks.md), attend_item_avx2 (the same at 8 lanes,
 * head_dim 64 and 128, in the avx2 build) and attend_item, plain loops over head_dim that the compiler vectorizes for
 * the build's ISA (every other case, and the base build).
 * -ffast-math lets the compiler reassociate the dot products and call glibc's vector expf (libmvec), 2x on this
 * kernel. Hence no infinities here: -FLT_MAX is the empty max.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_kernels.h"

#ifdef __AVX512F__
#include <immintrin.h>
#define HAVE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

#define MAX_GROUP PDSERVE_MAX_GROUP  /* query heads per kv head in registers/stack; larger groups take the reference */
#define MAX_HEAD_DIM PDSERVE_MAX_HEAD_DIM
#define MAX_BLOCK PDSERVE_MAX_BLOCK  /* tokens per KV block */


/* Load `n` elements of a row (fp32 when is_bf16 == 0, else bf16) into fp32 `dst`. */
static inline void load_row(float *restrict dst, const void *src, int n, int is_bf16) {
    if (is_bf16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

/* out[s, kvh * group + g, :] = acc[g] / l[g] for the group's query heads, rounded to bf16 (nearest even) or kept
 * fp32; zeros for an empty context. */
static inline void store_outputs(void *out, float acc[][MAX_HEAD_DIM], const float *l, int s, int kvh, int group,
                                 int num_q_heads, int head_dim, int ctx, int is_bf16) {
    const size_t elem = is_bf16 ? 2 : 4;
    for (int g = 0; g < group; g++) {
        const float inv = ctx > 0 ? 1.0f / l[g] : 0.0f;
        char *dst = (char *)out + ((size_t)s * num_q_heads + kvh * group + g) * head_dim * elem;
        if (is_bf16) {
            uint16_t *o = (uint16_t *)dst;
            for (int d = 0; d < head_dim; d++) o[d] = f32_to_bf16(acc[g][d] * inv);
        } else {
            float *o = (float *)dst;
            for (int d = 0; d < head_dim; d++) o[d] = acc[g][d] * inv;
        }
    }
}

/* A work unit's keys: [lo, hi) of its sequence's context (the window's keys, or one split's share of them:
 * split_keys). partial: NULL to write the unit's normalised outputs, else where its partial state goes (finish_item)
 * for merge_item to combine. */
typedef struct {
    int lo, hi;
    float *partial;
} Keys;

/* Floats of one unit's partial state: for each query head of the group its running max m, its sum l and its
 * unnormalised acc [head_dim]. */
static inline int64_t partial_floats(int group, int head_dim) { return (int64_t)group * (head_dim + 2); }

/* A unit's end: its outputs (store_outputs, `keys` > 0 keys seen), or its state in `partial`. */
static inline void finish_item(void *out, float acc[][MAX_HEAD_DIM], const float *m, const float *l, int s, int kvh,
                               int group, int num_q_heads, int head_dim, int keys, int is_bf16, float *partial) {
    if (partial == NULL) {
        store_outputs(out, acc, l, s, kvh, group, num_q_heads, head_dim, keys, is_bf16);
        return;
    }
    for (int g = 0; g < group; g++) {
        float *p = partial + (int64_t)g * (head_dim + 2);
        p[0] = m[g];
        p[1] = l[g];
        memcpy(p + 2, acc[g], (size_t)head_dim * sizeof(float));
    }
}

/* Item (s, kvh)'s outputs from its `splits` units' states (finish_item; units `partial_floats` apart): per query
 * head M = max m_u, l = sum_u l_u e^(m_u - M), acc = sum_u acc_u e^(m_u - M), out = acc / l (the rescaling of the
 * online softmax across ranges: FlashDecoding, Dao et al. 2023; vLLM's paged attention v2). Units that saw no key
 * (l_u = 0) are skipped: their m_u is -FLT_MAX, which e^(m_u - M) must not meet under -ffast-math. */
static void merge_item(const float *partials, int splits, void *out, int s, int kvh, int group, int num_q_heads,
                       int head_dim, int is_bf16) {
    float acc[MAX_GROUP][MAX_HEAD_DIM], l[MAX_GROUP];
    const int64_t unit = partial_floats(group, head_dim);
    int seen = 0;
    for (int g = 0; g < group; g++) {
        float top = -FLT_MAX;
        for (int u = 0; u < splits; u++) {
            const float *p = partials + u * unit + (int64_t)g * (head_dim + 2);
            if (p[1] > 0.0f && p[0] > top) top = p[0];
        }
        l[g] = 0.0f;
        for (int d = 0; d < head_dim; d++) acc[g][d] = 0.0f;
        for (int u = 0; u < splits; u++) {
            const float *p = partials + u * unit + (int64_t)g * (head_dim + 2);
            if (!(p[1] > 0.0f)) continue;
            const float c = expf(p[0] - top);
            l[g] += p[1] * c;
            for (int d = 0; d < head_dim; d++) acc[g][d] += c * p[2 + d];
            seen = 1;
        }
    }
    store_outputs(out, acc, l, s, kvh, group, num_q_heads, head_dim, seen, is_bf16);
}

/* Blocks sit anywhere in the cache, where the hardware prefetcher cannot follow the block table: without software
 * prefetch the loads of each block's rows took half of the kernel's samples (perf). Each token's K and V rows of
 * the block PF_AHEAD blocks ahead are requested as this block's rows are loaded, one row per token, rather than
 * the whole next block in one burst (bf16, 64 sequences x 1024 tokens, one thread: 7.7 -> 4.1 ms per layer;
 * docs/history/benchmarks.md). With the burst, fp32 read twice bf16's bytes in the same time, so bandwidth was not the
 * limit; the loads queued behind 64+ outstanding prefetches, as far as timings tell (no counters were read).
 * The prefetches go to L2 (PREFETCHT1), not L1: a 16-token chunk of head_dim 64 asks for 64 lines at once, more than
 * L1's few outstanding misses; L2 tracks more. On 2 cores of an AMD EPYC Zen 4 (bench/cpu_attention.py, blocks
 * placed at random, from DRAM): bf16, 64 sequences x 145 tokens, 0.70 -> 0.45 ms per layer, x 1024 tokens 5.3 -> 2.7;
 * fp32 1.27 -> 0.84 and 7.9 -> 6.2; the AVX2 and plain builds alike. */
#define PF_AHEAD 2

static inline void prefetch_row(const void *k_cache, const void *v_cache, int64_t row, size_t row_bytes, size_t elem) {
    const char *kr = (const char *)k_cache + row * (int64_t)elem, *vr = (const char *)v_cache + row * (int64_t)elem;
    for (size_t off = 0; off < row_bytes; off += 64) {
        __builtin_prefetch(kr + off, 0, 2);
        __builtin_prefetch(vr + off, 0, 2);
    }
}

/* The work item this thread runs next (table == NULL: none). The prefetch runs on into it past this item's last
 * block, so that a short context's first blocks are not all cold misses (an item of 72 tokens has 5 blocks). With a
 * sliding window the item starts at its window's first block: table and ctx are then counted from that block. */
typedef struct {
    const int32_t *table;
    int ctx;
    int64_t head_offset;
} NextItem;

/* First row (element offset) of the block PF_AHEAD blocks after the one at t0: in this item's table while it has
 * that many blocks, then in the next item's; -1 past both. */
static inline int64_t ahead_base(const int32_t *table, int t0, int ctx, int block_size, int64_t block_stride,
                                 int64_t head_offset, NextItem next) {
    const int blk = t0 / block_size + PF_AHEAD, have = (ctx + block_size - 1) / block_size;
    if (blk < have) return (int64_t)table[blk] * block_stride + head_offset;
    const int k = blk - have;
    if (next.table != NULL && k < (next.ctx + block_size - 1) / block_size)
        return (int64_t)next.table[k] * block_stride + next.head_offset;
    return -1;
}

/* First key of sequence s that its query sees: ctx - window with a sliding window shorter than the context, else 0
 * (HF's sliding-window mask: key k is seen iff k <= q and q - k < window, the query at q = ctx - 1). */
static inline int window_start(int ctx, int sliding_window) {
    return sliding_window > 0 && ctx > sliding_window ? ctx - sliding_window : 0;
}

/* Split p of `splits` of the keys a sequence of ctx tokens sees, [window_start, ctx): near-equal ranges cut at
 * multiples of 8 keys (the AVX2 path's chunk; AVX-512's 16 may cut one chunk in two). splits = 1: all of them. */
static inline Keys split_keys(int ctx, int sliding_window, int p, int splits) {
    const int lo = window_start(ctx, sliding_window), span = ctx > lo ? ctx - lo : 0;
    int a = lo + (int)((int64_t)span * p / splits), b = lo + (int)((int64_t)span * (p + 1) / splits);
    a = p == 0 ? lo : (a / 8 * 8 > lo ? a / 8 * 8 : lo);
    b = p + 1 == splits ? ctx : (b / 8 * 8 > lo ? b / 8 * 8 : lo);
    return (Keys){a, b, NULL};
}

/* One work unit: sequence s, kv head kvh, all `group` query heads that share it, over keys [keys.lo, keys.hi): the
 * blocks before the window's are never read. Always inlined into the callers below with head_dim a compile-time
 * constant (64, 128) where it can be, so that the loops over head_dim unroll and the accumulators stay in registers;
 * the generic call keeps it a runtime value. */
static inline __attribute__((always_inline)) void attend_item(
        const void *query, const void *k_cache, const void *v_cache, const int32_t *block_tables, Keys keys,
        void *out, int s, int kvh, int group, int num_q_heads, int head_dim, int block_size, int max_blocks,
        int64_t block_stride, int64_t token_stride, int64_t q_stride, float scale, int is_bf16, int kv_bf16,
        NextItem next) {
    const size_t elem = is_bf16 ? 2 : 4, kv_elem = kv_bf16 ? 2 : 4;
    const int ctx = keys.hi, lo = keys.lo;  /* ctx: the range's end (the context's, unsplit) */
    float q[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], m[MAX_GROUP], l[MAX_GROUP];
    float kb[MAX_BLOCK][MAX_HEAD_DIM], vb[MAX_BLOCK][MAX_HEAD_DIM];
    for (int g = 0; g < group; g++) {
        const int h = kvh * group + g;
        load_row(q[g], (const char *)query + ((size_t)s * q_stride + (size_t)h * head_dim) * elem, head_dim, is_bf16);
        for (int d = 0; d < head_dim; d++) { q[g][d] *= scale; acc[g][d] = 0.0f; }
        m[g] = -FLT_MAX;  /* finite: built with -ffast-math, which assumes no infinities */
        l[g] = 0.0f;
    }
    const int32_t *table = block_tables + (size_t)s * max_blocks;
    const size_t row_bytes = (size_t)head_dim * kv_elem;
    for (int t0 = lo - lo % block_size; t0 < ctx; t0 += block_size) {
        const int n = ctx - t0 < block_size ? ctx - t0 : block_size;  /* tokens of this block in context */
        const int j0 = t0 < lo ? lo - t0 : 0;  /* the window's first block: its tokens before lo are not seen */
        const int64_t base = (int64_t)table[t0 / block_size] * block_stride + (int64_t)kvh * head_dim;
        const int64_t ahead = ahead_base(table, t0, ctx, block_size, block_stride, (int64_t)kvh * head_dim, next);
        for (int j = j0; j < n; j++) {  /* widen the block's rows once for all heads of the group */
            if (ahead >= 0) prefetch_row(k_cache, v_cache, ahead + j * token_stride, row_bytes, kv_elem);
            load_row(kb[j], (const char *)k_cache + (base + j * token_stride) * kv_elem, head_dim, kv_bf16);
        }
        for (int j = j0; j < n; j++)
            load_row(vb[j], (const char *)v_cache + (base + j * token_stride) * kv_elem, head_dim, kv_bf16);
        for (int g = 0; g < group; g++) {
            float sc[MAX_BLOCK], bmax = -FLT_MAX;
            for (int j = j0; j < n; j++) {
                float dot = 0.0f;
                #pragma omp simd reduction(+:dot)
                for (int d = 0; d < head_dim; d++) dot += q[g][d] * kb[j][d];
                sc[j] = dot;
                bmax = dot > bmax ? dot : bmax;
            }
            /* online softmax: one rescale per block when the running max grows */
            if (bmax > m[g]) {
                const float c = expf(m[g] - bmax);  /* underflows to 0 for the first block */
                l[g] *= c;
                for (int d = 0; d < head_dim; d++) acc[g][d] *= c;
                m[g] = bmax;
            }
            float psum = 0.0f;
            for (int j = j0; j < n; j++) {  /* a loop of its own so that expf vectorizes over the block */
                sc[j] = expf(sc[j] - m[g]);
                psum += sc[j];
            }
            l[g] += psum;
            for (int j = j0; j < n; j++)
                for (int d = 0; d < head_dim; d++) acc[g][d] += sc[j] * vb[j][d];
        }
    }
    finish_item(out, acc, m, l, s, kvh, group, num_q_heads, head_dim, ctx - lo, is_bf16, keys.partial);
}

#ifdef HAVE_AVX512
/* The AVX-512 path for head_dim 64 and 128 (SmolLM2, Llama, Qwen2). Why intrinsics: the portable loop above computes
 * one q.k dot product at a time and reduces each 16-lane vector horizontally (a shuffle tree per token), which made
 * the kernel compute-bound at about a third of the core's FMA rate. Here 16 tokens' lane vectors are reduced
 * together by one transpose-and-add tree (hsum16: 45 ops for 16 dot products), the scores stay in one register for
 * the max and the masking, and with AVX512_BF16 the bf16 q.k products come from VDPBF16PS straight off the cache
 * rows (exact bf16 products, fp32 sums; no widening). P.V stays in fp32 as in the portable path. */

/* 16 bf16 -> 16 fp32, exact (bits << 16). */
static inline __m512 widen16(const void *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512 load16(const void *p, int is_bf16) {
    return is_bf16 ? widen16(p) : _mm512_loadu_ps(p);
}

/* Lane j of the result = the sum of v[j]'s 16 lanes. Unpacks pair tokens inside 128-bit lanes, then 64-bit
 * unpacks make each 128-bit lane hold 4 tokens' partial sums, then 128-bit shuffles add the 4 lanes. */
static inline __m512 hsum16(const __m512 *v) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Same contract as attend_item, for head_dim HD in {64, 128} (a compile-time constant at each call). Tokens go 16
 * at a time (a block of 32 or 64 in chunks of 16; a smaller block, or the context's tail, as a partial chunk whose
 * missing lanes are masked: rows past the context are never read). The window's first block starts its chunks at
 * the window's first token. */
static inline __attribute__((always_inline)) void attend_item_avx512(
        const void *query, const void *k_cache, const void *v_cache, const int32_t *block_tables, Keys keys,
        void *out, int s, int kvh, int group, int num_q_heads, const int HD, int block_size, int max_blocks,
        int64_t block_stride, int64_t token_stride, int64_t q_stride, float scale, int is_bf16, int kv_bf16,
        NextItem next) {
    enum { NC_MAX = MAX_HEAD_DIM / 16 };
    const int NC = HD / 16;
    const size_t elem = is_bf16 ? 2 : 4, kv_elem = kv_bf16 ? 2 : 4;
    const int ctx = keys.hi, lo = keys.lo;  /* ctx: the range's end (the context's, unsplit) */
    float acc[MAX_GROUP][MAX_HEAD_DIM] __attribute__((aligned(64))), m[MAX_GROUP], l[MAX_GROUP];
    float vb[16][MAX_HEAD_DIM] __attribute__((aligned(64)));
    __m512 qf[MAX_GROUP][NC_MAX];
#ifdef __AVX512BF16__
    __m512i qb[MAX_GROUP][NC_MAX / 2];
#endif
    for (int g = 0; g < group; g++) {
        const char *qrow = (const char *)query + ((size_t)s * q_stride + (size_t)(kvh * group + g) * HD) * elem;
        for (int c = 0; c < NC; c++) {
            qf[g][c] = load16(qrow + c * 16 * elem, is_bf16);
            _mm512_store_ps(acc[g] + 16 * c, _mm512_setzero_ps());
        }
#ifdef __AVX512BF16__
        if (is_bf16 && kv_bf16)
            for (int c = 0; c < NC / 2; c++) qb[g][c] = _mm512_loadu_si512(qrow + c * 64);
#endif
        m[g] = -FLT_MAX;
        l[g] = 0.0f;
    }
    const int32_t *table = block_tables + (size_t)s * max_blocks;
    const __m512 vscale = _mm512_set1_ps(scale), vlow = _mm512_set1_ps(-FLT_MAX);
    for (int t0 = lo - lo % block_size; t0 < ctx; t0 += block_size) {
        const int in_block = ctx - t0 < block_size ? ctx - t0 : block_size;
        const int64_t base = (int64_t)table[t0 / block_size] * block_stride + (int64_t)kvh * HD;
        const int64_t ahead = ahead_base(table, t0, ctx, block_size, block_stride, (int64_t)kvh * HD, next);
        for (int c0 = t0 < lo ? lo - t0 : 0; c0 < in_block; c0 += 16) {
            const int n = in_block - c0 < 16 ? in_block - c0 : 16;
            const __mmask16 live = (__mmask16)((1u << n) - 1u);
            const char *krow[16];
            const float *vrow[16];
            for (int j = 0; j < n; j++) {
                const int64_t row = base + (int64_t)(c0 + j) * token_stride;
                krow[j] = (const char *)k_cache + row * kv_elem;
                if (ahead >= 0)
                    prefetch_row(k_cache, v_cache, ahead + (int64_t)(c0 + j) * token_stride, HD * kv_elem, kv_elem);
                if (kv_bf16) {  /* widen each V row once for all heads of the group */
                    for (int c = 0; c < NC; c++)
                        _mm512_store_ps(vb[j] + 16 * c, widen16((const char *)v_cache + row * kv_elem + c * 32));
                    vrow[j] = vb[j];
                } else {
                    vrow[j] = (const float *)v_cache + row;
                }
            }
            for (int g = 0; g < group; g++) {
                __m512 lanes[16];
                for (int j = 0; j < 16; j++) {
                    if (j >= n) { lanes[j] = _mm512_setzero_ps(); continue; }
#ifdef __AVX512BF16__
                    if (is_bf16 && kv_bf16) {
                        __m512 d = _mm512_setzero_ps();
                        for (int c = 0; c < NC / 2; c++)
                            d = _mm512_dpbf16_ps(d, (__m512bh)qb[g][c], (__m512bh)_mm512_loadu_si512(krow[j] + c * 64));
                        lanes[j] = d;
                        continue;
                    }
#endif
                    __m512 d = _mm512_mul_ps(qf[g][0], load16(krow[j], kv_bf16));
                    for (int c = 1; c < NC; c++)
                        d = _mm512_fmadd_ps(qf[g][c], load16(krow[j] + c * 16 * kv_elem, kv_bf16), d);
                    lanes[j] = d;
                }
                const __m512 sc = _mm512_mask_mov_ps(vlow, live, _mm512_mul_ps(hsum16(lanes), vscale));
                const float cmax = _mm512_reduce_max_ps(sc);
                if (cmax > m[g]) {  /* online softmax: one rescale per chunk when the running max grows */
                    const float r = expf(m[g] - cmax);
                    l[g] *= r;
                    for (int c = 0; c < NC; c++)
                        _mm512_store_ps(acc[g] + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc[g] + 16 * c), _mm512_set1_ps(r)));
                    m[g] = cmax;
                }
                float p[16] __attribute__((aligned(64)));
                /* dead lanes at 0 before expf, as in the AVX2 path: -FLT_MAX - m takes libmvec's scalar fallback */
                _mm512_store_ps(p, _mm512_maskz_sub_ps(live, sc, _mm512_set1_ps(m[g])));
                for (int j = 0; j < 16; j++) p[j] = expf(p[j]);  /* vectorized by the compiler (libmvec) */
                const __m512 pv = _mm512_maskz_mov_ps(live, _mm512_load_ps(p));
                l[g] += _mm512_reduce_add_ps(pv);
                _mm512_store_ps(p, pv);
                __m512 a[NC_MAX];
                for (int c = 0; c < NC; c++) a[c] = _mm512_load_ps(acc[g] + 16 * c);
                for (int j = 0; j < n; j++) {
                    const __m512 pj = _mm512_set1_ps(p[j]);
                    for (int c = 0; c < NC; c++) a[c] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vrow[j] + 16 * c), a[c]);
                }
                for (int c = 0; c < NC; c++) _mm512_store_ps(acc[g] + 16 * c, a[c]);
            }
        }
    }
    finish_item(out, acc, m, l, s, kvh, group, num_q_heads, HD, ctx - lo, is_bf16, keys.partial);
}
#endif

#ifdef HAVE_AVX2
/* The AVX2 path for head_dim 64 and 128, the AVX-512 path's structure at 8 lanes: the portable loop's one dot product
 * and one horizontal reduction per token left the avx2 build compute-bound at 7 GB/s of K/V (2-core AMD EPYC VM, fp32,
 * 16-64 sequences x 256 tokens: a third of the machine's read rate). Here 8 tokens' lane vectors are reduced together
 * (hsum8: 6 horizontal adds, 2 lane permutes, 1 add for 8 dot products), and the chunk's scores stay in a register
 * for the max and the masking. bf16 rows are widened exactly (bits << 16); P.V in fp32, as everywhere. */

static inline __m256 widen8(const void *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline __m256 load8(const void *p, int is_bf16) {
    return is_bf16 ? widen8(p) : _mm256_loadu_ps(p);
}

/* Lane j of the result = the sum of v[j]'s 8 lanes. */
static inline __m256 hsum8(const __m256 *v) {
    const __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);  /* per 128-bit lane: 4 partial sums */
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float hadd8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* Same contract as attend_item, for head_dim HD in {64, 128} (a compile-time constant at each call). Tokens go 8 at
 * a time; a block's (or the context's) last partial chunk masks its missing lanes, whose rows are never read. The
 * window's first block starts its chunks at the window's first token. */
static inline __attribute__((always_inline)) void attend_item_avx2(
        const void *query, const void *k_cache, const void *v_cache, const int32_t *block_tables, Keys keys,
        void *out, int s, int kvh, int group, int num_q_heads, const int HD, int block_size, int max_blocks,
        int64_t block_stride, int64_t token_stride, int64_t q_stride, float scale, int is_bf16, int kv_bf16,
        NextItem next) {
    enum { NC_MAX = 128 / 8, PV = 8 };  /* HD <= 128 here; P.V in passes of PV vectors (AVX2 has 16 registers) */
    const int NC = HD / 8;
    const size_t elem = is_bf16 ? 2 : 4, kv_elem = kv_bf16 ? 2 : 4;
    const int ctx = keys.hi, lo = keys.lo;  /* ctx: the range's end (the context's, unsplit) */
    float acc[MAX_GROUP][MAX_HEAD_DIM] __attribute__((aligned(32))), m[MAX_GROUP], l[MAX_GROUP];
    float kb[8][MAX_HEAD_DIM] __attribute__((aligned(32))), vb[8][MAX_HEAD_DIM] __attribute__((aligned(32)));
    __m256 qf[MAX_GROUP][NC_MAX];
    for (int g = 0; g < group; g++) {
        const char *qrow = (const char *)query + ((size_t)s * q_stride + (size_t)(kvh * group + g) * HD) * elem;
        for (int c = 0; c < NC; c++) {
            qf[g][c] = load8(qrow + c * 8 * elem, is_bf16);
            _mm256_store_ps(acc[g] + 8 * c, _mm256_setzero_ps());
        }
        m[g] = -FLT_MAX;
        l[g] = 0.0f;
    }
    const int32_t *table = block_tables + (size_t)s * max_blocks;
    const __m256 vscale = _mm256_set1_ps(scale), vlow = _mm256_set1_ps(-FLT_MAX);
    const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    for (int t0 = lo - lo % block_size; t0 < ctx; t0 += block_size) {
        const int in_block = ctx - t0 < block_size ? ctx - t0 : block_size;
        const int64_t base = (int64_t)table[t0 / block_size] * block_stride + (int64_t)kvh * HD;
        const int64_t ahead = ahead_base(table, t0, ctx, block_size, block_stride, (int64_t)kvh * HD, next);
        for (int c0 = t0 < lo ? lo - t0 : 0; c0 < in_block; c0 += 8) {
            const int n = in_block - c0 < 8 ? in_block - c0 : 8;
            const __m256 live = _mm256_cmp_ps(iota, _mm256_set1_ps((float)n), _CMP_LT_OQ);
            const float *krow[8], *vrow[8];
            for (int j = 0; j < n; j++) {
                const int64_t row = base + (int64_t)(c0 + j) * token_stride;
                if (ahead >= 0)
                    prefetch_row(k_cache, v_cache, ahead + (int64_t)(c0 + j) * token_stride, HD * kv_elem, kv_elem);
                if (kv_bf16) {  /* widen each K and V row once for all heads of the group (compute-bound) */
                    for (int c = 0; c < NC; c++) {
                        _mm256_store_ps(kb[j] + 8 * c, widen8((const char *)k_cache + row * kv_elem + c * 16));
                        _mm256_store_ps(vb[j] + 8 * c, widen8((const char *)v_cache + row * kv_elem + c * 16));
                    }
                    krow[j] = kb[j];
                    vrow[j] = vb[j];
                } else {
                    krow[j] = (const float *)k_cache + row;
                    vrow[j] = (const float *)v_cache + row;
                }
            }
            for (int g = 0; g < group; g++) {
                __m256 lanes[8];
                for (int j = 0; j < 8; j++) {
                    if (j >= n) { lanes[j] = _mm256_setzero_ps(); continue; }
                    __m256 d = _mm256_mul_ps(qf[g][0], _mm256_loadu_ps(krow[j]));
                    for (int c = 1; c < NC; c++) d = _mm256_fmadd_ps(qf[g][c], _mm256_loadu_ps(krow[j] + 8 * c), d);
                    lanes[j] = d;
                }
                const __m256 sc = _mm256_blendv_ps(vlow, _mm256_mul_ps(hsum8(lanes), vscale), live);
                const float cmax = hmax8(sc);
                if (cmax > m[g]) {  /* online softmax: one rescale per chunk when the running max grows */
                    const __m256 r = _mm256_set1_ps(expf(m[g] - cmax));
                    l[g] *= _mm256_cvtss_f32(r);
                    for (int c = 0; c < NC; c++)
                        _mm256_store_ps(acc[g] + 8 * c, _mm256_mul_ps(_mm256_load_ps(acc[g] + 8 * c), r));
                    m[g] = cmax;
                }
                float p[8] __attribute__((aligned(32)));
                /* dead lanes at 0 before expf: -FLT_MAX - m would take libmvec's scalar fallback */
                _mm256_store_ps(p, _mm256_and_ps(live, _mm256_sub_ps(sc, _mm256_set1_ps(m[g]))));
                for (int j = 0; j < 8; j++) p[j] = expf(p[j]);  /* vectorized by the compiler (libmvec) */
                const __m256 pv = _mm256_and_ps(live, _mm256_load_ps(p));
                l[g] += hadd8(pv);
                _mm256_store_ps(p, pv);
                for (int c0 = 0; c0 < NC; c0 += PV) {  /* head_dim 128: two passes, else the 16 + 1 vectors spill */
                    __m256 a[PV];
                    for (int c = 0; c < PV; c++) a[c] = _mm256_load_ps(acc[g] + 8 * (c0 + c));
                    for (int j = 0; j < n; j++) {
                        const __m256 pj = _mm256_set1_ps(p[j]);
                        for (int c = 0; c < PV; c++)
                            a[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vrow[j] + 8 * (c0 + c)), a[c]);
                    }
                    for (int c = 0; c < PV; c++) _mm256_store_ps(acc[g] + 8 * (c0 + c), a[c]);
                }
            }
        }
    }
    finish_item(out, acc, m, l, s, kvh, group, num_q_heads, HD, ctx - lo, is_bf16, keys.partial);
}
#endif

/* out[s, h, :] = softmax(scale * q[s, h, :] . K[s, lo:ctx, h / group, :]) . V[s, lo:ctx, h / group, :]
 *
 * lo = max(0, ctx - sliding_window) with sliding_window >= 1, else 0 (window_start): HF's sliding-window mask.
 * query: [num_seqs, num_q_heads, head_dim], fp32 or bf16 (is_bf16), heads dense within a sequence, sequences
 *     q_stride elements apart (the model's q is a view of its fused qkv rows: no copy to make it contiguous).
 * out: [num_seqs, num_q_heads, head_dim], contiguous, the query's dtype.
 * k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], fp32 or bf16 (kv_bf16) whatever the query's
 *     dtype (a bf16 cache under fp32 compute: half the bytes read, widened exactly); a block is dense, blocks are
 *     `block_stride` elements apart (a per-layer view of a cache holding all layers is strided in dim 0).
 * block_tables: [num_seqs, max_blocks] int32, contiguous; context_lens: [num_seqs] int32 (>= 1 each).
 * Work units are (sequence, kv head) pairs, or ranges of their keys when there are few (paged_decode_attention_for),
 * split statically over `num_threads` OpenMP threads.
 * A sequence with context_len <= 0 gets zeros (the caller never sends one; defined rather than NaN).
 * Returns the first sequence whose context needs more than max_blocks blocks or whose table names a block outside
 * [0, num_blocks) among those its window reads, having computed nothing, or -1. Checked here rather than by the
 * caller: a pass over the tables is free next to the attention, and the wrapper's host-side max of context_lens cost
 * a microsecond per layer. */
int paged_decode_attention(const void *query, const void *k_cache, const void *v_cache,
                           const int32_t *block_tables, const int32_t *context_lens, void *out,
                           int num_seqs, int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                           int max_blocks, int64_t block_stride, int64_t q_stride, float scale, int sliding_window,
                           int is_bf16, int kv_bf16, int num_threads, int64_t num_blocks) {
    const int bad = paged_decode_attention_check(block_tables, context_lens, num_seqs, block_size, max_blocks,
                                                 sliding_window, num_blocks);
    if (bad >= 0) return bad;
    /* the split items' scratch; without it (no memory) nothing is split: the same attention, other last bits */
    const int64_t floats = pdserve_attention_partials(num_seqs, num_kv_heads, num_q_heads / num_kv_heads, head_dim);
    float *partials = floats > 0 ? malloc((size_t)floats * sizeof(float)) : NULL;
    #pragma omp parallel num_threads(num_threads)
    paged_decode_attention_for(query, k_cache, v_cache, block_tables, context_lens, out, num_seqs, num_q_heads,
                               num_kv_heads, head_dim, block_size, max_blocks, block_stride, q_stride, scale,
                               sliding_window, is_bf16, kv_bf16, partials);
    free(partials);
    return -1;
}

/* The first sequence whose context needs more than max_blocks blocks or whose table names a block outside
 * [0, num_blocks) among those its window reads, or -1: paged_decode_attention's check. With sliding_window 0 it
 * covers every window (a window reads a subset of the context's blocks). */
int paged_decode_attention_check(const int32_t *block_tables, const int32_t *context_lens, int num_seqs,
                                 int block_size, int max_blocks, int sliding_window, int64_t num_blocks) {
    for (int s = 0; s < num_seqs; s++) {
        const int ctx = context_lens[s];
        if (ctx > (int64_t)max_blocks * block_size) return s;
        for (int b = window_start(ctx, sliding_window) / block_size; b < (ctx + block_size - 1) / block_size; b++) {
            const int32_t block = block_tables[(size_t)s * max_blocks + b];
            if (block < 0 || block >= num_blocks) return s;
        }
    }
    return -1;
}

/* paged_decode_attention's work on tables that passed its check, as orphaned worksharing loops: run by every thread of
 * the enclosing OpenMP region (or alone outside one), no barrier at the end (cpu_decode_step.c holds one region over a
 * whole step). Units are (sequence, kv head, split) triples in order; with partials (pdserve_attention_partials floats,
 * or NULL: nothing split) and fewer than PDSERVE_SPLIT_UNITS items, each item's keys go as several units, and after
 * a barrier the items' states are merged. Why: at batch 1 SmolLM2 has 3 items (kv heads) for 2 threads, and one
 * thread idled a third of the attention (perf: 22% of a 1-row step's samples in OpenMP waits at contexts of 100-800
 * tokens). The split depends on the batch alone: the same bits whatever the thread count. */
void paged_decode_attention_for(const void *query, const void *k_cache, const void *v_cache,
                                const int32_t *block_tables, const int32_t *context_lens, void *out, int num_seqs,
                                int num_q_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
                                int64_t block_stride, int64_t q_stride, float scale, int sliding_window,
                                int is_bf16, int kv_bf16, float *partials) {
    const int group = num_q_heads / num_kv_heads, items = num_seqs * num_kv_heads;
    const int splits = partials != NULL ? pdserve_attention_splits(items) : 1, units = items * splits;
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim, unit_floats = partial_floats(group, head_dim);
    #pragma omp for schedule(static) nowait
    for (int u = 0; u < units; u++) {
        const int item = u / splits, s = item / num_kv_heads, kvh = item % num_kv_heads;
        Keys keys = split_keys(context_lens[s], sliding_window, u % splits, splits);
        if (splits > 1) keys.partial = partials + (int64_t)u * unit_floats;
        NextItem next = {NULL, 0, 0};
        if (u + 1 < units) {
            const int item2 = (u + 1) / splits, s2 = item2 / num_kv_heads;
            const Keys keys2 = split_keys(context_lens[s2], sliding_window, (u + 1) % splits, splits);
            const int first = keys2.lo / block_size;
            next = (NextItem){block_tables + (size_t)s2 * max_blocks + first, keys2.hi - first * block_size,
                              (int64_t)(item2 % num_kv_heads) * head_dim};
        }
#define ATTEND(HD, BF16, KV_BF16) attend_item(query, k_cache, v_cache, block_tables, keys, out, s, kvh, group, \
        num_q_heads, HD, block_size, max_blocks, block_stride, token_stride, q_stride, scale, BF16, KV_BF16, next)
/* head_dim 64 and 128 as compile-time constants: the AVX-512 or AVX2 path where the build has it, else the plain
 * loops */
#ifdef HAVE_AVX512
#define ATTEND_FIXED(HD, BF16, KV_BF16) attend_item_avx512(query, k_cache, v_cache, block_tables, keys, out, s, kvh, \
        group, num_q_heads, HD, block_size, max_blocks, block_stride, token_stride, q_stride, scale, BF16, KV_BF16, \
        next)
#elif defined(HAVE_AVX2)
#define ATTEND_FIXED(HD, BF16, KV_BF16) attend_item_avx2(query, k_cache, v_cache, block_tables, keys, out, s, kvh, \
        group, num_q_heads, HD, block_size, max_blocks, block_stride, token_stride, q_stride, scale, BF16, KV_BF16, \
        next)
#else
#define ATTEND_FIXED ATTEND
#endif
        /* the storage dtypes as compile-time constants too: bf16 or fp32 throughout, or an fp32 query over a bf16
         * cache (--kv-cache-dtype bfloat16 under fp32 weights); a bf16 query over an fp32 cache, the plain loops */
        const int form = is_bf16 ? (kv_bf16 ? 1 : -1) : (kv_bf16 ? 2 : 0);
        if (head_dim == 64 && form >= 0) {
            if (form == 1) ATTEND_FIXED(64, 1, 1); else if (form == 2) ATTEND_FIXED(64, 0, 1);
            else ATTEND_FIXED(64, 0, 0);
        } else if (head_dim == 128 && form >= 0) {
            if (form == 1) ATTEND_FIXED(128, 1, 1); else if (form == 2) ATTEND_FIXED(128, 0, 1);
            else ATTEND_FIXED(128, 0, 0);
        } else {
            ATTEND(head_dim, is_bf16, kv_bf16);
        }
#undef ATTEND_FIXED
#undef ATTEND
    }
    if (splits > 1) {
        #pragma omp barrier
        #pragma omp for schedule(static) nowait
        for (int item = 0; item < items; item++)
            merge_item(partials + (int64_t)item * splits * unit_floats, splits, out, item / num_kv_heads,
                       item % num_kv_heads, group, num_q_heads, head_dim, is_bf16);
    }
}
