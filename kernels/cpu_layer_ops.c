/* The small per-token ops of a decoder layer on CPU: RMSNorm (with the residual add fused), RoPE in place,
 * SiLU-and-mul, and the KV-cache write.
 *
 * Why C: at batch 1 each of these is a handful of torch ops over a few KB, so the step's time goes to dispatching
 * them (RMSNorm alone is 8 ops, about 12-16 us a call on the AMD EPYC VM; 30 layers call it twice). One C call
 * each, through a torch op (cpu_ops.cpp), costs a few microseconds. Built into the same library as cpu_decode.c, once
 * per ISA level (setup.py, cpu_kernels.h).
 *
 * Numerics follow the torch reference (kernels/reference.py) step for step, including where it rounds to bf16 between
 * ops, so bf16 results match it bit for bit except where a sum is reassociated (the RMS's sum of squares) or libm's
 * expf differs from torch's by an ulp; fp32 differs in the last bits only. bf16 is widened exactly (bits << 16) and
 * rounded to nearest even, as torch's .to() does. 1/sqrt is taken in double: with -ffast-math, GCC turns the float
 * 1.0f / sqrtf into an approximate RSQRTSS and a Newton step.
 *
 * Rows of `dim` elements: fp32 when is_bf16 == 0, else bf16. Strides are in elements.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_kernels.h"

/* The value torch would hold after rounding an fp32 result to the tensor's dtype. */
static inline float round_to(float f, int is_bf16) { return is_bf16 ? bf16_to_f32(f32_to_bf16(f)) : f; }

static inline float load(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float f, int is_bf16) {
    if (is_bf16) ((uint16_t *)p)[i] = f32_to_bf16(f);
    else ((float *)p)[i] = f;
}

/* Each op's row (or token) body below is written once, as an always-inline function taking is_bf16, and compiled
 * once per dtype into a function that calls it with is_bf16 a constant (rms_norm_row_bf16 / _f32 and the like). The
 * compiler then drops load/store's dtype branches and vectorizes the loops (libmvec's expf included); with is_bf16 a
 * run-time value they stayed scalar, and RoPE over 64 tokens took 0.4-0.5 ms (one thread, Intel Xeon VM) where its
 * data is 100 KB. Those per-dtype functions are never inlined: the ops and their orphaned versions (end of file) call
 * the same ones, since two inlined copies may vectorize a sum or contract a multiply-add differently, and fp32
 * results must not depend on which ran (cpu_decode_step.c's logits equal the forward's). */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE void rms_norm_row(const void *x, void *residual, const void *weight, void *out, int r, int dim,
                                int64_t x_stride, float eps, const int is_bf16) {
    float s[dim];
    const int64_t xi = (int64_t)r * x_stride, ri = (int64_t)r * dim;
    for (int i = 0; i < dim; i++) s[i] = load(x, xi + i, is_bf16);
    if (residual) {
        for (int i = 0; i < dim; i++) {
            s[i] = round_to(s[i] + load(residual, ri + i, is_bf16), is_bf16);
            store(residual, ri + i, s[i], is_bf16);
        }
    }
    float ss = 0.0f;
    for (int i = 0; i < dim; i++) ss += s[i] * s[i];
    const float inv = (float)(1.0 / sqrt((double)(ss / (float)dim + eps)));
    for (int i = 0; i < dim; i++)
        store(out, ri + i, load(weight, i, is_bf16) * round_to(s[i] * inv, is_bf16), is_bf16);
}

static __attribute__((noinline)) void rms_norm_row_bf16(const void *x, void *residual, const void *weight, void *out,
                                                        int r, int dim, int64_t x_stride, float eps) {
    rms_norm_row(x, residual, weight, out, r, dim, x_stride, eps, 1);
}

static __attribute__((noinline)) void rms_norm_row_f32(const void *x, void *residual, const void *weight, void *out,
                                                       int r, int dim, int64_t x_stride, float eps) {
    rms_norm_row(x, residual, weight, out, r, dim, x_stride, eps, 0);
}

