/* The C kernels' entry points (cpu_decode.c, cpu_layer_ops.c, cpu_linear.c, cpu_decode_step.c,
 * cpu_prefill_attention.c, cpu_int8_gemm.c), as the torch ops of cpu_ops.cpp call them.
 *
 * setup.py compiles the C sources once per ISA level (base, avx2, avx512, avx512_vnni, avx512_bf16 on x86; base
 * elsewhere), each with that level's -m flags and -DPDSERVE_ISA=<level>, and links every build into the one extension
 * kernels/_C; cpu_ops.cpp picks a build at run time from the CPU's features. So that the builds can share a library,
 * each build's entry points carry its level as a suffix (paged_decode_attention_avx2): the sources keep the plain
 * names, which this header renames when PDSERVE_ISA is set. Everything else in the sources is static.
 *
 * Tensors are passed as host pointers with their sizes and strides (in elements unless named bytes); the contracts
 * are at each definition. is_bf16: the rows are bf16, else fp32; kv_bf16: the KV cache is bf16, else fp32 (a bf16
 * cache under fp32 rows is --kv-cache-dtype bfloat16: rows rounded into it, widened out of it).
 */
#ifndef PDSERVE_CPU_KERNELS_H
#define PDSERVE_CPU_KERNELS_H

#include <stdint.h>

#define PDSERVE_PASTE(name, isa) name##_##isa
#define PDSERVE_ISA_NAME(name, isa) PDSERVE_PASTE(name, isa)

/* One all-decode step of a dense pre-norm decoder, for decode_step (cpu_decode_step.c): bf16 with weights in oneDNN's
 * packed layout (linear_packed_bf16_rows), or fp32 with nn.Linear's own [N, K] weights (linear_small_m_rows), with
 * the weights as GGUF blocks (linear_blocks_rows: weights the qs, weight_scales the scales of cpu_linear.c) or as
 * 7-bit integers (linear_w8a8_for: weights the packed wp [ceil(N / 16), K / 4, 16, 4] uint8, weight_scales the
 * w_scale [N] fp32). Per layer l the linears are 4 * l + 0..3: qkv, o, gate_up, down; every tensor in the step's
 * dtype unless named. Shapes: rows tokens (one per sequence), hidden H, num_heads * head_dim = Q, num_kv_heads *
 * head_dim = KV, intermediate I. */
typedef struct {
    int is_bf16;                            /* 1: bf16, packed weights; 0: fp32, plain weights or blocks */
    int weight_blocks;                      /* fp32 only: PDSERVE_Q4_1 / PDSERVE_Q8_0 blocks, PDSERVE_W8A8, 0: plain */
    int kv_bf16;                            /* the caches are bf16 (always with is_bf16), else fp32 */
    int layers, rows, hidden_size, num_heads, num_kv_heads, head_dim, intermediate;
    int block_size, max_blocks;             /* the caches' block size, the block table's width */
    int64_t block_stride;                   /* cache elements between blocks (every layer's cache alike) */
    void *const *k_caches, *const *v_caches;  /* [layers] of [num_blocks, block_size, num_kv_heads, head_dim],
                                                 kv_bf16's dtype */
    const void *const *weights;             /* [4 * layers]: packed (bf16), [N, K] (fp32) or qs (blocks) */
    const void *const *weight_scales;       /* [4 * layers]: the blocks' scales or w_scale (blocks, W8A8 only) */
    int max_k;                              /* the largest K of the linears (the blocks' and W8A8's buffers) */
    const int *padded_k;                    /* [4 * layers]: the packed weights' K padded (bf16 only) */
    const void *const *biases;              /* [4 * layers], NULL: none */
    const void *const *post_norm;           /* [layers] of [H]: the post-attention norm */
    const void *const *next_norm;           /* [layers] of [H]: the next layer's input norm, the final one last */
    const int *windows;                     /* [layers]: sliding window, 0 = none */
    const void *cos, *sin;                  /* [rows, head_dim] */
    const int64_t *slot_mapping;            /* [rows], every slot inside the caches (checked by the caller) */
    const int32_t *block_tables, *context_lens;  /* [rows, max_blocks], [rows]; checked by the caller */
    float eps, scale;
    void *residual;                         /* [rows, H], in: layer 0's residual stream; out: the last layer's */
    void *hidden;                           /* [rows, H], in: layer 0's normalised input; out: the final norm's */
    void *qkv, *attn, *proj, *gate_up, *act;  /* scratch: [rows, Q + 2 KV], [rows, Q], [rows, H], [rows, 2I],
                                                 [rows, I] */
} PdserveDecodeStep;

