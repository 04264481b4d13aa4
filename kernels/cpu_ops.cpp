// The cpu backend's C kernels (cpu_decode.c, cpu_layer_ops.c, cpu_linear.c) as torch custom ops, pdserve::*, with run-time
// dispatch over the ISA builds that setup.py links into this library (cpu_kernels.h).
//
// Why torch ops rather than ctypes: a call passes tensors, not a dozen host pointers and sizes marshalled one by one
// in Python, and the checks and strides read here cost nanoseconds instead of microseconds: the 5 op calls of 30 layers
// took 1.7 ms per batch-1 decode step through ctypes and 0.8 ms as ops (SmolLM2-135M shapes, one thread, 2-core AMD
// EPYC VM; decode attention 22 -> 8 us a call). The ops have fake implementations (kernels/cpu_ops.py): they trace.
//
// Each op checks what its C kernel relies on to stay inside its buffers (a ValueError in Python: TORCH_CHECK_VALUE),
// copies an input whose layout the kernel cannot read where that is free of side effects, and leaves the choice of
// the torch reference for what the kernel does not compute (fp16, shapes beyond its stack arrays) to cpu_ops.py.
//
// The build is chosen once, when the library loads: the best one the CPU runs (libgcc's __builtin_cpu_supports, which
// also asks the OS whether it saves the AVX-512 registers). pdserve::set_cpu_isa overrides it ($PDSERVE_CPU_ISA,
// tests, benchmarks).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/_weight_int8pack_mm.h>
#include <ATen/ops/linear.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
#include <initializer_list>
#include <sstream>
#include <string>
#include <vector>

extern "C" {
#include "cpu_kernels.h"

PDSERVE_DECLARE_KERNELS(base)
#ifdef PDSERVE_X86_LEVELS
PDSERVE_DECLARE_KERNELS(avx2)
PDSERVE_DECLARE_KERNELS(avx512)
PDSERVE_DECLARE_KERNELS(avx512_vnni)
PDSERVE_DECLARE_KERNELS(avx512_bf16)
#endif
}

namespace {

// One ISA level's build of the kernels.
struct Build {
    const char *isa;
    bool (*runs_here)();  // the CPU (and OS) have every feature the build was compiled for
    decltype(&paged_decode_attention_base) paged_decode_attention;
    decltype(&rms_norm_base) rms_norm;
    decltype(&silu_and_mul_base) silu_and_mul;
    decltype(&rotary_and_write_kv_base) rotary_and_write_kv;
    decltype(&causal_softmax_bf16_base) causal_softmax_bf16;
    decltype(&linear_small_m_base) linear_small_m;
    decltype(&linear_packed_bf16_base) linear_packed_bf16;
    decltype(&linear_blocks_base) linear_blocks;
    decltype(&linear_w8a8_base) linear_w8a8;
    decltype(&decode_step_base) decode_step;
    decltype(&paged_decode_attention_check_base) paged_decode_attention_check;
    decltype(&prefill_attention_base) prefill_attention;
};

#define PDSERVE_BUILD(isa, runs_here)                                                                            \
    Build { #isa, runs_here, paged_decode_attention_##isa, rms_norm_##isa, silu_and_mul_##isa,                   \
            rotary_and_write_kv_##isa, causal_softmax_bf16_##isa, linear_small_m_##isa, linear_packed_bf16_##isa,  \
            linear_blocks_##isa, linear_w8a8_##isa, decode_step_##isa, paged_decode_attention_check_##isa,         \
            prefill_attention_##isa }

bool always() { return true; }

#ifdef PDSERVE_X86_LEVELS
// The features of each level's -m flags (setup.py ISA_LEVELS); __builtin_cpu_init first, as this runs from the
// library's static initializer, possibly before libgcc's own.
bool has_avx2() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

bool has_avx512() {
    return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

bool has_avx512_vnni() { return has_avx512() && __builtin_cpu_supports("avx512vnni"); }

bool has_avx512_bf16() { return has_avx512_vnni() && __builtin_cpu_supports("avx512bf16"); }
#endif

// Best first: the default is the first that runs here.
const Build kBuilds[] = {
#ifdef PDSERVE_X86_LEVELS
    PDSERVE_BUILD(avx512_bf16, has_avx512_bf16),
    PDSERVE_BUILD(avx512_vnni, has_avx512_vnni),
    PDSERVE_BUILD(avx512, has_avx512),
    PDSERVE_BUILD(avx2, has_avx2),
#endif
    PDSERVE_BUILD(base, always),
};

const Build *best_build() {
    for (const Build &b : kBuilds)
        if (b.runs_here()) return &b;
    return &kBuilds[sizeof kBuilds / sizeof kBuilds[0] - 1];
}

std::atomic<const Build *> current_build{best_build()};

const Build &kernels() { return *current_build.load(std::memory_order_relaxed); }

int is_bf16(const at::Tensor &t) { return t.scalar_type() == at::kBFloat16; }

void check_cpu(const at::Tensor &t, const char *name) {
    TORCH_CHECK_VALUE(t.device().is_cpu(), "the cpu kernels take CPU tensors; ", name, " is on ", t.device());
}

// query / x dtype: what the C code reads.
void check_float(const at::Tensor &t, const char *name) {
    TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "the cpu kernels take ",
                      name, " in float32 or bfloat16, got ", t.scalar_type());
}

void check_same_dtype(const at::Tensor &t, const char *name, const at::Tensor &like, const char *like_name) {
    TORCH_CHECK_VALUE(t.scalar_type() == like.scalar_type(), name, " must have ", like_name, "'s dtype ",
                      like.scalar_type(), ", got ", t.scalar_type());
}

// A linear's bias as its kernel reads it: [out_features] in x's dtype on the CPU, contiguous; an undefined tensor for
// none (the kernel then takes NULL).
at::Tensor checked_bias(const std::optional<at::Tensor> &bias, const at::Tensor &x, int64_t out_features) {
    if (!bias) return at::Tensor();
    check_cpu(*bias, "bias");
    check_same_dtype(*bias, "bias", x, "x");
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == out_features, "bias must be [out_features=", out_features,
                      "], got shape ", bias->sizes());
    return bias->contiguous();
}

// A [num_blocks, block_size, num_kv_heads, head_dim] cache view whose (block_size, heads, head_dim) slab is dense
// (dim 0 may be strided: the per-layer view of a cache holding all layers), fp32 or bf16 whatever the rows' dtype
// (--kv-cache-dtype); v_cache the same shape, strides and dtype.
void check_caches(const at::Tensor &k_cache, const at::Tensor &v_cache) {
    check_cpu(k_cache, "k_cache");
    check_cpu(v_cache, "v_cache");
    check_float(k_cache, "k_cache");
    check_same_dtype(v_cache, "v_cache", k_cache, "k_cache");
    TORCH_CHECK_VALUE(k_cache.dim() == 4, "k_cache must have 4 dims, got shape ", k_cache.sizes());
    TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), "k_cache shape ", k_cache.sizes(), " != v_cache shape ",
                      v_cache.sizes());
    const int64_t heads = k_cache.size(2), head_dim = k_cache.size(3);
    TORCH_CHECK_VALUE(k_cache.stride(3) == 1 && k_cache.stride(2) == head_dim && k_cache.stride(1) == heads * head_dim,
                      "k_cache must be dense within a block, got strides ", k_cache.strides(), " for shape ",
                      k_cache.sizes());
    TORCH_CHECK_VALUE(v_cache.strides() == k_cache.strides(), "v_cache strides ", v_cache.strides(),
                      " != k_cache strides ", k_cache.strides());
}