/* out[r] = weight * (s * rsqrt(mean(s^2) + eps)), s = x[r], or with a residual: residual[r] += x[r] (rounded to
 * the dtype) and s = residual[r]. The normalized row is rounded to the dtype before the weight multiplies it, as
 * HF's LlamaRMSNorm does. x: [rows, dim] with row stride x_stride; residual, out: [rows, dim] contiguous;
 * weight: [dim]. */
void rms_norm(const void *x, void *residual, const void *weight, void *out, int rows, int dim, int64_t x_stride,
              float eps, int is_bf16, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= 16)
    for (int r = 0; r < rows; r++)
        (is_bf16 ? rms_norm_row_bf16 : rms_norm_row_f32)(x, residual, weight, out, r, dim, x_stride, eps);
}

/* One token's heads. Each head's row is read into fp32, rotated into a second array and written back in loops of
 * their own: with the stores into qk in the rotating loop, the compiler could not prove they miss the arrays it
 * reads, and left that loop scalar. */
ALWAYS_INLINE void rotary_token(void *qk, const void *cos_t, const void *sin_t, int t, int heads, int head_dim,
                                int64_t token_stride, const int is_bf16) {
    const int half = head_dim / 2;
    const int64_t ci = (int64_t)t * head_dim;
    float c[head_dim], sn[head_dim], x[head_dim], y[head_dim];
    for (int i = 0; i < head_dim; i++) {
        c[i] = load(cos_t, ci + i, is_bf16);
        sn[i] = load(sin_t, ci + i, is_bf16);
    }
    for (int h = 0; h < heads; h++) {
        const int64_t b = (int64_t)t * token_stride + (int64_t)h * head_dim;
        for (int i = 0; i < head_dim; i++) x[i] = load(qk, b + i, is_bf16);
        for (int i = 0; i < half; i++) {
            y[i] = round_to(x[i] * c[i], is_bf16) + round_to(-x[i + half] * sn[i], is_bf16);
            y[i + half] = round_to(x[i + half] * c[i + half], is_bf16) + round_to(x[i] * sn[i + half], is_bf16);
        }
        for (int i = 0; i < head_dim; i++) store(qk, b + i, y[i], is_bf16);
    }
}

static __attribute__((noinline)) void rotary_token_bf16(void *qk, const void *cos_t, const void *sin_t, int t,
                                                        int heads, int head_dim, int64_t token_stride) {
    rotary_token(qk, cos_t, sin_t, t, heads, head_dim, token_stride, 1);
}

static __attribute__((noinline)) void rotary_token_f32(void *qk, const void *cos_t, const void *sin_t, int t,
                                                       int heads, int head_dim, int64_t token_stride) {
    rotary_token(qk, cos_t, sin_t, t, heads, head_dim, token_stride, 0);
}

/* Rotate-half RoPE in place: for each token t and head h, with x = qk[t, h, :], half = head_dim / 2,
 * x[i] <- x[i] * cos[t, i] - x[i + half] * sin[t, i] and x[i + half] <- x[i + half] * cos[t, i + half] +
 * x[i] * sin[t, i + half], each product rounded to the dtype, then the sum (the reference's x * cos +
 * rotate_half(x) * sin). qk: [tokens, heads, head_dim], heads dense within a token, tokens token_stride apart;
 * cos, sin: [tokens, head_dim] contiguous, in the dtype. */
static void rotary_embedding(void *qk, const void *cos_t, const void *sin_t, int tokens, int heads, int head_dim,
                             int64_t token_stride, int is_bf16, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens >= 16)
    for (int t = 0; t < tokens; t++)
        (is_bf16 ? rotary_token_bf16 : rotary_token_f32)(qk, cos_t, sin_t, t, heads, head_dim, token_stride);
}

ALWAYS_INLINE void silu_and_mul_row(const void *gate_up, void *out, int r, int inter, const int is_bf16) {
    const int64_t g = (int64_t)r * 2 * inter, o = (int64_t)r * inter;
    float silu[inter];
    for (int i = 0; i < inter; i++) {  /* a loop of its own so that expf vectorizes (libmvec) */
        const float x = load(gate_up, g + i, is_bf16);
        silu[i] = round_to(x / (1.0f + expf(-x)), is_bf16);
    }
    for (int i = 0; i < inter; i++) store(out, o + i, silu[i] * load(gate_up, g + inter + i, is_bf16), is_bf16);
}

