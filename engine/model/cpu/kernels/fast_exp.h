/* e^x for x <= 0 in plain C that gcc vectorises (libm's expf stays scalar without -ffast-math),
 * and the SiLU and tanh-approximated GELU built on it, shared by the kernels. */
#ifndef MODELYARD_FAST_EXP_H
#define MODELYARD_FAST_EXP_H

#include <math.h>
#include <stdint.h>

/* e^x for x <= 0 (max-subtracted scores, -|x|): 2^n times a degree-6 polynomial of the
 * Cody-Waite reduced argument. NaN stays NaN; x below -87.3 (including -inf) gives 0. */
static inline float exp_nonpositive(float x) {
    const float clamped = x > -87.3f ? x : -87.3f; /* NaN -> -87.3 here, restored below */
    /* n = round(x / ln 2): adding 1.5 * 2^23 rounds to an integer (floorf would not vectorise) */
    const float n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    /* 2^n built in the exponent bits; a union, as gcc does not vectorise through memcpy */
    const union {
        int32_t bits;
        float value;
    } two_n = {.bits = ((int32_t)n + 127) << 23};
    return x > -87.3f ? y * two_n.value : (x == x ? 0.0f : x);
}

/* silu(x) = x * sigmoid(x), sigmoid through e^-|x| so that nothing overflows. */
static inline float silu(float x) {
    const float e = exp_nonpositive(-fabsf(x));
    return x * (x >= 0.0f ? 1.0f : e) / (1.0f + e);
}

/* gelu(x) with torch's tanh approximation, 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715
 * x^3): the same as x * sigmoid(2 u), which e^-|2u| gives without overflow (as silu's). */
static inline float gelu_tanh(float x) {
    const float u2 = 1.5957691216057308f * (x + 0.044715f * x * x * x);
    const float e = exp_nonpositive(-fabsf(u2));
    return x * (u2 >= 0.0f ? 1.0f : e) / (1.0f + e);
}

#endif