std::string row_text(const at::Tensor &table, int64_t row) {  // as Python prints the list
    std::ostringstream s;
    const int32_t *r = table.data_ptr<int32_t>() + row * table.size(1);
    s << "[";
    for (int64_t i = 0; i < table.size(1); i++) s << (i ? ", " : "") << r[i];
    s << "]";
    return s.str();
}

at::Tensor paged_decode_attention(const at::Tensor &query, const at::Tensor &k_cache, const at::Tensor &v_cache,
                                  const at::Tensor &block_tables, const at::Tensor &context_lens, double scale,
                                  int64_t sliding_window) {
    check_cpu(query, "query");
    check_float(query, "query");
    TORCH_CHECK_VALUE(query.dim() == 3 && query.stride(2) == 1, "query must be [num_seqs, num_q_heads, head_dim] "
                      "with a dense last dim, got shape ", query.sizes(), " strides ", query.strides());
    check_caches(k_cache, v_cache);
    const int64_t num_seqs = query.size(0), num_q_heads = query.size(1), head_dim = query.size(2);
    const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
    TORCH_CHECK_VALUE(k_cache.size(3) == head_dim, "query head_dim ", head_dim, " != cache head_dim ",
                      k_cache.size(3));
    TORCH_CHECK_VALUE(num_kv_heads > 0 && num_q_heads % num_kv_heads == 0, "num_q_heads ", num_q_heads,
                      " is not a multiple of num_kv_heads ", num_kv_heads);
    TORCH_CHECK_VALUE(num_q_heads / num_kv_heads <= PDSERVE_MAX_GROUP && head_dim <= PDSERVE_MAX_HEAD_DIM &&
                      block_size <= PDSERVE_MAX_BLOCK, "the cpu decode kernel takes up to ", PDSERVE_MAX_GROUP,
                      " query heads per kv head, head_dim ", PDSERVE_MAX_HEAD_DIM, " and blocks of ",
                      PDSERVE_MAX_BLOCK, " tokens; got ", num_q_heads / num_kv_heads, ", ", head_dim, ", ",
                      block_size);
    check_cpu(block_tables, "block_tables");
    check_cpu(context_lens, "context_lens");
    TORCH_CHECK_VALUE(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                      block_tables.size(0) == num_seqs, "block_tables must be [num_seqs=", num_seqs,
                      ", max_blocks] int32, got ", block_tables.scalar_type(), " of shape ", block_tables.sizes());
    TORCH_CHECK_VALUE(context_lens.scalar_type() == at::kInt && context_lens.dim() == 1 &&
                      context_lens.size(0) == num_seqs, "context_lens must be [num_seqs=", num_seqs,
                      "] int32, got ", context_lens.scalar_type(), " of shape ", context_lens.sizes());
    TORCH_CHECK_VALUE(sliding_window >= 0 && sliding_window <= INT32_MAX, "sliding_window must be in [0, 2^31) (0: no "
                      "window), got ", sliding_window);
    // The kernel takes any sequence stride of the query (a view of the fused q/k/v rows) but heads dense, and dense
    // tables: anything else is copied (never on the engine's path).
    const at::Tensor q = query.stride(1) == head_dim ? query : query.contiguous();
    const at::Tensor tables = block_tables.contiguous(), lens = context_lens.contiguous();
    at::Tensor out = at::empty(query.sizes(), query.options());
    if (num_seqs == 0) return out;
    const int bad = kernels().paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(),
        out.data_ptr(), num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, tables.size(1), k_cache.stride(0),
        q.stride(0), static_cast<float>(scale), static_cast<int>(sliding_window), is_bf16(q), is_bf16(k_cache),
        at::get_num_threads(), num_blocks);
    TORCH_CHECK_VALUE(bad < 0, "sequence ", bad, ": a context of ", lens.data_ptr<int32_t>()[bad],  // on failure only
                      " tokens over block table row ", row_text(tables, bad),
                      " needs more blocks than the row has or names a block outside the cache (", num_blocks,
                      " blocks of ", block_size, " tokens)");
    return out;
}

// Causal prefill attention in one pass per tile of query rows (cpu_prefill_attention.c): the contract of
// kernels.reference.prefill_attention without a sliding window, for a bf16 query over bf16 caches or an fp32 one over
// fp32 or bf16 caches. Returns an undefined tensor for bf16 where the running build has no AVX512_BF16 (the caller
// keeps the blocked-GEMM path, kernels/cpu_prefill.py).
at::Tensor prefill_attention(const at::Tensor &query, const at::Tensor &k_cache, const at::Tensor &v_cache,
                             const at::Tensor &cu_seqlens_q, const at::Tensor &context_lens,
                             const at::Tensor &block_tables, double scale) {
    check_cpu(query, "query");
    const bool is_bf16 = query.scalar_type() == at::kBFloat16;
    TORCH_CHECK_VALUE((is_bf16 || query.scalar_type() == at::kFloat) && query.dim() == 3 && query.stride(2) == 1 &&
                      query.stride(1) == query.size(2), "query must be [num_tokens, num_q_heads, head_dim] bfloat16 "
                      "or float32 with heads dense, got ", query.scalar_type(), " of shape ", query.sizes(),
                      " strides ", query.strides());
    check_caches(k_cache, v_cache);
    TORCH_CHECK_VALUE(!is_bf16 || k_cache.scalar_type() == at::kBFloat16, "prefill_attention: a bfloat16 query takes "
                      "bfloat16 caches, got ", k_cache.scalar_type());
    const int64_t tokens = query.size(0), num_q_heads = query.size(1), head_dim = query.size(2);
    const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
    const int64_t dim_multiple = is_bf16 ? 64 : 32;  // bf16: VDPBF16PS's 64-dim P.V tiles; fp32: two AVX-512 vectors
    TORCH_CHECK_VALUE(k_cache.size(3) == head_dim && num_q_heads % num_kv_heads == 0 &&
                      head_dim % dim_multiple == 0 && head_dim <= PDSERVE_MAX_HEAD_DIM, "prefill_attention takes ",
                      query.scalar_type(), " head_dim a multiple of ", dim_multiple, " up to ", PDSERVE_MAX_HEAD_DIM,
                      " and whole GQA groups; got query ", query.sizes(), " and cache ", k_cache.sizes());
    for (const auto &[t, name] : {std::pair{&cu_seqlens_q, "cu_seqlens_q"}, std::pair{&context_lens, "context_lens"},
                                  std::pair{&block_tables, "block_tables"}}) {
        check_cpu(*t, name);
        TORCH_CHECK_VALUE(t->scalar_type() == at::kInt, name, " must be int32, got ", t->scalar_type());
    }
    const int64_t num_seqs = context_lens.numel();
    TORCH_CHECK_VALUE(cu_seqlens_q.dim() == 1 && cu_seqlens_q.numel() == num_seqs + 1 && block_tables.dim() == 2 &&
                      block_tables.size(0) == num_seqs, "cu_seqlens_q must be [num_seqs + 1] and block_tables "
                      "[num_seqs, max_blocks] for ", num_seqs, " sequences, got ", cu_seqlens_q.sizes(), " and ",
                      block_tables.sizes());
    const at::Tensor cu = cu_seqlens_q.contiguous(), lens = context_lens.contiguous();
    const at::Tensor tables = block_tables.contiguous();
    const int32_t *c = cu.data_ptr<int32_t>();
    TORCH_CHECK_VALUE(c[0] == 0 && c[num_seqs] == tokens, "cu_seqlens_q must run from 0 to the ", tokens,
                      " query tokens, got ", c[0], " to ", c[num_seqs]);
    at::Tensor out = at::empty(query.sizes(), query.options());
    if (tokens == 0) return out;
    const int bad = kernels().prefill_attention(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), c, lens.data_ptr<int32_t>(),
        tables.data_ptr<int32_t>(), out.data_ptr(), num_seqs, num_q_heads, num_kv_heads, head_dim, block_size,
        tables.size(1), k_cache.stride(0), query.stride(0), static_cast<float>(scale), is_bf16,
        k_cache.scalar_type() == at::kBFloat16, at::get_num_threads(), num_blocks);
    if (bad == PREFILL_UNSUPPORTED) return at::Tensor();
    TORCH_CHECK(bad != PREFILL_NO_MEMORY, "prefill_attention: out of memory for its scratch");
    TORCH_CHECK_VALUE(bad < 0, "sequence ", bad, ": a chunk of ", c[bad + 1] - c[bad], " tokens in a context of ",
                      lens.data_ptr<int32_t>()[bad], " over block table row ", row_text(tables, bad),
                      " is longer than its context, needs more blocks than the row has or names a block outside "
                      "the cache (", num_blocks, " blocks of ", block_size, " tokens)");
    return out;
}