static __attribute__((noinline)) void silu_and_mul_row_bf16(const void *gate_up, void *out, int r, int inter) {
    silu_and_mul_row(gate_up, out, r, inter, 1);
}

static __attribute__((noinline)) void silu_and_mul_row_f32(const void *gate_up, void *out, int r, int inter) {
    silu_and_mul_row(gate_up, out, r, inter, 0);
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i], silu(g) = g / (1 + exp(-g)) rounded to the dtype first
 * (F.silu's output). gate_up: [rows, 2 * inter] contiguous; out: [rows, inter] contiguous. */
void silu_and_mul(const void *gate_up, void *out, int rows, int inter, int is_bf16, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= 16)
    for (int r = 0; r < rows; r++) (is_bf16 ? silu_and_mul_row_bf16 : silu_and_mul_row_f32)(gate_up, out, r, inter);
}

/* n elements of a K or V row into its cache slot in the cache's dtype: copied when the dtypes match, else fp32 rounded
 * to bf16 (nearest even, as torch's .to() does: --kv-cache-dtype bfloat16 under fp32 weights) or bf16 widened. */
static inline void store_kv_row(char *dst, const char *src, int64_t n, int src_bf16, int dst_bf16) {
    if (src_bf16 == dst_bf16)
        memcpy(dst, src, (size_t)n * (src_bf16 ? 2 : 4));
    else
        for (int64_t i = 0; i < n; i++) store(dst, i, load(src, i, src_bf16), dst_bf16);
}

/* One token's K and V rows (each n = num_kv_heads * head_dim elements, V right after K in its fused qkv row) into its
 * cache slot, slot = block * block_size + offset, cache blocks block_stride bytes apart (a block's rows dense). */
static inline void write_kv_token(const char *key, char *k_cache, char *v_cache, int64_t slot, int64_t n,
                                  int block_size, int64_t block_stride, int is_bf16, int kv_bf16) {
    const int64_t at = (slot / block_size) * block_stride + (slot % block_size) * n * (kv_bf16 ? 2 : 4);
    store_kv_row(k_cache + at, key, n, is_bf16, kv_bf16);
    store_kv_row(v_cache + at, key + n * (is_bf16 ? 2 : 4), n, is_bf16, kv_bf16);
}

/* RoPE on the q and k heads of each token's fused q/k/v row, then its k and v heads into the token's cache slot:
 * rotary_embedding over heads [0, num_heads + num_kv_heads), then write_kv_token of heads [num_heads,
 * num_heads + num_kv_heads) as K and the last num_kv_heads as V. qkv: [tokens, num_heads + 2 * num_kv_heads,
 * head_dim], fp32 or bf16 (is_bf16), heads dense within a token, tokens token_stride elements apart; the caches
 * [num_blocks, block_size, num_kv_heads, head_dim] fp32 or bf16 (kv_bf16), blocks block_stride bytes apart. One call
 * where the model made two: at batch 1 each Python-to-C crossing costs a few microseconds per layer. Returns the
 * first token whose slot is outside [0, num_blocks * block_size), having changed nothing, or -1. */
int rotary_and_write_kv(void *qkv, const void *cos_t, const void *sin_t, char *k_cache, char *v_cache,
                        const int64_t *slot_mapping, int tokens, int num_heads, int num_kv_heads, int head_dim,
                        int64_t token_stride, int block_size, int64_t block_stride, int64_t num_blocks, int is_bf16,
                        int kv_bf16, int num_threads) {
    for (int t = 0; t < tokens; t++)
        if (slot_mapping[t] < 0 || slot_mapping[t] >= num_blocks * block_size) return t;
    rotary_embedding(qkv, cos_t, sin_t, tokens, num_heads + num_kv_heads, head_dim, token_stride, is_bf16,
                     num_threads);
    const int64_t elem = is_bf16 ? 2 : 4, n = (int64_t)num_kv_heads * head_dim;
    const char *key = (const char *)qkv + (int64_t)num_heads * head_dim * elem;
    for (int t = 0; t < tokens; t++)
        write_kv_token(key + t * token_stride * elem, k_cache, v_cache, slot_mapping[t], n, block_size, block_stride,
                       is_bf16, kv_bf16);
    return -1;
}

