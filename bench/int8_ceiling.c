/* The int8 GEMM's ceiling on this CPU: its inner loop's instruction mix (kernels/cpu_int8_gemm.c) with nothing to
 * load or store, on every thread at once. What the GEMM cannot exceed whatever its tiles; bench/small_linear.py
 * --ceiling compiles this with the system's C compiler and reports the GEMM's GOPS as a fraction of it, measured in
 * the same run (VMs here change speed from minute to minute, so a ceiling from another run says little).
 *
 * Usage: int8_ceiling MIX THREADS -> one line "MIX THREADS GOPS CHECKSUM", GOPS = 2 x products / s (a multiply and
 * an add each, as the GEMM's own GOPS count them; CHECKSUM only keeps the products live). MIX:
 *   avx2         VPMADDUBSW + VPMADDWD (against ones) + VPADDD per 32 products, 256-bit (the avx2 build's)
 *   avx512       the same three instructions, 512-bit, 64 products (the avx512 build's, without VNNI)
 *   avx512_vnni  one VPDPBUSD per 64 products (the avx512_vnni and avx512_bf16 builds')
 * Six independent accumulator chains a thread: enough to cover each instruction's latency (3-5 cycles) on the CPUs
 * measured so far, few enough to stay in AVX2's 16 registers (LOOP below).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define ITERS 40000000L
#define CHAINS 6  /* accumulator chains a thread (LOOP below) */

/* Each returns a value that depends on every product, so nothing is optimized away. The six chains multiply six
 * different pairs of two opaque operands (w, x and a constant; the empty asm keeps w and x from being known, so no
 * product is shared between chains or hoisted out of the loop), which leaves the accumulators in registers (six of
 * them, four operands and a temporary: eleven of AVX2's sixteen). STEP(a, p, q) is one chain's step. */
#define LOOP(VEC, SET1, ZERO, CONSTRAINT, REDUCE)                                                                     \
    VEC w = SET1((char)(seed + 1)), x = SET1(3);                                                                     \
    VEC a0 = ZERO(), a1 = ZERO(), a2 = ZERO(), a3 = ZERO(), a4 = ZERO(), a5 = ZERO();                                \
    for (long i = 0; i < iters; i++) {                                                                               \
        a0 = STEP(a0, w, x); a1 = STEP(a1, x, w); a2 = STEP(a2, w, w);                                               \
        a3 = STEP(a3, x, x); a4 = STEP(a4, w, c); a5 = STEP(a5, x, c);                                               \
        __asm__ volatile("" : CONSTRAINT(w), CONSTRAINT(x));                                                         \
    }                                                                                                                \
    return REDUCE(a0) + REDUCE(a1) + REDUCE(a2) + REDUCE(a3) + REDUCE(a4) + REDUCE(a5);

#define YMM(v) "+x"(v)
#define ZMM(v) "+v"(v)
#define FIRST256(v) _mm256_extract_epi32(v, 0)

__attribute__((target("avx2"), noinline)) static int mix_avx2(long iters, int seed) {
    const __m256i ones = _mm256_set1_epi16(1), c = _mm256_set1_epi8(5);
#define STEP(a, p, q) _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(p, q), ones))
    LOOP(__m256i, _mm256_set1_epi8, _mm256_setzero_si256, YMM, FIRST256)
#undef STEP
}

__attribute__((target("avx512f,avx512bw"), noinline)) static int mix_avx512(long iters, int seed) {
    const __m512i ones = _mm512_set1_epi16(1), c = _mm512_set1_epi8(5);
#define STEP(a, p, q) _mm512_add_epi32(a, _mm512_madd_epi16(_mm512_maddubs_epi16(p, q), ones))
    LOOP(__m512i, _mm512_set1_epi8, _mm512_setzero_si512, ZMM, _mm512_reduce_add_epi32)
#undef STEP
}

__attribute__((target("avx512f,avx512bw,avx512vnni"), noinline)) static int mix_vnni(long iters, int seed) {
    const __m512i c = _mm512_set1_epi8(5);
#define STEP(a, p, q) _mm512_dpbusd_epi32(a, p, q)
    LOOP(__m512i, _mm512_set1_epi8, _mm512_setzero_si512, ZMM, _mm512_reduce_add_epi32)
#undef STEP
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s avx2|avx512|avx512_vnni THREADS\n", argv[0]);
        return 2;
    }
    const char *mix = argv[1];
    const int threads = atoi(argv[2]);
    int (*fn)(long, int) = NULL;
    double products_per_iter = 0;
    __builtin_cpu_init();
    if (!strcmp(mix, "avx2") && __builtin_cpu_supports("avx2")) fn = mix_avx2, products_per_iter = 32.0 * CHAINS;
    else if (!strcmp(mix, "avx512") && __builtin_cpu_supports("avx512bw"))
        fn = mix_avx512, products_per_iter = 64.0 * CHAINS;
    else if (!strcmp(mix, "avx512_vnni") && __builtin_cpu_supports("avx512vnni"))
        fn = mix_vnni, products_per_iter = 64.0 * CHAINS;
    if (!fn || threads < 1) {
        fprintf(stderr, "%s: this CPU cannot run mix %s (or threads < 1)\n", argv[0], mix);
        return 2;
    }
    int checksum = 0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    #pragma omp parallel num_threads(threads) reduction(+ : checksum)
    checksum += fn(ITERS, omp_get_thread_num());
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    printf("%s %d %.1f %d\n", mix, threads, 2.0 * products_per_iter * ITERS * threads / s / 1e9, checksum);
    return 0;
}