/* The prototypes of one level's build. */
#define PDSERVE_DECLARE_KERNELS(isa)                                                                                 \
    int PDSERVE_ISA_NAME(paged_decode_attention, isa)(                                                               \
        const void *query, const void *k_cache, const void *v_cache, const int32_t *block_tables,                    \
        const int32_t *context_lens, void *out, int num_seqs, int num_q_heads, int num_kv_heads, int head_dim,       \
        int block_size, int max_blocks, int64_t block_stride, int64_t q_stride, float scale, int sliding_window,      \
        int is_bf16, int kv_bf16, int num_threads, int64_t num_blocks);                                              \
    void PDSERVE_ISA_NAME(rms_norm, isa)(const void *x, void *residual, const void *weight, void *out, int rows,     \
                                         int dim, int64_t x_stride, float eps, int is_bf16, int num_threads);        \
    void PDSERVE_ISA_NAME(silu_and_mul, isa)(const void *gate_up, void *out, int rows, int inter, int is_bf16,       \
                                             int num_threads);                                                       \
    int PDSERVE_ISA_NAME(rotary_and_write_kv, isa)(                                                                  \
        void *qkv, const void *cos_t, const void *sin_t, char *k_cache, char *v_cache, const int64_t *slot_mapping,  \
        int tokens, int num_heads, int num_kv_heads, int head_dim, int64_t token_stride, int block_size,             \
        int64_t block_stride, int64_t num_blocks, int is_bf16, int kv_bf16, int num_threads);                        \
    void PDSERVE_ISA_NAME(causal_softmax_bf16, isa)(uint16_t *scores, int64_t num_rows, int rows, int end,           \
                                                    float scale, int num_threads);                                   \
    void PDSERVE_ISA_NAME(linear_small_m, isa)(const float *x, const float *w, const float *bias, float *y, int M,   \
                                               int N, int K, int64_t x_stride, int num_threads);                     \
    void PDSERVE_ISA_NAME(linear_packed_bf16, isa)(const uint16_t *x, int64_t x_stride, const uint16_t *w,          \
                                                   const uint16_t *bias, uint16_t *y, int M, int N, int K,           \
                                                   int padded_k, int num_threads);                                   \
    int PDSERVE_ISA_NAME(linear_blocks, isa)(const float *x, int64_t x_stride, const void *qs, const uint16_t *scales,\
                                             int format, const float *bias, float *y, int M, int N, int K,           \
                                             int num_threads);                                                       \
    int PDSERVE_ISA_NAME(decode_step, isa)(const PdserveDecodeStep *step, int num_threads);                          \
    int PDSERVE_ISA_NAME(prefill_attention, isa)(                                                                    \
        const void *query, const void *k_cache, const void *v_cache, const int32_t *cu_seqlens_q,                    \
        const int32_t *context_lens, const int32_t *block_tables, void *out, int num_seqs, int num_q_heads,          \
        int num_kv_heads, int head_dim, int block_size, int max_blocks, int64_t block_stride, int64_t q_stride,      \
        float scale, int is_bf16, int kv_bf16, int num_threads, int64_t num_blocks);                                 \
    /* orphaned worksharing versions (no region of their own, no closing barrier): cpu_decode_step.c's parts */      \
    int PDSERVE_ISA_NAME(paged_decode_attention_check, isa)(const int32_t *block_tables, const int32_t *context_lens, \
                                                            int num_seqs, int block_size, int max_blocks,            \
                                                            int sliding_window, int64_t num_blocks);                 \
    void PDSERVE_ISA_NAME(paged_decode_attention_for, isa)(                                                          \
        const void *query, const void *k_cache, const void *v_cache, const int32_t *block_tables,                    \
        const int32_t *context_lens, void *out, int num_seqs, int num_q_heads, int num_kv_heads, int head_dim,       \
        int block_size, int max_blocks, int64_t block_stride, int64_t q_stride, float scale, int sliding_window,      \
        int is_bf16, int kv_bf16, float *partials);                                                                  \
    void PDSERVE_ISA_NAME(rms_norm_for, isa)(const void *x, void *residual, const void *weight, void *out, int rows, \
                                             int dim, int64_t x_stride, float eps, int is_bf16);                     \
    void PDSERVE_ISA_NAME(silu_and_mul_for, isa)(const void *gate_up, void *out, int rows, int inter, int is_bf16);  \
    void PDSERVE_ISA_NAME(rotary_and_write_kv_for, isa)(                                                             \
        void *qkv, const void *cos_t, const void *sin_t, char *k_cache, char *v_cache, const int64_t *slot_mapping,  \
        int tokens, int num_heads, int num_kv_heads, int head_dim, int64_t token_stride, int block_size,             \
        int64_t block_stride, int is_bf16, int kv_bf16);                                                             \
    void PDSERVE_ISA_NAME(linear_packed_bf16_rows, isa)(const uint16_t *x, int64_t x_stride, const uint16_t *w,     \
                                                        const uint16_t *bias, uint16_t *y, int M, int N, int K,      \
                                                        int padded_k);                                               \
    void PDSERVE_ISA_NAME(linear_small_m_rows, isa)(const float *x, const float *w, const float *bias, float *y,     \
                                                    int M, int N, int K, int64_t x_stride);                          \
    void PDSERVE_ISA_NAME(linear_blocks_rows, isa)(const float *x, int64_t x_stride, const void *qs,                 \
                                                   const uint16_t *scales, int format, const float *bias, float *y,  \
                                                   int M, int N, int K, float *buf);                                 \
    float *PDSERVE_ISA_NAME(blocks_buffers, isa)(int max_k, int num_threads);                                      \
    void PDSERVE_ISA_NAME(linear_blocks_warm, isa)(const void *qs, const uint16_t *scales, int format, int M, int N, \
                                                   int K);                                                           \
    int PDSERVE_ISA_NAME(linear_w8a8, isa)(const float *x, int64_t x_stride, const uint8_t *wq,                      \
                                           const float *w_scale, const float *bias, float *y, int M, int N, int K,   \
                                           int num_threads);                                                         \
    void PDSERVE_ISA_NAME(linear_w8a8_for, isa)(const float *x, int64_t x_stride, const uint8_t *wq,                 \
                                                const float *w_scale, const float *bias, float *y, int M, int N,      \
                                                int K, int8_t *qx, float *sx);