/* Causal softmax in place over one block of prefill scores (kernels/cpu_prefill.py): scores is [num_rows, end] bf16,
 * contiguous, row i being query row i % rows of the block (the GQA group's heads are stacked as blocks of `rows`),
 * whose last row sees all `end` keys; row r sees the first end - rows + r + 1. Each row becomes
 * softmax(scale * s) over the keys it sees, in fp32, rounded to bf16 once, with 0 for the keys it does not see:
 * what the torch path computes with its mask, mul, fp32 softmax and cast, in one pass. */
void causal_softmax_bf16(uint16_t *scores, int64_t num_rows, int rows, int end, float scale, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (num_rows >= 16)
    for (int64_t i = 0; i < num_rows; i++) {
        uint16_t *s = scores + i * (int64_t)end;
        const int visible = end - rows + (int)(i % rows) + 1;
        float e[visible];
        float m = -INFINITY;
        for (int j = 0; j < visible; j++) {
            e[j] = bf16_to_f32(s[j]) * scale;
            m = e[j] > m ? e[j] : m;
        }
        float sum = 0.0f;
        for (int j = 0; j < visible; j++) {  /* a loop of its own so that expf vectorizes (libmvec) */
            e[j] = expf(e[j] - m);
            sum += e[j];
        }
        const float inv = 1.0f / sum;
        for (int j = 0; j < visible; j++) s[j] = f32_to_bf16(e[j] * inv);
        memset(s + visible, 0, (size_t)(end - visible) * sizeof *s);
    }
}

/* ---- The ops above as orphaned worksharing loops over rows (tokens), for cpu_decode_step.c, which holds one
 * OpenMP region open over a whole decode step: each is run by every thread of the enclosing region (or alone
 * outside one) and ends without a barrier (the caller places them). Same numerics as the ops above; the slot
 * checks of rotary_and_write_kv are the caller's. ---- */

void rms_norm_for(const void *x, void *residual, const void *weight, void *out, int rows, int dim, int64_t x_stride,
                  float eps, int is_bf16) {
    #pragma omp for schedule(static) nowait
    for (int r = 0; r < rows; r++)
        (is_bf16 ? rms_norm_row_bf16 : rms_norm_row_f32)(x, residual, weight, out, r, dim, x_stride, eps);
}

void silu_and_mul_for(const void *gate_up, void *out, int rows, int inter, int is_bf16) {
    #pragma omp for schedule(static) nowait
    for (int r = 0; r < rows; r++) (is_bf16 ? silu_and_mul_row_bf16 : silu_and_mul_row_f32)(gate_up, out, r, inter);
}

/* rotary_and_write_kv's work per token, with every slot already checked to lie inside the cache. */
void rotary_and_write_kv_for(void *qkv, const void *cos_t, const void *sin_t, char *k_cache, char *v_cache,
                             const int64_t *slot_mapping, int tokens, int num_heads, int num_kv_heads, int head_dim,
                             int64_t token_stride, int block_size, int64_t block_stride, int is_bf16,
                             int kv_bf16) {
    const int64_t elem = is_bf16 ? 2 : 4, n = (int64_t)num_kv_heads * head_dim;
    #pragma omp for schedule(static) nowait
    for (int t = 0; t < tokens; t++) {
        (is_bf16 ? rotary_token_bf16 : rotary_token_f32)(qkv, cos_t, sin_t, t, num_heads + num_kv_heads, head_dim,
                                                         token_stride);
        const char *key = (const char *)qkv + (t * token_stride + (int64_t)num_heads * head_dim) * elem;
        write_kv_token(key, k_cache, v_cache, slot_mapping[t], n, block_size, block_stride, is_bf16, kv_bf16);
    }
}