at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &weight, double eps,
                    const std::optional<at::Tensor> &residual) {
    check_cpu(x, "x");
    check_float(x, "x");
    check_cpu(weight, "weight");
    TORCH_CHECK_VALUE(x.dim() == 2, "x must be [tokens, hidden], got shape ", x.sizes());
    const int64_t rows = x.size(0), dim = x.size(1);
    check_same_dtype(weight, "weight", x, "x");
    TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == dim, "weight must be [hidden=", dim, "], got shape ",
                      weight.sizes());
    if (residual) {  // updated in place: it cannot be a copy
        check_cpu(*residual, "residual");
        check_same_dtype(*residual, "residual", x, "x");
        TORCH_CHECK_VALUE(residual->sizes() == x.sizes() && residual->is_contiguous(), "residual must be contiguous "
                          "and shaped as x ", x.sizes(), ", got shape ", residual->sizes(), " strides ",
                          residual->strides());
    }
    const at::Tensor xs = x.stride(1) == 1 ? x : x.contiguous(), w = weight.contiguous();  // rows may be strided
    at::Tensor out = at::empty({rows, dim}, x.options());
    kernels().rms_norm(xs.data_ptr(), residual ? residual->data_ptr() : nullptr, w.data_ptr(), out.data_ptr(), rows,
                       dim, xs.stride(0), static_cast<float>(eps), is_bf16(x), at::get_num_threads());
    return out;
}

at::Tensor silu_and_mul(const at::Tensor &gate_up) {
    check_cpu(gate_up, "gate_up");
    check_float(gate_up, "gate_up");
    TORCH_CHECK_VALUE(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [tokens, 2 * intermediate], "
                      "got shape ", gate_up.sizes());
    const at::Tensor g = gate_up.contiguous();
    const int64_t rows = g.size(0), inter = g.size(1) / 2;
    at::Tensor out = at::empty({rows, inter}, g.options());
    kernels().silu_and_mul(g.data_ptr(), out.data_ptr(), rows, inter, is_bf16(g), at::get_num_threads());
    return out;
}

void rotary_and_write_kv(const at::Tensor &qkv, const at::Tensor &cos, const at::Tensor &sin,
                         const at::Tensor &k_cache, const at::Tensor &v_cache, const at::Tensor &slot_mapping) {
    check_cpu(qkv, "qkv");
    check_float(qkv, "qkv");
    TORCH_CHECK_VALUE(qkv.dim() == 3, "qkv must be [tokens, num_heads + 2 * num_kv_heads, head_dim], got shape ",
                      qkv.sizes());
    const int64_t tokens = qkv.size(0), all_heads = qkv.size(1), head_dim = qkv.size(2);
    TORCH_CHECK_VALUE(qkv.stride(2) == 1 && qkv.stride(1) == head_dim, "qkv's heads must be dense within a token "
                      "(rotated in place), got strides ", qkv.strides(), " for shape ", qkv.sizes());
    TORCH_CHECK_VALUE(head_dim % 2 == 0, "RoPE needs an even head_dim, got ", head_dim);
    check_caches(k_cache, v_cache);
    const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), kv_heads = k_cache.size(2);
    TORCH_CHECK_VALUE(k_cache.size(3) == head_dim && all_heads > 2 * kv_heads, "qkv ", qkv.sizes(),
                      " does not hold q heads and the k and v heads of a cache of shape ", k_cache.sizes());
    for (const auto &[t, name] : {std::pair{&cos, "cos"}, std::pair{&sin, "sin"}}) {
        check_cpu(*t, name);
        check_same_dtype(*t, name, qkv, "qkv");
        TORCH_CHECK_VALUE(t->numel() == tokens * head_dim, name, " must hold [tokens=", tokens, ", head_dim=",
                          head_dim, "], got shape ", t->sizes());
    }
    check_cpu(slot_mapping, "slot_mapping");
    TORCH_CHECK_VALUE(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == tokens,
                      "slot_mapping must be [tokens=", tokens, "] int64, got ", slot_mapping.scalar_type(),
                      " of shape ", slot_mapping.sizes());
    const at::Tensor c = cos.contiguous(), s = sin.contiguous(), slots = slot_mapping.contiguous();
    const int bad = kernels().rotary_and_write_kv(
        qkv.data_ptr(), c.data_ptr(), s.data_ptr(), static_cast<char *>(k_cache.data_ptr()),
        static_cast<char *>(v_cache.data_ptr()), slots.data_ptr<int64_t>(), tokens, all_heads - 2 * kv_heads,
        kv_heads, head_dim, qkv.stride(0), block_size, k_cache.stride(0) * k_cache.element_size(), num_blocks,
        is_bf16(qkv), is_bf16(k_cache), at::get_num_threads());
    TORCH_CHECK_VALUE(bad < 0, "slot ", slots.data_ptr<int64_t>()[bad], " of token ", bad,
                      " is outside the KV cache (", num_blocks, " blocks of ", block_size, " tokens)");
}