/* The GGUF block formats linear_blocks reads (cpu_linear.c), and the floats of its per-thread buffer for rows of K
 * weights: one block of output features (at most BLOCK_ROWS_MAX), dequantized, the same block as a panel (AVX2's
 * panel kernel), and one row's scales.
 * PDSERVE_Q8_ACTIVATIONS, or'ed into a format: a one-row call computes as llama.cpp does (x quantized to 8 bits a
 * block, integer dot products). */
#define PDSERVE_Q4_1 1
#define PDSERVE_Q8_0 2
#define PDSERVE_BLOCKS_FORMAT 3
#define PDSERVE_Q8_ACTIVATIONS 4
#define BLOCK_ROWS_MAX 16  /* weight rows a thread dequantizes at a time (cpu_linear.c's blocks_features) */
#define BLOCKS_BUF_FLOATS(K) (2 * BLOCK_ROWS_MAX * (int64_t)(K) + (K) / 16)

/* linear_w8a8's (cpu_int8_gemm.c) quantization block of x along K: K must be a multiple of it; the floats of its
 * scales buffer for M rows of K (each block's scale, then one offset a row); decode_step's weight form for it (a bit
 * apart from the block formats and PDSERVE_Q8_ACTIVATIONS). */
#define PDSERVE_W8A8_BLOCK 64
#define PDSERVE_W8A8_GROUP 16  /* W's rows per packed group (cpu_int8_gemm.c's layout) */
#define W8A8_SX_FLOATS(M, K) ((size_t)(M) * ((K) / PDSERVE_W8A8_BLOCK + 1))
#define PDSERVE_W8A8 8

/* prefill_attention's refusals (cpu_prefill_attention.c); a sequence index >= 0 names a bad table. */
#define PREFILL_UNSUPPORTED (-2)  /* bf16 in a build without AVX512_BF16 or over an fp32 cache: the caller's path */
#define PREFILL_NO_MEMORY (-3)

