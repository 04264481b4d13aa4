/* bf16 <-> fp32 for the C kernels (cpu_decode.c, cpu_layer_ops.c): widening is exact (bits << 16); narrowing
 * rounds to nearest even, as torch's .to(torch.bfloat16) does, and keeps NaN a NaN. */
#ifndef PDSERVE_CPU_BF16_H
#define PDSERVE_CPU_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                            /* round to nearest even */
    return (uint16_t)(u >> 16);
}

#endif