void causal_softmax_(const at::Tensor &scores, int64_t rows, double scale) {
    check_cpu(scores, "scores");
    TORCH_CHECK_VALUE(scores.scalar_type() == at::kBFloat16 && scores.is_contiguous() && scores.dim() >= 1,
                      "scores must be contiguous bfloat16, got ", scores.scalar_type(), " strides ", scores.strides());
    const int64_t end = scores.size(-1);
    TORCH_CHECK_VALUE(rows >= 1 && rows <= end && scores.numel() % (rows * end) == 0, "scores of shape ",
                      scores.sizes(), " are not blocks of ", rows, " query rows");
    kernels().causal_softmax_bf16(static_cast<uint16_t *>(scores.data_ptr()), scores.numel() / end, rows, end,
                                  static_cast<float>(scale), at::get_num_threads());
}

at::Tensor linear_small_m(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
    check_cpu(x, "x");
    check_cpu(weight, "weight");
    TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
                      "linear_small_m takes float32 x and weight, got ", x.scalar_type(), " and ", weight.scalar_type());
    TORCH_CHECK_VALUE(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "linear_small_m takes x [M, K] "
                      "and weight [N, K], got shapes ", x.sizes(), " and ", weight.sizes());
    const int64_t rows = x.size(0), out_features = weight.size(0), in_features = weight.size(1);
    TORCH_CHECK_VALUE(rows <= INT32_MAX && out_features <= INT32_MAX && in_features <= INT32_MAX,
                      "linear_small_m: dimensions past 2^31 (", rows, ", ", out_features, ", ", in_features, ")");
    const at::Tensor b = checked_bias(bias, x, out_features);
    // Rows may be strided (a view of wider rows); the weight is nn.Linear's own dense tensor (never copied on the
    // engine's path).
    const at::Tensor xs = x.stride(1) == 1 ? x : x.contiguous(), w = weight.contiguous();
    at::Tensor out = at::empty({rows, out_features}, x.options());
    if (rows == 0 || out_features == 0) return out;
    kernels().linear_small_m(xs.data_ptr<float>(), w.data_ptr<float>(), bias ? b.data_ptr<float>() : nullptr,
                             out.data_ptr<float>(), rows, out_features, in_features, xs.stride(0),
                             at::get_num_threads());
    return out;
}
// The GGUF block format of a weight held as blocks (cpu_linear.c, engine.execution.packing.gguf_blocks), told by its
// qs: uint8 (two weights a byte) Q4_1, int8 Q8_0; 0 for anything else.
int blocks_format(const at::Tensor &qs) {
    return qs.scalar_type() == at::kByte ? PDSERVE_Q4_1 : qs.scalar_type() == at::kChar ? PDSERVE_Q8_0 : 0;
}

// y = x W^T + b in fp32 with W held as GGUF blocks (cpu_linear.c): Q4_1 (qs [N, K / 2] uint8, scales [N, K / 32, 2]
// float16: each block's scale and minimum) or Q8_0 (qs [N, K] int8, scales [N, K / 32] float16). x [M, K] float32
// (rows may be strided), bias [N] float32 or None. The same sums as linear_small_m over the dequantized W; with
// q8_activations, a one-row x is quantized to 8 bits a block of 32 and multiplied in integers (llama.cpp's arithmetic,
// PDSERVE_Q8_ACTIVATIONS; lossy), more rows as without.
at::Tensor linear_blocks(const at::Tensor &x, const at::Tensor &qs, const at::Tensor &scales,
                         const std::optional<at::Tensor> &bias, bool q8_activations) {
    check_cpu(x, "x");
    check_cpu(qs, "qs");
    check_cpu(scales, "scales");
    TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat && x.dim() == 2, "linear_blocks takes float32 x [M, K], got ",
                      x.scalar_type(), " of shape ", x.sizes());
    const int64_t rows = x.size(0), in_features = x.size(1);
    const int format = blocks_format(qs);
    const int64_t per_byte = format == PDSERVE_Q4_1 ? 2 : 1, scales_per_block = format == PDSERVE_Q4_1 ? 2 : 1;
    TORCH_CHECK_VALUE(format != 0 && qs.dim() == 2 && qs.size(1) * per_byte == in_features && in_features % 32 == 0 &&
                      qs.is_contiguous(), "linear_blocks takes qs [N, K / 2] uint8 (Q4_1) or [N, K] int8 (Q8_0), "
                      "contiguous, with K a multiple of 32 (x has K = ", in_features, "), got ", qs.scalar_type(),
                      " of shape ", qs.sizes());
    const int64_t out_features = qs.size(0);
    TORCH_CHECK_VALUE(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                      scales.numel() == out_features * in_features / 32 * scales_per_block,
                      "linear_blocks takes scales [N, K / 32", format == PDSERVE_Q4_1 ? ", 2" : "", "] float16 "
                      "contiguous (N = ", out_features, ", K / 32 = ", in_features / 32, "), got ",
                      scales.scalar_type(), " of shape ", scales.sizes());
    TORCH_CHECK_VALUE(rows <= INT32_MAX && out_features <= INT32_MAX && in_features <= INT32_MAX / 4,
                      "linear_blocks: dimensions past what it takes (", rows, ", ", out_features, ", ", in_features,
                      ")");
    const at::Tensor b = checked_bias(bias, x, out_features);
    const at::Tensor xs = x.stride(1) == 1 ? x : x.contiguous();
    at::Tensor out = at::empty({rows, out_features}, x.options());
    if (rows == 0 || out_features == 0) return out;
    const int rc = kernels().linear_blocks(xs.data_ptr<float>(), xs.stride(0), qs.data_ptr(),
                                           static_cast<const uint16_t *>(scales.data_ptr()),
                                           format | (q8_activations ? PDSERVE_Q8_ACTIVATIONS : 0),
                                           bias ? b.data_ptr<float>() : nullptr, out.data_ptr<float>(), rows,
                                           out_features, in_features, at::get_num_threads());
    TORCH_CHECK(rc == 0, "linear_blocks: out of memory for the dequantization buffers");
    return out;
}

