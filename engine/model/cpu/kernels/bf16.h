/* bfloat16 <-> fp32 in plain C that gcc vectorises (it does not through memcpy type punning):
 * bf16 is the top half of an fp32, rounded to nearest, ties to even. And IEEE fp16 -> fp32 in
 * plain C (exact: every fp16 is an fp32), for builds without F16C. */
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

static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu;
    const uint32_t mantissa = h & 0x3FFu;
    Float32Bits f;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24, exact in fp32 */
        f.value = (float)mantissa * 0x1p-24f;
        f.bits |= sign;
    } else if (exponent == 0x1F) { /* inf, NaN (its payload kept, quieted as F16C does) */
        f.bits = sign | 0x7F800000u | (mantissa << 13) | (mantissa ? 0x400000u : 0u);
    } else { /* the exponent rebiased from 15 to 127 */
        f.bits = sign | (exponent + 112) << 23 | mantissa << 13;
    }
    return f.value;
}

#endif
