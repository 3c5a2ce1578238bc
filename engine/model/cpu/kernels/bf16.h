/* bfloat16 <-> fp32 in plain C that gcc vectorises (it does not through memcpy type punning):
 * bf16 is the top half of an fp32, rounded to nearest, ties to even. */
#ifndef MODELYARD_BF16_H
#define MODELYARD_BF16_H

#include <stdint.h>

typedef union {
    uint32_t bits;
    float value;
} Float32Bits;

static inline float bf16_to_f32(uint16_t h) {
    const Float32Bits f = {.bits = (uint32_t)h << 16};
    return f.value;
}

static inline uint16_t f32_to_bf16(float value) { /* NaN stays NaN (quieted) */
    const Float32Bits f = {.value = value};
    if ((f.bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((f.bits >> 16) | 0x40u);
    return (uint16_t)((f.bits + 0x7fffu + ((f.bits >> 16) & 1u)) >> 16);
}

#endif