// y = x W^T + b in fp32 through 8-bit integer products (cpu_int8_gemm.c): W as 7-bit integers stored with 64 added,
// in [1, 127], packed in groups of 16 rows (wp [ceil(N / 16), K / 4, 64] uint8: engine.execution.packing.w8a8_packed),
// and w_scale [N] float32 (w8a8_weights), which gives N; x [M, K] float32 (rows may be strided), quantized per row per
// block of 64 here; bias [N] float32 or None. Lossy.
at::Tensor linear_w8a8(const at::Tensor &x, const at::Tensor &wq, const at::Tensor &w_scale,
                       const std::optional<at::Tensor> &bias) {
    for (const auto &[t, name] : {std::pair{&x, "x"}, std::pair{&wq, "wq"}, std::pair{&w_scale, "w_scale"}})
        check_cpu(*t, name);
    TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat && x.dim() == 2, "linear_w8a8 takes float32 x [M, K], got ",
                      x.scalar_type(), " of shape ", x.sizes());
    const int64_t rows = x.size(0), in_features = x.size(1), out_features = w_scale.numel();
    TORCH_CHECK_VALUE(w_scale.scalar_type() == at::kFloat && w_scale.dim() == 1 && w_scale.is_contiguous(),
                      "linear_w8a8 takes w_scale [N] float32 contiguous, got ", w_scale.scalar_type(), " of shape ",
                      w_scale.sizes());
    const int64_t groups = (out_features + PDSERVE_W8A8_GROUP - 1) / PDSERVE_W8A8_GROUP;
    TORCH_CHECK_VALUE(wq.scalar_type() == at::kByte && wq.dim() == 3 && wq.size(0) == groups &&
                      wq.size(1) * 4 == in_features && wq.size(2) == 4 * PDSERVE_W8A8_GROUP && wq.is_contiguous() &&
                      in_features % PDSERVE_W8A8_BLOCK == 0, "linear_w8a8 takes wq packed [ceil(N / ",
                      PDSERVE_W8A8_GROUP, "), K / 4, ", 4 * PDSERVE_W8A8_GROUP, "] uint8, contiguous, with K a "
                      "multiple of ", PDSERVE_W8A8_BLOCK, " (x has K = ", in_features, ", w_scale N = ", out_features,
                      "), got ", wq.scalar_type(), " of shape ", wq.sizes());
    TORCH_CHECK_VALUE(rows <= INT32_MAX && out_features <= INT32_MAX && in_features <= INT32_MAX,
                      "linear_w8a8: dimensions past 2^31 (", rows, ", ", out_features, ", ", in_features, ")");
    const at::Tensor b = checked_bias(bias, x, out_features);
    const at::Tensor xs = x.stride(1) == 1 ? x : x.contiguous();
    at::Tensor out = at::empty({rows, out_features}, x.options());
    if (rows == 0 || out_features == 0) return out;
    const int rc = kernels().linear_w8a8(xs.data_ptr<float>(), xs.stride(0), wq.data_ptr<uint8_t>(),
                                         w_scale.data_ptr<float>(), bias ? b.data_ptr<float>() : nullptr,
                                         out.data_ptr<float>(), rows, out_features, in_features,
                                         at::get_num_threads());
    TORCH_CHECK(rc == 0, "linear_w8a8: out of memory for the quantized rows");
    return out;
}

// y = x W^T + b for bf16 weights in oneDNN's packed layout (cpu_linear.c), read in place at the address oneDNN's
// packed tensor holds (torch.ops.mkldnn.data_ptr): the caller keeps that tensor alive and has checked the layout
// (engine.execution.packing.PackedLinear). x [M, K] bf16 (rows may be strided), bias [N] bf16 or None.
at::Tensor linear_packed_bf16(const at::Tensor &x, int64_t weight_ptr, int64_t out_features, int64_t padded_k,
                              const std::optional<at::Tensor> &bias) {
    check_cpu(x, "x");
    TORCH_CHECK_VALUE(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "linear_packed_bf16 takes x [M, K] bfloat16, "
                      "got ", x.scalar_type(), " of shape ", x.sizes());
    const int64_t rows = x.size(0), in_features = x.size(1);
    TORCH_CHECK_VALUE(weight_ptr != 0 && out_features > 0 && in_features % 2 == 0 && padded_k >= in_features &&
                      padded_k % 2 == 0 && rows <= INT32_MAX && out_features <= INT32_MAX && padded_k <= INT32_MAX,
                      "linear_packed_bf16: a packed weight of ", out_features, " x ", padded_k, " (padded) does not "
                      "take x of ", in_features, " features (even, at most the padded width)");
    const at::Tensor b = checked_bias(bias, x, out_features);  // x is bfloat16 (checked above)
    const at::Tensor xs = x.stride(1) == 1 ? x : x.contiguous();
    at::Tensor out = at::empty({rows, out_features}, x.options());
    if (rows == 0) return out;
    kernels().linear_packed_bf16(static_cast<const uint16_t *>(xs.data_ptr()), xs.stride(0),
                                 reinterpret_cast<const uint16_t *>(weight_ptr),
                                 bias ? static_cast<const uint16_t *>(b.data_ptr()) : nullptr,
                                 static_cast<uint16_t *>(out.data_ptr()), rows, out_features, in_features, padded_k,
                                 at::get_num_threads());
    return out;
}

// The list arguments of decode_layers and decode_layers_fused: one entry a layer in each per-layer list, 4 a layer
// (qkv, o, gate_up, down) in each linear list.
void check_layer_lists(const char *op, size_t layers, std::initializer_list<size_t> per_layer,
                       std::initializer_list<size_t> per_linear) {
    for (const size_t n : per_layer)
        TORCH_CHECK_VALUE(n == layers, op, ": every per-layer list must have ", layers,
                          " entries (one per KV cache layer), got one of ", n);
    for (const size_t n : per_linear)
        TORCH_CHECK_VALUE(n == 4 * layers, op, ": the linear lists must have 4 entries a layer (", 4 * layers,
                          "), got one of ", n);
}

// The linear forms decode_layers applies (engine.execution.packing, engine.execution.quantization): torch's own,
// oneDNN's prepacked bf16, our fp32 kernel, torch's int8 and int4 weight-only packed ops.
enum LinearForm : int64_t { kTorchLinear = 0, kPackedLinear = 1, kSmallMLinear = 2, kInt8Linear = 3, kInt4Linear = 4 };

// y = x W^T + b through oneDNN with W prepacked (torch.ops.mkldnn._linear_pointwise, the op engine.execution.packing calls),
// boxed through the dispatcher: it is registered by libtorch and has no C++ header.
at::Tensor packed_linear(const at::Tensor &x, const at::Tensor &packed_weight, const std::optional<at::Tensor> &bias) {
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    std::vector<c10::IValue> stack{x, packed_weight, bias ? c10::IValue(*bias) : c10::IValue(), std::string("none"),
                                   c10::List<std::optional<at::Scalar>>(), std::string("")};
    op.callBoxed(&stack);
    return stack[0].toTensor();
}

// One linear of form `form`: weight is the form's weight tensor (plain [N, K], oneDNN-packed, int8 [N, K] or the int4
// pack), aux the int8 scales [N] or the int4 scales and zeros [K / group, N, 2] (engine.execution.quantization).
at::Tensor apply_linear(int64_t form, const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &aux,
                        const std::optional<at::Tensor> &bias) {
    switch (form) {
        case kPackedLinear: return packed_linear(x, weight, bias);
        case kSmallMLinear: return linear_small_m(x, weight, bias);
        case kInt8Linear:
        case kInt4Linear: {
            TORCH_CHECK_VALUE(aux.has_value(), "decode_layers: a quantized linear needs its scales");
            at::Tensor y = form == kInt8Linear
                ? at::_weight_int8pack_mm(x.contiguous(), weight, *aux)
                : at::_weight_int4pack_mm_for_cpu(x.contiguous(), weight, x.size(1) / aux->size(0), *aux);
            return bias ? y.add_(*bias) : y;
        }
        default: return at::linear(x, weight, bias);
    }
}

