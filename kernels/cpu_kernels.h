/* The C kernels' entry points (cpu_decode.c, cpu_layer_ops.c, cpu_linear.c), as the torch ops of cpu_ops.cpp call them.
 *
 * setup.py compiles the C sources once per ISA level (base, avx2, avx512, avx512_bf16 on x86; base elsewhere), each
 * with that level's -m flags and -DPDSERVE_ISA=<level>, and links every build into the one extension kernels/_C;
 * cpu_ops.cpp picks a build at run time from the CPU's features. So that the builds can share a library, each build's
 * entry points carry its level as a suffix (paged_decode_attention_avx2): the sources keep the plain names, which
 * this header renames when PDSERVE_ISA is set. Everything else in the sources is static.
 *
 * Tensors are passed as host pointers with their sizes and strides (in elements unless named bytes); the contracts
 * are at each definition. is_bf16: the rows are bf16, else fp32.
 */
#ifndef PDSERVE_CPU_KERNELS_H
#define PDSERVE_CPU_KERNELS_H

#include <stdint.h>

#define PDSERVE_PASTE(name, isa) name##_##isa
#define PDSERVE_ISA_NAME(name, isa) PDSERVE_PASTE(name, isa)

/* The prototypes of one level's build. */
#define PDSERVE_DECLARE_KERNELS(isa)                                                                                 \
    int PDSERVE_ISA_NAME(paged_decode_attention, isa)(                                                               \
        const void *query, const void *k_cache, const void *v_cache, const int32_t *block_tables,                    \
        const int32_t *context_lens, void *out, int num_seqs, int num_q_heads, int num_kv_heads, int head_dim,       \
        int block_size, int max_blocks, int64_t block_stride, int64_t q_stride, float scale, int sliding_window,      \
        int is_bf16, int num_threads, int64_t num_blocks);                                                           \
    void PDSERVE_ISA_NAME(rms_norm, isa)(const void *x, void *residual, const void *weight, void *out, int rows,     \
                                         int dim, int64_t x_stride, float eps, int is_bf16, int num_threads);        \
    void PDSERVE_ISA_NAME(silu_and_mul, isa)(const void *gate_up, void *out, int rows, int inter, int is_bf16,       \
                                             int num_threads);                                                       \
    int PDSERVE_ISA_NAME(rotary_and_write_kv, isa)(                                                                  \
        void *qkv, const void *cos_t, const void *sin_t, char *k_cache, char *v_cache, const int64_t *slot_mapping,  \
        int tokens, int num_heads, int num_kv_heads, int head_dim, int64_t token_stride, int block_size,             \
        int64_t block_stride, int64_t num_blocks, int is_bf16, int num_threads);                                     \
    void PDSERVE_ISA_NAME(causal_softmax_bf16, isa)(uint16_t *scores, int64_t num_rows, int rows, int end,           \
                                                    float scale, int num_threads);                                   \
    void PDSERVE_ISA_NAME(linear_small_m, isa)(const float *x, const float *w, const float *bias, float *y, int M,   \
                                               int N, int K, int64_t x_stride, int num_threads);

/* The stack arrays of cpu_decode.c bound what it takes; cpu_ops.py sends larger shapes to the torch reference. */
#define PDSERVE_MAX_GROUP 16    /* query heads per kv head */
#define PDSERVE_MAX_HEAD_DIM 256
#define PDSERVE_MAX_BLOCK 64    /* tokens per KV block */

#ifdef PDSERVE_ISA  /* compiling one level's build: declare its entry points, then rename the definitions to them */
PDSERVE_DECLARE_KERNELS(PDSERVE_ISA)
#define paged_decode_attention PDSERVE_ISA_NAME(paged_decode_attention, PDSERVE_ISA)
#define rms_norm PDSERVE_ISA_NAME(rms_norm, PDSERVE_ISA)
#define silu_and_mul PDSERVE_ISA_NAME(silu_and_mul, PDSERVE_ISA)
#define rotary_and_write_kv PDSERVE_ISA_NAME(rotary_and_write_kv, PDSERVE_ISA)
#define causal_softmax_bf16 PDSERVE_ISA_NAME(causal_softmax_bf16, PDSERVE_ISA)
#define linear_small_m PDSERVE_ISA_NAME(linear_small_m, PDSERVE_ISA)
#endif

#endif
