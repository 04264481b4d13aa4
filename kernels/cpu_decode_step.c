/* A whole all-decode step of a dense pre-norm decoder in one OpenMP region: every layer's ops as worksharing loops
 * separated by barriers, at a decode step's few rows: bf16 with weights in oneDNN's packed layout, or fp32 with
 * nn.Linear's own weights through the small-M kernel or with the weights as GGUF blocks (all cpu_linear.c), or as
 * 7-bit integers against 8-bit rows (`--quantization w8a8_int8`, cpu_int8_gemm.c).
 *
 * Why: at batch 1 a step of SmolLM2-135M is ~270 ops whose arithmetic is small (the linears read 212 MB of layer
 * weights, the rest is a few KB a layer); each op as a parallel region of its own pays for starting the region's
 * threads and joining them (about 12 us a linear on 2 AMD EPYC cores with spinning OpenMP threads), ~1.4 ms of a
 * ~7.8 ms step. Here the threads are started once a step and meet at a barrier between ops (what llama.cpp's CPU
 * backend does with its thread pool and graph). The ops are the same C bodies the separate ops run
 * (cpu_layer_ops.c, cpu_decode.c), in the same order as DecoderModel.forward and cpu_ops.cpp's decode_layers:
 *
 *   qkv = hidden W_qkv^T; RoPE on q, k and the step's K/V into the cache; attn = paged attention; proj = attn W_o^T;
 *   residual += proj, hidden = rms_norm(residual) * post_norm; gate_up = hidden W_gu^T; act = silu(gate) * up;
 *   proj = act W_down^T; residual += proj, hidden = rms_norm(residual) * next_norm.
 *
 * The per-row ops (norms, RoPE) have one row per sequence: at batch 1 one thread does them while the others wait at
 * the barrier (a 576-element norm is well under a microsecond). Numerics are the separate ops' exactly: each output
 * is computed by one thread in the same order, whatever the thread count.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_kernels.h"

/* The step's buffers: buf the calling thread's (weights as blocks), qx and sx shared by the threads (W8A8: x's
 * quantized rows and their scales, linear_w8a8_for's). */
typedef struct {
    float *buf;
    int8_t *qx;
    float *sx;
    float *partials;
} Scratch;

/* y [rows, N] = x [rows, K] W^T + b in the step's form; x rows K apart. The calling thread's share. */
static inline void linear(const PdserveDecodeStep *a, int i, const void *x, void *y, int N, int K, const Scratch *t) {
    if (a->is_bf16)
        linear_packed_bf16_rows(x, K, a->weights[i], a->biases[i], y, a->rows, N, K, a->padded_k[i]);
    else if (a->weight_blocks == PDSERVE_W8A8)
        linear_w8a8_for(x, K, a->weights[i], a->weight_scales[i], a->biases[i], y, a->rows, N, K, t->qx, t->sx);
    else if (a->weight_blocks)
        linear_blocks_rows(x, K, a->weights[i], a->weight_scales[i], a->weight_blocks, a->biases[i], y, a->rows, N, K,
                           t->buf);
    else
        linear_small_m_rows(x, a->weights[i], a->biases[i], y, a->rows, N, K, K);
}

/* Weights as blocks: prefetch the start of this thread's share of linear i (linear_blocks_warm), before the barrier
 * and the small ops that come ahead of it. */
static inline void warm(const PdserveDecodeStep *a, int i, int N, int K) {
    if (a->weight_blocks && a->weight_blocks != PDSERVE_W8A8 && i < 4 * a->layers)
        linear_blocks_warm(a->weights[i], a->weight_scales[i], a->weight_blocks, a->rows, N, K);
}