// Every layer of a pre-norm decoder (engine.models.decoder.DecoderModel.forward) over an all-decode step, in one
// call: the same ops in the same order with the same numerics, minus the Python between them. At batch 1 the ~300
// op calls of a 30-layer step cost about a fifth of the step in Python dispatch (bench/step_profile.py); a CUDA
// graph removes that cost on a GPU, this loop on a CPU.
//
// residual [B, hidden] is the residual stream h (updated in place), x = rms_norm(h) with layer 0's input norm.
// The linears come 4 a layer (qkv, o, gate_up, down), their weights, aux tensors (apply_linear) and biases in
// linear_weights / linear_aux / linear_biases; per layer l: post_norm[l] (post-attention norm weight), next_norm[l]
// (the next layer's input norm, the final norm for the last), windows[l] (sliding window, 0: full); the caches as
// rotary_and_write_kv and paged_decode_attention take them. Returns the last layer's normalised hidden states
// [B, hidden].
at::Tensor decode_layers(const at::Tensor &residual, const at::Tensor &x, const at::Tensor &cos, const at::Tensor &sin,
                         const at::Tensor &slot_mapping, const at::Tensor &block_tables,
                         const at::Tensor &context_lens, at::TensorList k_caches, at::TensorList v_caches,
                         at::TensorList linear_weights, const c10::List<std::optional<at::Tensor>> &linear_aux,
                         const c10::List<std::optional<at::Tensor>> &linear_biases, at::TensorList post_norm,
                         at::TensorList next_norm, at::IntArrayRef windows, int64_t linear_form, double eps,
                         double scale) {
    const size_t layers = k_caches.size();
    check_layer_lists("decode_layers", layers, {v_caches.size(), post_norm.size(), next_norm.size(), windows.size()},
                      {linear_weights.size(), linear_aux.size(), linear_biases.size()});
    TORCH_CHECK_VALUE(linear_form >= kTorchLinear && linear_form <= kInt4Linear, "decode_layers: linear_form must be "
                      "0 (torch), 1 (oneDNN prepacked), 2 (fp32 small-M kernel), 3 (int8) or 4 (int4), got ",
                      linear_form);
    TORCH_CHECK_VALUE(x.dim() == 2, "decode_layers: x must be [num_seqs, hidden], got shape ", x.sizes());
    const int64_t num_seqs = x.size(0);
    const auto linear = [&](size_t i, const at::Tensor &in) {
        return apply_linear(linear_form, in, linear_weights[i], linear_aux.get(i), linear_biases.get(i));
    };
    at::Tensor hidden = x;
    // Profiler ranges around the calls that skip the dispatcher (bench/step_profile.py attributes them; a flag
    // test when no profiler runs).
#define PDSERVE_RANGE(what) RECORD_FUNCTION("pdserve::decode_layers:" what, std::vector<c10::IValue>())
    for (size_t l = 0; l < layers; l++) {
        const at::Tensor &k_cache = k_caches[l], &v_cache = v_caches[l];
        TORCH_CHECK_VALUE(k_cache.dim() == 4, "k_cache must have 4 dims, got shape ", k_cache.sizes());
        const int64_t head_dim = k_cache.size(3);
        at::Tensor qkv = linear(4 * l, hidden);
        TORCH_CHECK_VALUE(qkv.size(1) % head_dim == 0, "decode_layers: a qkv row of ", qkv.size(1),
                          " values is not whole heads of ", head_dim);
        qkv = qkv.view({num_seqs, qkv.size(1) / head_dim, head_dim});
        at::Tensor attn, act;
        {
            PDSERVE_RANGE("attention");
            rotary_and_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping);
            attn = paged_decode_attention(qkv.narrow(1, 0, qkv.size(1) - 2 * k_cache.size(2)), k_cache, v_cache,
                                          block_tables, context_lens, scale, windows[l]);
        }
        const at::Tensor o = linear(4 * l + 1, attn.view({num_seqs, -1}));
        {
            PDSERVE_RANGE("layer_op");
            hidden = rms_norm(o, post_norm[l], eps, residual);
        }
        const at::Tensor gate_up = linear(4 * l + 2, hidden);
        {
            PDSERVE_RANGE("layer_op");
            act = silu_and_mul(gate_up);
        }
        const at::Tensor mlp = linear(4 * l + 3, act);
        PDSERVE_RANGE("layer_op");
        hidden = rms_norm(mlp, next_norm[l], eps, residual);
    }
#undef PDSERVE_RANGE
    return hidden;
}