/* The stack arrays of cpu_decode.c bound what it takes; cpu_ops.py sends larger shapes to the torch reference. */
#define PDSERVE_MAX_GROUP 16    /* query heads per kv head */
#define PDSERVE_MAX_HEAD_DIM 256
#define PDSERVE_MAX_BLOCK 64    /* tokens per KV block */

/* Paged decode attention's split keys (cpu_decode.c, paged_decode_attention_for): fewer than PDSERVE_SPLIT_UNITS
 * (sequence, kv head) items each go as ceil(PDSERVE_SPLIT_UNITS / items) ranges of their keys, whose partial softmax
 * states a merge combines. A function of the batch alone, never of the thread count. */
#define PDSERVE_SPLIT_UNITS 16
static inline int pdserve_attention_splits(int items) {
    return items >= PDSERVE_SPLIT_UNITS || items <= 0 ? 1 : (PDSERVE_SPLIT_UNITS + items - 1) / items;
}
/* Floats of scratch paged_decode_attention_for needs for the partial states of split items (0: none split): per
 * unit and query head of the group, its running max, its sum and its head_dim accumulators. */
static inline int64_t pdserve_attention_partials(int num_seqs, int num_kv_heads, int group, int head_dim) {
    const int items = num_seqs * num_kv_heads, splits = pdserve_attention_splits(items);
    return splits > 1 ? (int64_t)items * splits * group * (head_dim + 2) : 0;
}

#ifdef PDSERVE_ISA  /* compiling one level's build: declare its entry points, then rename the definitions to them */
PDSERVE_DECLARE_KERNELS(PDSERVE_ISA)
#define paged_decode_attention PDSERVE_ISA_NAME(paged_decode_attention, PDSERVE_ISA)
#define rms_norm PDSERVE_ISA_NAME(rms_norm, PDSERVE_ISA)
#define silu_and_mul PDSERVE_ISA_NAME(silu_and_mul, PDSERVE_ISA)
#define rotary_and_write_kv PDSERVE_ISA_NAME(rotary_and_write_kv, PDSERVE_ISA)
#define causal_softmax_bf16 PDSERVE_ISA_NAME(causal_softmax_bf16, PDSERVE_ISA)
#define linear_small_m PDSERVE_ISA_NAME(linear_small_m, PDSERVE_ISA)
#define linear_packed_bf16 PDSERVE_ISA_NAME(linear_packed_bf16, PDSERVE_ISA)
#define linear_packed_bf16_rows PDSERVE_ISA_NAME(linear_packed_bf16_rows, PDSERVE_ISA)
#define linear_small_m_rows PDSERVE_ISA_NAME(linear_small_m_rows, PDSERVE_ISA)
#define linear_blocks PDSERVE_ISA_NAME(linear_blocks, PDSERVE_ISA)
#define linear_blocks_rows PDSERVE_ISA_NAME(linear_blocks_rows, PDSERVE_ISA)
#define blocks_buffers PDSERVE_ISA_NAME(blocks_buffers, PDSERVE_ISA)
#define linear_blocks_warm PDSERVE_ISA_NAME(linear_blocks_warm, PDSERVE_ISA)
#define linear_w8a8 PDSERVE_ISA_NAME(linear_w8a8, PDSERVE_ISA)
#define linear_w8a8_for PDSERVE_ISA_NAME(linear_w8a8_for, PDSERVE_ISA)
#define decode_step PDSERVE_ISA_NAME(decode_step, PDSERVE_ISA)
#define prefill_attention PDSERVE_ISA_NAME(prefill_attention, PDSERVE_ISA)
#define paged_decode_attention_check PDSERVE_ISA_NAME(paged_decode_attention_check, PDSERVE_ISA)
#define paged_decode_attention_for PDSERVE_ISA_NAME(paged_decode_attention_for, PDSERVE_ISA)
#define rms_norm_for PDSERVE_ISA_NAME(rms_norm_for, PDSERVE_ISA)
#define silu_and_mul_for PDSERVE_ISA_NAME(silu_and_mul_for, PDSERVE_ISA)
#define rotary_and_write_kv_for PDSERVE_ISA_NAME(rotary_and_write_kv_for, PDSERVE_ISA)
#endif

#endif