/* One layer, run by every thread of the enclosing region; t: its buffers. */
static void layer(const PdserveDecodeStep *a, int l, const Scratch *t) {
    const int rows = a->rows, H = a->hidden_size, D = a->head_dim, Q = a->num_heads * D, bf = a->is_bf16;
    const int kv_bf = a->kv_bf16;
    const int qkv_width = Q + 2 * a->num_kv_heads * D, I = a->intermediate;

    linear(a, 4 * l, a->hidden, a->qkv, qkv_width, H, t);
    warm(a, 4 * l + 1, H, Q);
    #pragma omp barrier
    rotary_and_write_kv_for(a->qkv, a->cos, a->sin, (char *)a->k_caches[l], (char *)a->v_caches[l], a->slot_mapping,
                            rows, a->num_heads, a->num_kv_heads, D, qkv_width, a->block_size,
                            a->block_stride * (kv_bf ? 2 : 4), bf, kv_bf);
    #pragma omp barrier
    paged_decode_attention_for(a->qkv, a->k_caches[l], a->v_caches[l], a->block_tables, a->context_lens, a->attn,
                               rows, a->num_heads, a->num_kv_heads, D, a->block_size, a->max_blocks, a->block_stride,
                               qkv_width, a->scale, a->windows[l], bf, kv_bf, t->partials);
    #pragma omp barrier
    linear(a, 4 * l + 1, a->attn, a->proj, H, Q, t);
    warm(a, 4 * l + 2, 2 * I, H);
    #pragma omp barrier
    rms_norm_for(a->proj, a->residual, a->post_norm[l], a->hidden, rows, H, H, a->eps, bf);
    #pragma omp barrier
    linear(a, 4 * l + 2, a->hidden, a->gate_up, 2 * I, H, t);
    warm(a, 4 * l + 3, H, I);
    #pragma omp barrier
    silu_and_mul_for(a->gate_up, a->act, rows, I, bf);
    #pragma omp barrier
    linear(a, 4 * l + 3, a->act, a->proj, H, I, t);
    warm(a, 4 * l + 4, qkv_width, H);  /* the next layer's qkv */
    #pragma omp barrier
    rms_norm_for(a->proj, a->residual, a->next_norm[l], a->hidden, rows, H, H, a->eps, bf);
    #pragma omp barrier
}

/* Every layer of the step described by `step` (cpu_kernels.h: PdserveDecodeStep), num_threads threads. The caller
 * has checked the slots, block tables and shapes (cpu_ops.cpp). Returns 0, or -1 with nothing computed when the
 * blocks', W8A8's or the split attention's buffers could not be allocated. */
int decode_step(const PdserveDecodeStep *step, int num_threads) {
    const int w8a8 = step->weight_blocks == PDSERVE_W8A8, blocks = step->weight_blocks && !w8a8;
    float *bufs = blocks ? blocks_buffers(step->max_k, num_threads) : NULL;
    int8_t *qx = w8a8 ? malloc((size_t)step->rows * step->max_k) : NULL;
    float *sx = w8a8 ? malloc(W8A8_SX_FLOATS(step->rows, step->max_k) * sizeof(float)) : NULL;
    const int64_t split = pdserve_attention_partials(step->rows, step->num_kv_heads,
                                                     step->num_heads / step->num_kv_heads, step->head_dim);
    float *partials = split > 0 ? malloc((size_t)split * sizeof(float)) : NULL;  /* shared: each unit its own part */
    if ((blocks && bufs == NULL) || (w8a8 && (qx == NULL || sx == NULL)) || (split > 0 && partials == NULL)) {
        free(bufs);
        free(qx);
        free(sx);
        free(partials);
        return -1;
    }
    #pragma omp parallel num_threads(num_threads)
    {
        const Scratch t = {bufs ? bufs + (size_t)omp_get_thread_num() * BLOCKS_BUF_FLOATS(step->max_k) : NULL, qx, sx,
                           partials};
        for (int l = 0; l < step->layers; l++) layer(step, l, &t);
    }
    free(bufs);
    free(qx);
    free(sx);
    free(partials);
    return 0;
}