// decode_layers with the whole step in one OpenMP region (cpu_decode_step.c): the same ops in the same order, for bf16
// weights in oneDNN's packed layout (linear_packed_bf16's linears) or fp32 nn.Linear weights (linear_small_m's), by
// the dtype of x, or fp32 rows against GGUF blocks (linear_blocks's) of format weight_blocks. weight_ptrs / padded_k:
// 4 a layer (qkv, o, gate_up, down), the packed tensors' addresses and padded K as linear_packed_bf16 takes them, or
// the fp32 weights' addresses ([N, K] contiguous; padded_k = K), or the blocks' qs (scale_ptrs: their scales;
// padded_k = K; weight_blocks | PDSERVE_Q8_ACTIVATIONS: linear_blocks's q8_activations), or with weight_blocks =
// PDSERVE_W8A8 linear_w8a8's packed wq (scale_ptrs: its w_scale; padded_k = K); the caller keeps them alive. num_heads:
// query heads; intermediate: the MLP's width. Returns the final norm's output [B, hidden];
// residual is updated in place. Everything the kernel trusts is checked here first (ValueError), with nothing written
// on failure.
at::Tensor decode_layers_fused(const at::Tensor &residual, const at::Tensor &x, const at::Tensor &cos,
                                     const at::Tensor &sin, const at::Tensor &slot_mapping,
                                     const at::Tensor &block_tables, const at::Tensor &context_lens,
                                     at::TensorList k_caches, at::TensorList v_caches, at::IntArrayRef weight_ptrs,
                                     at::IntArrayRef padded_k,
                                     const c10::List<std::optional<at::Tensor>> &linear_biases,
                                     at::TensorList post_norm, at::TensorList next_norm, at::IntArrayRef windows,
                                     int64_t num_heads, int64_t intermediate, double eps, double scale,
                                     int64_t weight_blocks, at::IntArrayRef scale_ptrs) {
    const size_t layers = k_caches.size();
    TORCH_CHECK_VALUE(layers > 0, "decode_layers_fused: no layers");
    check_layer_lists("decode_layers_fused", layers,
                      {v_caches.size(), post_norm.size(), next_norm.size(), windows.size()},
                      {weight_ptrs.size(), padded_k.size(), linear_biases.size()});
    for (const auto &[t, name] : {std::pair{&residual, "residual"}, std::pair{&x, "x"}}) {
        check_cpu(*t, name);
        TORCH_CHECK_VALUE(t->scalar_type() == x.scalar_type() && t->dim() == 2 && t->is_contiguous(),
                          "decode_layers_fused: ", name, " must be contiguous [num_seqs, hidden] in x's dtype, got ",
                          t->scalar_type(), " of shape ", t->sizes());
    }
    TORCH_CHECK_VALUE(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "decode_layers_fused takes "
                      "bfloat16 (packed weights) or float32, got ", x.scalar_type());
    const bool bf16 = x.scalar_type() == at::kBFloat16, blocks = weight_blocks != 0;
    const at::ScalarType dtype = x.scalar_type();
    const int64_t block_format = weight_blocks & ~static_cast<int64_t>(PDSERVE_Q8_ACTIVATIONS);
    const bool w8a8 = weight_blocks == PDSERVE_W8A8;
    TORCH_CHECK_VALUE(weight_blocks == 0 || w8a8 || block_format == PDSERVE_Q4_1 || block_format == PDSERVE_Q8_0,
                      "decode_layers_fused: weight_blocks must be 0 (plain), ", PDSERVE_Q4_1, " (Q4_1) or ",
                      PDSERVE_Q8_0, " (Q8_0), either with ", PDSERVE_Q8_ACTIVATIONS, " added for 8-bit activations, "
                      "or ", PDSERVE_W8A8, " (7-bit weights, 8-bit rows), got ", weight_blocks);
    TORCH_CHECK_VALUE(blocks ? !bf16 && scale_ptrs.size() == 4 * layers : scale_ptrs.empty(), "decode_layers_fused: "
                      "weights as blocks or W8A8 take float32 rows and 4 scale pointers a layer (", 4 * layers,
                      "), plain ones none; got ", x.scalar_type(), " and ", scale_ptrs.size(), " for weight_blocks ",
                      weight_blocks);
    TORCH_CHECK_VALUE(residual.sizes() == x.sizes(), "residual ", residual.sizes(), " != x ", x.sizes());
    const int64_t rows = x.size(0), hidden = x.size(1);
    const at::Tensor &k0 = k_caches[0];
    check_caches(k0, v_caches[0]);
    const at::ScalarType kv_dtype = k0.scalar_type();  // fp32 rows may read a bf16 cache (--kv-cache-dtype)
    TORCH_CHECK_VALUE(kv_dtype == dtype || (!bf16 && kv_dtype == at::kBFloat16), "the caches must be ", dtype,
                      bf16 ? "" : " or bfloat16", ", got ", kv_dtype);
    for (size_t l = 0; l < layers; l++)
        for (const at::Tensor *c : {&k_caches[l], &v_caches[l]})
            TORCH_CHECK_VALUE(c->device().is_cpu() && c->scalar_type() == kv_dtype && c->sizes() == k0.sizes() &&
                              c->strides() == k0.strides(), "layer ", l, "'s cache ", c->sizes(), " ",
                              c->scalar_type(), " differs from layer 0's ", k0.sizes(), " (every layer's alike)");
    const int64_t num_blocks = k0.size(0), block_size = k0.size(1), kv_heads = k0.size(2), head_dim = k0.size(3);
    TORCH_CHECK_VALUE(num_heads > 0 && num_heads % kv_heads == 0 && num_heads / kv_heads <= PDSERVE_MAX_GROUP &&
                      head_dim <= PDSERVE_MAX_HEAD_DIM && head_dim % 2 == 0 && block_size <= PDSERVE_MAX_BLOCK &&
                      intermediate > 0 && (!bf16 || (hidden % 2 == 0 && (num_heads * head_dim) % 2 == 0 &&
                                                     intermediate % 2 == 0)),
                      "decode_layers_fused: ", num_heads, " query heads over ", kv_heads, " kv heads of ",
                      head_dim, ", blocks of ", block_size, " tokens, hidden ", hidden, ", intermediate ",
                      intermediate, " are outside what its kernels take");
    const int64_t q_width = num_heads * head_dim, qkv_width = q_width + 2 * kv_heads * head_dim;
    const int64_t in_features[4] = {hidden, q_width, hidden, intermediate};
    const int64_t out_features[4] = {qkv_width, hidden, 2 * intermediate, hidden};
    std::vector<const void *> weights(4 * layers), biases(4 * layers), scales(4 * layers);
    std::vector<int> padded(4 * layers);
    int64_t max_k = 0;
    std::vector<at::Tensor> keep;  // contiguous copies of any strided bias, alive through the call
    for (size_t i = 0; i < 4 * layers; i++) {
        const int64_t k = in_features[i % 4], n = out_features[i % 4];
        TORCH_CHECK_VALUE(weight_ptrs[i] != 0 && padded_k[i] >= k && (!bf16 || padded_k[i] % 2 == 0) &&
                          padded_k[i] <= INT32_MAX,
                          "decode_layers_fused: linear ", i, " has padded width ", padded_k[i], " for ", k,
                          " input features");
        const int64_t k_multiple = w8a8 ? PDSERVE_W8A8_BLOCK : 32;
        TORCH_CHECK_VALUE(!blocks || (scale_ptrs[i] != 0 && k % k_multiple == 0 && k <= INT32_MAX / 4),
                          "decode_layers_fused: linear ", i, " as blocks or W8A8 needs its scales and K a multiple of ",
                          k_multiple, ", got K = ", k);
        weights[i] = reinterpret_cast<const void *>(weight_ptrs[i]);
        scales[i] = blocks ? reinterpret_cast<const void *>(scale_ptrs[i]) : nullptr;
        padded[i] = static_cast<int>(padded_k[i]);
        max_k = std::max(max_k, k);
        const std::optional<at::Tensor> bias = linear_biases.get(i);
        biases[i] = nullptr;
        if (bias) {
            TORCH_CHECK_VALUE(bias->device().is_cpu() && bias->scalar_type() == dtype && bias->dim() == 1 &&
                              bias->size(0) == n, "linear ", i, "'s bias must be [", n, "] ", dtype, ", got ",
                              bias->scalar_type(), " of shape ", bias->sizes());
            keep.push_back(bias->contiguous());
            biases[i] = keep.back().data_ptr();
        }
    }
    std::vector<const void *> post(layers), next(layers);
    std::vector<void *> kc(layers), vc(layers);
    std::vector<int> win(layers);
    for (size_t l = 0; l < layers; l++) {
        for (const auto &[t, name] : {std::pair{&post_norm[l], "post_norm"}, std::pair{&next_norm[l], "next_norm"}})
            TORCH_CHECK_VALUE(t->device().is_cpu() && t->scalar_type() == dtype && t->dim() == 1 &&
                              t->size(0) == hidden && t->is_contiguous(), name, "[", l, "] must be contiguous [",
                              hidden, "] ", dtype, ", got ", t->scalar_type(), " of shape ", t->sizes());
        TORCH_CHECK_VALUE(windows[l] >= 0 && windows[l] <= INT32_MAX, "windows[", l, "] must be in [0, 2^31)");
        post[l] = post_norm[l].data_ptr();
        next[l] = next_norm[l].data_ptr();
        kc[l] = k_caches[l].data_ptr();
        vc[l] = v_caches[l].data_ptr();
        win[l] = static_cast<int>(windows[l]);
    }
    for (const auto &[t, name] : {std::pair{&cos, "cos"}, std::pair{&sin, "sin"}}) {
        check_cpu(*t, name);
        TORCH_CHECK_VALUE(t->scalar_type() == dtype && t->numel() == rows * head_dim, name, " must hold [",
                          rows, ", ", head_dim, "] ", dtype, ", got ", t->scalar_type(), " of shape ", t->sizes());
    }
    check_cpu(slot_mapping, "slot_mapping");
    check_cpu(block_tables, "block_tables");
    check_cpu(context_lens, "context_lens");
    TORCH_CHECK_VALUE(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == rows,
                      "slot_mapping must be [", rows, "] int64, got ", slot_mapping.scalar_type(), " of shape ",
                      slot_mapping.sizes());
    TORCH_CHECK_VALUE(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.size(0) == rows,
                      "block_tables must be [", rows, ", max_blocks] int32, got ", block_tables.scalar_type(),
                      " of shape ", block_tables.sizes());
    TORCH_CHECK_VALUE(context_lens.scalar_type() == at::kInt && context_lens.numel() == rows, "context_lens must be [",
                      rows, "] int32, got ", context_lens.scalar_type(), " of shape ", context_lens.sizes());
    const at::Tensor c = cos.contiguous(), s = sin.contiguous(), slots = slot_mapping.contiguous();
    const at::Tensor tables = block_tables.contiguous(), lens = context_lens.contiguous();
    const int64_t *slot = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < rows; t++)
        TORCH_CHECK_VALUE(slot[t] >= 0 && slot[t] < num_blocks * block_size, "slot ", slot[t], " of token ", t,
                          " is outside the KV cache (", num_blocks, " blocks of ", block_size, " tokens)");
    // Window 0 checks every block a context reads: a windowed layer reads a subset.
    const int bad = kernels().paged_decode_attention_check(tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(),
                                                           rows, block_size, tables.size(1), 0, num_blocks);
    TORCH_CHECK_VALUE(bad < 0, "sequence ", bad, ": a context of ", lens.data_ptr<int32_t>()[bad],
                      " tokens over block table row ", row_text(tables, bad),
                      " needs more blocks than the row has or names a block outside the cache (", num_blocks,
                      " blocks of ", block_size, " tokens)");
    at::Tensor out = x.clone();
    if (rows == 0) return out;
    const auto opts = x.options();
    const at::Tensor qkv = at::empty({rows, qkv_width}, opts), attn = at::empty({rows, q_width}, opts);
    const at::Tensor proj = at::empty({rows, hidden}, opts), gate_up = at::empty({rows, 2 * intermediate}, opts);
    const at::Tensor act = at::empty({rows, intermediate}, opts);
    const auto ptr = [](const at::Tensor &t) { return t.data_ptr(); };
    const PdserveDecodeStep step{
        bf16 ? 1 : 0, static_cast<int>(weight_blocks), kv_dtype == at::kBFloat16 ? 1 : 0, static_cast<int>(layers),
        static_cast<int>(rows),
        static_cast<int>(hidden), static_cast<int>(num_heads),
        static_cast<int>(kv_heads), static_cast<int>(head_dim), static_cast<int>(intermediate),
        static_cast<int>(block_size), static_cast<int>(tables.size(1)), k0.stride(0), kc.data(), vc.data(),
        weights.data(), scales.data(), static_cast<int>(max_k), padded.data(), biases.data(), post.data(),
        next.data(), win.data(),
        c.data_ptr(), s.data_ptr(), slot,
        tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), static_cast<float>(eps), static_cast<float>(scale),
        ptr(residual), ptr(out), ptr(qkv), ptr(attn), ptr(proj), ptr(gate_up), ptr(act)};
    RECORD_FUNCTION("pdserve::decode_layers_fused:step", std::vector<c10::IValue>());
    TORCH_CHECK(kernels().decode_step(&step, at::get_num_threads()) == 0,
                "decode_layers_fused: out of memory for the blocks', W8A8's or split attention's buffers");
    return out;
}

std::string cpu_isa() { return kernels().isa; }

std::vector<std::string> cpu_isas() {
    std::vector<std::string> isas;
    for (const Build &b : kBuilds)
        if (b.runs_here()) isas.emplace_back(b.isa);
    return isas;
}

void set_cpu_isa(const std::string &isa) {
    for (const Build &b : kBuilds) {
        if (isa != b.isa) continue;
        TORCH_CHECK_VALUE(b.runs_here(), "this CPU lacks the instructions of the ", isa, " build of the cpu kernels");
        current_build.store(&b);
        return;
    }
    std::ostringstream known;
    for (const Build &b : kBuilds) known << " " << b.isa;
    TORCH_CHECK_VALUE(false, "no ", isa, " build of the cpu kernels; built:", known.str());
}

#define PDSERVE_STR2(x) #x
#define PDSERVE_STR(x) PDSERVE_STR2(x)
std::string torch_version() { return PDSERVE_STR(PDSERVE_TORCH_VERSION); }  // setup.py: torch.__version__

}  // namespace

TORCH_LIBRARY(pdserve, m) {
    m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
          "Tensor context_lens, float scale, int sliding_window=0) -> Tensor");
    m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!)? residual=None) -> Tensor");
    m.def("silu_and_mul(Tensor gate_up) -> Tensor");
    m.def("rotary_and_write_kv(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, "
          "Tensor slot_mapping) -> ()");
    m.def("causal_softmax_(Tensor(a!) scores, int rows, float scale) -> ()");
    m.def("linear_small_m(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
    m.def("linear_packed_bf16(Tensor x, int weight_ptr, int out_features, int padded_k, Tensor? bias=None) -> Tensor");
    m.def("linear_blocks(Tensor x, Tensor qs, Tensor scales, Tensor? bias=None, bool q8_activations=False) -> Tensor");
    m.def("linear_w8a8(Tensor x, Tensor wq, Tensor w_scale, Tensor? bias=None) -> Tensor");
    m.def("prefill_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, "
          "Tensor context_lens, Tensor block_tables, float scale) -> Tensor");
    m.def("decode_layers_fused(Tensor(a!) residual, Tensor x, Tensor cos, Tensor sin, Tensor slot_mapping, "
          "Tensor block_tables, Tensor context_lens, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, int[] weight_ptrs, "
          "int[] padded_k, Tensor?[] linear_biases, Tensor[] post_norm, Tensor[] next_norm, int[] windows, "
          "int num_heads, int intermediate, float eps, float scale, int weight_blocks=0, int[] scale_ptrs=[]) "
          "-> Tensor");
    m.def("decode_layers(Tensor(a!) residual, Tensor x, Tensor cos, Tensor sin, Tensor slot_mapping, "
          "Tensor block_tables, Tensor context_lens, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, "
          "Tensor[] linear_weights, Tensor?[] linear_aux, Tensor?[] linear_biases, Tensor[] post_norm, "
          "Tensor[] next_norm, int[] windows, int linear_form, float eps, float scale) -> Tensor");
    // The ISA builds, and the torch this library was compiled against (kernels/cpu_ops.py checks it at load).
    m.def("cpu_isa() -> str", &cpu_isa);
    m.def("cpu_isas() -> str[]", &cpu_isas);
    m.def("set_cpu_isa(str isa) -> ()", &set_cpu_isa);
    m.def("torch_version() -> str", &torch_version);
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
    m.impl("paged_decode_attention", &paged_decode_attention);
    m.impl("rms_norm", &rms_norm);
    m.impl("silu_and_mul", &silu_and_mul);
    m.impl("rotary_and_write_kv", &rotary_and_write_kv);
    m.impl("causal_softmax_", &causal_softmax_);
    m.impl("linear_small_m", &linear_small_m);
    m.impl("linear_packed_bf16", &linear_packed_bf16);
    m.impl("linear_blocks", &linear_blocks);
    m.impl("linear_w8a8", &linear_w8a8);
    m.impl("prefill_attention", &prefill_attention);
    m.impl("decode_layers_fused", &decode_layers_fused);
    m.impl("decode_layers", &decode_layers);
}

// decode_layers takes oneDNN's prepacked weights (opaque MkldnnCPU tensors) among its CPU ones: the dispatcher then
// picks the MkldnnCPU key.
TORCH_LIBRARY_IMPL(pdserve, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
